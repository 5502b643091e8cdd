"""`dit-accel export` (a DiTPipeline folder) and `dit-accel import-dit` (an original DiT .pt), with tiny models:
a random 2-block DiT (every weight non-zero, so class and timestep reach the output) and a tiny AutoencoderKL.
"""

import os

import pytest
import torch
from diffusers import DiTPipeline

from dit_accel.convert.export import main as export_main
from dit_accel.convert.export import write_pipeline
from dit_accel.convert.imports import import_main
from dit_accel.data.demo import demo_vae
from dit_accel.models.dit import build_model, conditioning_embedder, timestep_freq_shift
from dit_accel.models.original_dit import load_original_dit
from dit_accel.sample import command as sample
from dit_accel.sample.generate import sample_generators, sample_latents
from planner.spec import custom_spec

RESOLUTION = 64  # 8x8 latents through a 4-level VAE
DEPTH, HIDDEN, HEADS, PATCH = 2, 32, 2, 2


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae") / "vae"
    demo_vae(RESOLUTION).save_pretrained(folder)
    return folder


def random_model(num_classes: int, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(
        custom_spec(DEPTH, HIDDEN, HEADS, PATCH, RESOLUTION, num_classes=num_classes), init="torch"
    ).eval()


def load_pipeline(folder) -> DiTPipeline:
    pipe = DiTPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_latents(pipe: DiTPipeline, labels, generators, steps: int, cfg: float):
    """Run the stock pipeline and catch what it hands the VAE (latents / scaling_factor)."""
    caught = {}
    decode = pipe.vae.decode

    def spy(z, *args, **kwargs):
        caught["z"] = z.clone()
        return decode(z, *args, **kwargs)

    pipe.vae.decode = spy
    images = pipe(
        class_labels=labels,
        guidance_scale=cfg,
        generator=generators,
        num_inference_steps=steps,
        output_type="pt",
    ).images
    pipe.vae.decode = decode
    return caught["z"] * pipe.vae.config.scaling_factor, images


def test_exported_pipeline_gives_the_same_latents_as_dit_accel_sample(vae_dir, tmp_path):
    model = random_model(num_classes=4)  # fewer classes than DiTPipeline's fixed null label 1000
    names = ["red circle", "green square, box", "blue triangle", "yellow diamond"]
    out = write_pipeline(model, str(vae_dir), tmp_path / "pipe", names)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    umask = os.umask(0)
    os.umask(umask)
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    assert weights.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600: others may read it

    pipe = load_pipeline(out)  # offline: HF_HUB_OFFLINE=1 (conftest)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    assert pipe.scheduler.config.beta_schedule == "linear" and pipe.scheduler.config.beta_end == 0.02
    assert pipe.labels["box"] == 1 and pipe.get_label_ids(["yellow diamond"]) == [3]
    assert pipe.transformer.config.num_embeds_ada_norm == 1000

    labels, indices, seed, steps = [0, 3, 1], [0, 1, 2], 7, 8
    spec = sample.load_source(out).spec  # the exported folder also reads back as a dit-accel source
    for cfg in (4.0, 1.0):
        theirs, their_images = pipeline_latents(pipe, labels, sample_generators(seed, indices), steps, cfg)
        settings = sample.SampleSettings(cfg_scale=cfg, steps=steps, sampler="ddim", seed=seed)
        ours = sample_latents(model, model.dit_spec, labels, indices, settings)
        scale = ours.abs().max()
        assert torch.allclose(ours, theirs, atol=1e-5 * scale, rtol=0), (ours - theirs).abs().max()
        decoder = sample.load_decoder(spec, str(out / "vae"), "cpu")
        assert torch.allclose((decoder(ours) + 1) / 2, their_images, atol=1e-4)
    # Guidance is live: the guided and unguided latents differ.
    unguided = sample_latents(
        model,
        model.dit_spec,
        labels,
        indices,
        sample.SampleSettings(cfg_scale=1.0, steps=steps, sampler="ddim", seed=seed),
    )
    guided = sample_latents(
        model,
        model.dit_spec,
        labels,
        indices,
        sample.SampleSettings(cfg_scale=4.0, steps=steps, sampler="ddim", seed=seed),
    )
    assert not torch.allclose(guided, unguided, atol=1e-3)

    # The padded table: the real classes and the null class keep their rows; the filler rows are the null row.
    table = conditioning_embedder(pipe.transformer).class_embedder.embedding_table.weight
    ours_table = conditioning_embedder(model).class_embedder.embedding_table.weight
    assert torch.equal(table[:4], ours_table[:4]) and torch.equal(table[1000], ours_table[4])
    assert torch.equal(table[4:1000], ours_table[4:5].expand(996, -1))


def test_export_cli_refuses_to_overwrite_and_too_many_classes(vae_dir, tmp_path, capsys):
    model = random_model(num_classes=1001)
    with pytest.raises(sample.UserError, match="label 1000 as the null class"):
        write_pipeline(model, str(vae_dir), tmp_path / "pipe")
    assert not (tmp_path / "pipe").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(sample.UserError, match="not an empty folder"):
        write_pipeline(random_model(4), str(vae_dir), tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    assert (
        export_main(
            ["--checkpoint", str(tmp_path / "nothing"), "--vae", str(vae_dir), "--out", str(tmp_path / "p")]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


# --- original DiT checkpoints ---------------------------------------------------------------------------------


def original_state_dict(num_classes=6, seed=0) -> dict:
    """An original-repository DiT state dict, built from its documented key names and shapes."""
    d, c, p, depth = HIDDEN, 4, PATCH, DEPTH
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    state = {
        "pos_embed": build_model(custom_spec(depth, d, HEADS, p, RESOLUTION)).pos_embed.pos_embed.clone(),
        "x_embedder.proj.weight": rand(d, c, p, p),
        "x_embedder.proj.bias": rand(d),
        "t_embedder.mlp.0.weight": rand(d, 256),
        "t_embedder.mlp.0.bias": rand(d),
        "t_embedder.mlp.2.weight": rand(d, d),
        "t_embedder.mlp.2.bias": rand(d),
        "y_embedder.embedding_table.weight": rand(num_classes + 1, d),
        "final_layer.adaLN_modulation.1.weight": rand(2 * d, d),
        "final_layer.adaLN_modulation.1.bias": rand(2 * d),
        "final_layer.linear.weight": rand(p * p * 2 * c, d),
        "final_layer.linear.bias": rand(p * p * 2 * c),
    }
    for n in range(depth):
        block = f"blocks.{n}."
        state.update(
            {
                block + "attn.qkv.weight": rand(3 * d, d),
                block + "attn.qkv.bias": rand(3 * d),
                block + "attn.proj.weight": rand(d, d),
                block + "attn.proj.bias": rand(d),
                block + "mlp.fc1.weight": rand(4 * d, d),
                block + "mlp.fc1.bias": rand(4 * d),
                block + "mlp.fc2.weight": rand(d, 4 * d),
                block + "mlp.fc2.bias": rand(d),
                block + "adaLN_modulation.1.weight": rand(6 * d, d),
                block + "adaLN_modulation.1.bias": rand(6 * d),
            }
        )
    return state


def test_import_dit_makes_a_checkpoint_that_is_the_original_and_samples(vae_dir, tmp_path, capsys):
    original = original_state_dict()
    torch.save(original, tmp_path / "DiT-tiny.pt")
    assert (
        import_main(
            [
                "--checkpoint",
                str(tmp_path / "DiT-tiny.pt"),
                "--out",
                str(tmp_path / "imported"),
                "--heads",
                str(HEADS),
            ]
        )
        == 0
    )
    assert "original timestep shift (0)" in capsys.readouterr().out

    # The trainer's own reader finds it: a complete step-0 checkpoint of the right network.
    for use_ema in (True, False):
        source = sample.load_source(tmp_path / "imported", use_ema=use_ema)
        model = source.model
        assert (source.spec.depth, source.spec.hidden, source.spec.num_classes) == (DEPTH, HIDDEN, 6)
        assert source.info["step"] == 0 and timestep_freq_shift(model) == 0
        # Every weight is the original's, renamed (and the fused qkv split in q, k, v order).
        d = HIDDEN
        block = model.transformer_blocks[1]
        qkv_weight = torch.cat([block.attn1.to_q.weight, block.attn1.to_k.weight, block.attn1.to_v.weight])
        assert torch.equal(qkv_weight, original["blocks.1.attn.qkv.weight"])
        assert torch.equal(block.attn1.to_v.bias, original["blocks.1.attn.qkv.bias"][2 * d :])
        assert torch.equal(block.norm1.linear.weight, original["blocks.1.adaLN_modulation.1.weight"])
        assert torch.equal(block.ff.net[2].weight, original["blocks.1.mlp.fc2.weight"])
        embedder = conditioning_embedder(model)
        assert torch.equal(
            embedder.class_embedder.embedding_table.weight, original["y_embedder.embedding_table.weight"]
        )
        assert torch.equal(embedder.timestep_embedder.linear_1.weight, original["t_embedder.mlp.0.weight"])
        assert torch.equal(model.proj_out_2.weight, original["final_layer.linear.weight"])
        assert torch.equal(model.pos_embed.proj.weight, original["x_embedder.proj.weight"])

    # ... and computes what the model helper's loader (held to a reference forward of the original) computes.
    reference = load_original_dit(original, heads=HEADS)
    generator = torch.Generator().manual_seed(0)
    x, t, y = (
        torch.randn(3, 4, 8, 8, generator=generator),
        torch.tensor([0, 500, 999]),
        torch.tensor([0, 5, 6]),
    )
    with torch.no_grad():
        assert torch.equal(
            model(x, timestep=t, class_labels=y).sample, reference(x, timestep=t, class_labels=y).sample
        )

    # It samples (no VAE is recorded with an import: --vae), and exports only with the shift change allowed.
    assert (
        sample.main(
            [
                "--checkpoint",
                str(tmp_path / "imported"),
                "--vae",
                str(vae_dir),
                "--classes",
                "0,5",
                "--steps",
                "3",
                "--out",
                str(tmp_path / "grid.png"),
            ]
        )
        == 0
    )
    assert len(list((tmp_path / "grid_images").iterdir())) == 2
    export = [
        "--checkpoint",
        str(tmp_path / "imported"),
        "--vae",
        str(vae_dir),
        "--out",
        str(tmp_path / "pipe"),
    ]
    capsys.readouterr()
    assert export_main(export) == 2
    assert "--allow-freq-shift-change" in capsys.readouterr().err
    assert export_main([*export, "--allow-freq-shift-change"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "frequency shift" in line]
    assert len(err) == 1 and err[0].startswith(
        "dit-accel export: warning: this model uses the original DiT's"
    )
    assert "UserWarning" not in err[0]  # one line of the command's, not Python's warning with its source line
    assert load_pipeline(tmp_path / "pipe").transformer.config.num_embeds_ada_norm == 1000


def test_import_dit_refuses_what_is_not_an_original_checkpoint(tmp_path, capsys):
    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pt")
    partial = original_state_dict()  # a partial state dict: once a KeyError and a 20-line traceback
    del partial["final_layer.linear.weight"], partial["blocks.1.attn.qkv.bias"]
    torch.save(partial, tmp_path / "partial.pt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    torch.save(original_state_dict(), tmp_path / "dit.pt")
    for argv, message in [
        (["--checkpoint", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "a")], "is not a file"),
        (
            ["--checkpoint", str(tmp_path / "other.pt"), "--out", str(tmp_path / "a")],
            "not an original DiT state dict",
        ),
        (
            ["--checkpoint", str(tmp_path / "partial.pt"), "--out", str(tmp_path / "a"), "--heads", "2"],
            "incomplete: it lacks final_layer.linear.weight, blocks.1.attn.qkv.bias (",
        ),
        (["--checkpoint", str(tmp_path / "dit.pt"), "--out", str(tmp_path / "a")], "pass heads"),
        (
            ["--checkpoint", str(tmp_path / "dit.pt"), "--out", str(tmp_path / "busy"), "--heads", "2"],
            "not an empty folder",
        ),
    ]:
        assert import_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "a").exists() and (tmp_path / "busy" / "x").exists()
