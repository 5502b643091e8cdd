"""hustvl/LightningDiT's published latents read as a latent cache, without re-extraction (data.latent_cache): a
folder written here in their layout (latents_rankRR_shardSSS.safetensors holding latents, latents_flip and
labels; latents_stats.pt), checked like our own caches, normalised by its statistics, trained on; a payload in
the statistics file never runs."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dit_accel.data.latent_cache import LatentCache, read_manifest, verify_cache
from dit_accel.errors import UserError

C, SIDE = 32, 2


def write_published(folder, counts=(6, 5), seed=0, stats=True):
    """Their extract_features.py's layout: per shard latents and latents_flip (N, C, h, w), labels (N,)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for shard, n in enumerate(counts):
        tensors = {
            "latents": torch.randn(n, C, SIDE, SIDE, generator=g) * 3 + 1,
            "latents_flip": torch.randn(n, C, SIDE, SIDE, generator=g) * 3 + 1,
            "labels": torch.randint(0, 4, (n,), generator=g),
        }
        save_file(
            tensors,
            str(folder / f"latents_rank00_shard{shard:03d}.safetensors"),
            metadata={"total_size": str(n)},
        )
    if stats:
        torch.save(
            {"mean": torch.ones(1, C, 1, 1), "std": torch.full((1, C, 1, 1), 3.0)},
            folder / "latents_stats.pt",
        )
    return folder


def test_a_published_folder_reads_as_a_cache_normalised_by_its_statistics(tmp_path):
    folder = write_published(tmp_path / "imagenet_train_256")
    manifest = read_manifest(folder)
    assert manifest["latent_shape"] == [C, SIDE, SIDE] and manifest["resolution"] == SIDE * 16  # VA-VAE f16
    assert (
        manifest["count"] == 11 and manifest["latent_norm"]["kind"] == "channel" and manifest["vae"] is None
    )
    assert verify_cache(folder) == sum((folder / s["file"]).stat().st_size for s in manifest["shards"])
    cache = LatentCache(folder, flip=False, seed=0)
    assert len(cache) == 11 and cache.views == 2 and cache.published
    from safetensors.torch import load_file

    second = load_file(str(folder / "latents_rank00_shard001.safetensors"))
    latent, label = cache[7]  # the second shard's row 1
    torch.testing.assert_close(latent, (second["latents"][1] - 1) / 3)
    assert label == second["labels"][1]
    mean, std = cache.posterior(7, view=1)
    assert torch.equal(mean, second["latents_flip"][1]) and not std.any()
    flipping = LatentCache(folder, flip=True, seed=0)  # each entry's view drawn from its own generator
    views = []
    for index in range(11):
        got = flipping[index][0]
        first = load_file(str(folder / f"latents_rank00_shard{int(index >= 6):03d}.safetensors"))
        row = index - 6 * int(index >= 6)
        views.append(0 if torch.allclose(got, (first["latents"][row] - 1) / 3) else 1)
        assert torch.allclose(got, (first[("latents", "latents_flip")[views[-1]]][row] - 1) / 3)
    assert 0 < sum(views) < 11  # both views come up


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            lambda f: (f / "latents_rank00_shard001.safetensors").write_bytes(b"\0" * 8),
            "not a readable safetensors",
        ),
        (
            lambda f: save_file(
                {"latents": torch.zeros(2, C, SIDE, SIDE), "labels": torch.zeros(2, dtype=torch.int64)},
                str(f / "latents_rank00_shard001.safetensors"),
            ),
            "lacks latents_flip",
        ),
        (
            lambda f: save_file(
                {
                    "latents": torch.zeros(2, C, SIDE, SIDE),
                    "latents_flip": torch.zeros(3, C, SIDE, SIDE),
                    "labels": torch.zeros(2, dtype=torch.int64),
                },
                str(f / "latents_rank00_shard001.safetensors"),
            ),
            "the three must count the same entries",
        ),
        (
            lambda f: save_file(
                {
                    "latents": torch.zeros(2, C, SIDE, SIDE),
                    "latents_flip": torch.zeros(2, C, SIDE, SIDE),
                    "labels": torch.tensor([0, 1000]),
                },
                str(f / "latents_rank00_shard001.safetensors"),
            ),
            "labels run 0..1000, outside ImageNet's 0..999",
        ),
        (
            lambda f: torch.save({"mean": torch.zeros(4), "std": torch.ones(4)}, f / "latents_stats.pt"),
            "has 4 channels, the latents 32",
        ),
        (lambda f: torch.save({"mean": torch.zeros(C)}, f / "latents_stats.pt"), "hold no mean and std"),
        (
            lambda f: save_file(
                {
                    "latents": torch.zeros(2, 1, C, SIDE, SIDE),
                    "latents_flip": torch.zeros(2, 1, C, SIDE, SIDE),
                    "labels": torch.tensor([0, 1]),
                },
                str(f / "latents_rank00_shard001.safetensors"),
            ),
            "holds latents of 5 dimensions",
        ),
    ],
    ids=["not-safetensors", "no-mirror", "counts", "labels", "stats-channels", "stats-keys", "5-d"],
)
def test_a_damaged_published_folder_is_refused_in_one_line(tmp_path, damage, expected):
    folder = write_published(tmp_path / "latents")
    damage(folder)
    with pytest.raises(UserError, match=expected):
        read_manifest(folder)


def test_a_shard_downloaded_twice_under_another_name_is_read_once_or_refused(tmp_path):
    """A published folder is read by listing: a re-downloaded shard beside the first doubled its entries.
    Two shards of one count share a header; their contents tell them apart."""
    import shutil

    folder = write_published(tmp_path / "latents", counts=(5, 5))
    assert read_manifest(folder)["count"] == 10  # same size, same header, other latents: two shards
    shutil.copy(
        folder / "latents_rank00_shard001.safetensors", folder / "latents_rank00_shard001 (1).safetensors"
    )
    with pytest.raises(
        UserError, match=r"holds the same shard twice \(latents_rank00_shard001 \(1\)\.safetensors and "
    ):
        read_manifest(folder)


def test_a_payload_in_latents_stats_never_runs(tmp_path):
    folder = write_published(tmp_path / "latents")
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save(
        {"mean": torch.ones(1, C, 1, 1), "std": torch.ones(1, C, 1, 1), "x": Payload()},
        folder / "latents_stats.pt",
    )
    with pytest.raises(UserError, match="latents_stats.pt cannot be read as plain data.*refused"):
        read_manifest(folder)
    assert not marker.exists()


def test_an_image_folder_passed_as_latents_is_named_as_one(tmp_path):
    from dit_accel.data.demo import write_demo_data

    images = write_demo_data(tmp_path / "demo64", classes=2, per_class=2, resolution=16)
    with pytest.raises(UserError) as refused:
        read_manifest(images)
    message = str(refused.value)
    assert "is an image folder (or dataset), not a latent cache" in message
    assert (
        f"--data-path {images}" in message
        and "incomplete" not in message
        and f"--out {images}" not in message
    )


def test_a_lightningdit_trains_on_published_latents(tmp_path, capsys):
    from test_train_e2e import run_in_process

    from planner.cli import main as dit_plan

    folder = write_published(tmp_path / "latents", counts=(8, 8))
    plan = tmp_path / "plan"
    argv = [
        "--model",
        "LightningDiT-B/1",
        "--depth",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--num-classes",
        "1000",
    ]
    argv += ["--resolution", "32", "--gpus", "1", "--vram", "8G", "--global-batch", "8", "--out", str(plan)]
    assert dit_plan(argv) == 0
    run = tmp_path / "run"
    train = ["--plan", plan / "plan.json", "--latents", folder, "--output-dir", run, "--max-steps", 2]
    train += [
        "--num-workers",
        "0",
        "--no-progress-bar",
        "--no-tensorboard",
        "--config",
        "lightningdit-xl1-64ep",
    ]
    assert run_in_process(train) == 2  # the recipe samples a grid every 20K steps: with what VAE?
    assert "name none (published latents); pass --vae VAE" in capsys.readouterr().err
    assert run_in_process([*train, "--sample-every", "0"]) == 0
    sidecar = json.loads((run / "checkpoints" / "step_00000002" / "dit_accel.json").read_text())
    assert (
        sidecar["latent_norm"]["shift"] == [1.0] * C
        and sidecar["latent_norm"]["scale"] == [pytest.approx(1 / 3)] * C
    )
    assert np.isfinite(
        [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    ).all()

    # the doctor with a VAE beside the published folder (which names none): a TypeError traceback once
    from dit_accel.data.demo import write_demo_data, write_demo_vae
    from dit_accel.doctor import main as doctor

    write_demo_data(tmp_path / "images", classes=2, per_class=2, resolution=32, seed=0)
    write_demo_vae(tmp_path / "vae", tmp_path / "images", family="va-vae")
    capsys.readouterr()
    code = doctor(
        ["--plan", str(plan / "plan.json"), "--latents", str(folder), "--vae", str(tmp_path / "vae")]
    )
    out = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in out.err + out.out, out.err[-2000:]
    assert "latent cache" in out.out
