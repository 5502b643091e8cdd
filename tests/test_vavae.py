"""VA-VAE (models.vavae): a released-layout checkpoint, made here with random weights under the LDM autoencoder's
key names, read into diffusers' AutoencoderKL gives the posterior and the decoding of the test's own reading of
the LDM code (hustvl/LightningDiT tokenizer/autoencoder.py: ResnetBlock, AttnBlock with 1x1 convolutions, the
asymmetric downsampling pad, nearest upsampling, the decoder's levels run in reverse); per-channel latent
normalisation and its statistics."""

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from dit_accel.errors import UserError
from dit_accel.models.vae import LatentNorm, load_vae, read_latent_statistics

BASE, MULTS, BLOCKS, LATENT, ATTN_LEVEL = 32, (1, 1, 2, 2, 4), 2, 32, 4


def ldm_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the released VA-VAE layout (encoder/decoder/quant_conv/post_quant_conv), plus the
    training-only tensors the released file carries."""
    g = torch.Generator().manual_seed(seed)
    state = {}

    def conv(name, cin, cout, k=3):
        state[name + ".weight"] = torch.randn(cout, cin, k, k, generator=g) * (0.3 / (cin * k * k) ** 0.5)
        state[name + ".bias"] = torch.randn(cout, generator=g) * 0.01

    def norm(name, c):
        state[name + ".weight"] = 1 + 0.1 * torch.randn(c, generator=g)
        state[name + ".bias"] = 0.1 * torch.randn(c, generator=g)

    def resnet(name, cin, cout):
        norm(name + ".norm1", cin), conv(name + ".conv1", cin, cout), norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout)
        if cin != cout:
            conv(name + ".nin_shortcut", cin, cout, 1)

    def attention(name, c):
        norm(name + ".norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    conv("encoder.conv_in", 3, BASE)
    channels = [BASE * m for m in MULTS]
    cin = BASE
    for level, cout in enumerate(channels):
        for block in range(BLOCKS):
            resnet(f"encoder.down.{level}.block.{block}", cin, cout)
            cin = cout
            if level == ATTN_LEVEL:
                attention(f"encoder.down.{level}.attn.{block}", cout)
        if level != len(channels) - 1:
            conv(f"encoder.down.{level}.downsample.conv", cout, cout)
    resnet("encoder.mid.block_1", cin, cin), attention("encoder.mid.attn_1", cin)
    resnet("encoder.mid.block_2", cin, cin), norm("encoder.norm_out", cin)
    conv("encoder.conv_out", cin, 2 * LATENT)
    conv("quant_conv", 2 * LATENT, 2 * LATENT, 1), conv("post_quant_conv", LATENT, LATENT, 1)
    top = channels[-1]
    conv("decoder.conv_in", LATENT, top)
    resnet("decoder.mid.block_1", top, top), attention("decoder.mid.attn_1", top)
    resnet("decoder.mid.block_2", top, top)
    cin = top
    for level in reversed(range(len(channels))):
        cout = channels[level]
        for block in range(BLOCKS + 1):
            resnet(f"decoder.up.{level}.block.{block}", cin, cout)
            cin = cout
            if level == ATTN_LEVEL:
                attention(f"decoder.up.{level}.attn.{block}", cout)
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", cout, cout)
    norm("decoder.norm_out", cin), conv("decoder.conv_out", cin, 3)
    state["foundation_model.model.patch_embed.weight"] = torch.zeros(4, 3)  # DINOv2, for the alignment loss
    state["linear_proj.weight"] = torch.zeros(8, LATENT)
    state["loss.logvar"] = torch.zeros(())
    return state


def ldm_forward(state, x):
    """The LDM autoencoder's encode (posterior mean and std) and decode of that mean, on its own state dict."""

    def gn(h, name):
        return F.group_norm(h, 32, state[name + ".weight"], state[name + ".bias"], eps=1e-6)

    def conv(h, name, stride=1, padding=1):
        return F.conv2d(h, state[name + ".weight"], state[name + ".bias"], stride=stride, padding=padding)

    def resnet(h, name):
        x = conv(F.silu(gn(h, name + ".norm1")), name + ".conv1")
        x = conv(F.silu(gn(x, name + ".norm2")), name + ".conv2")
        short = conv(h, name + ".nin_shortcut", padding=0) if name + ".nin_shortcut.weight" in state else h
        return short + x

    def attn(h, name):
        n = gn(h, name + ".norm")
        q, k, v = (conv(n, f"{name}.{p}", padding=0) for p in "qkv")
        b, c, hh, ww = q.shape
        w = torch.bmm(q.reshape(b, c, hh * ww).permute(0, 2, 1), k.reshape(b, c, hh * ww)) * c**-0.5
        out = torch.bmm(v.reshape(b, c, hh * ww), w.softmax(dim=2).permute(0, 2, 1)).reshape(b, c, hh, ww)
        return h + conv(out, name + ".proj_out", padding=0)

    h = conv(x, "encoder.conv_in")
    for level in range(len(MULTS)):
        for block in range(BLOCKS):
            h = resnet(h, f"encoder.down.{level}.block.{block}")
            if level == ATTN_LEVEL:
                h = attn(h, f"encoder.down.{level}.attn.{block}")
        if level != len(MULTS) - 1:
            h = conv(F.pad(h, (0, 1, 0, 1)), f"encoder.down.{level}.downsample.conv", stride=2, padding=0)
    h = resnet(attn(resnet(h, "encoder.mid.block_1"), "encoder.mid.attn_1"), "encoder.mid.block_2")
    h = conv(F.silu(gn(h, "encoder.norm_out")), "encoder.conv_out")
    mean, logvar = conv(h, "quant_conv", padding=0).chunk(2, dim=1)
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    z = conv(mean, "post_quant_conv", padding=0)
    h = conv(z, "decoder.conv_in")
    h = resnet(attn(resnet(h, "decoder.mid.block_1"), "decoder.mid.attn_1"), "decoder.mid.block_2")
    for level in reversed(range(len(MULTS))):
        for block in range(BLOCKS + 1):
            h = resnet(h, f"decoder.up.{level}.block.{block}")
            if level == ATTN_LEVEL:
                h = attn(h, f"decoder.up.{level}.attn.{block}")
        if level != 0:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{level}.upsample.conv")
    return mean, std, conv(F.silu(gn(h, "decoder.norm_out")), "decoder.conv_out")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    path = tmp_path_factory.mktemp("vavae") / "vavae-f16d32.pt"
    state = ldm_state()
    torch.save({"state_dict": state}, path)
    return path, state


def test_a_released_vavae_loads_into_autoencoderkl_and_encodes_and_decodes_as_the_ldm_code(released):
    path, state = released
    vae, identity = load_vae(str(path))
    assert (identity["tokenizer"], identity["latent_norm"]) == ("va-vae", "channel")
    assert type(vae).__name__ == "AutoencoderKL" and vae.config.latent_channels == LATENT
    assert vae.config.down_block_types[-1] == "AttnDownEncoderBlock2D"
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
        decoded = vae.decode(posterior.mean).sample
        mean, std, want = ldm_forward(state, x)
    assert posterior.mean.shape == (2, LATENT, 4, 4)  # 16x down
    torch.testing.assert_close(posterior.mean, mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(posterior.std, std, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(decoded, want, rtol=1e-4, atol=1e-4)


def test_a_vavae_file_that_is_not_one_is_refused_in_one_line_and_runs_nothing(released, tmp_path):
    path, state = released
    partial = tmp_path / "partial.pt"
    torch.save({k: v for k, v in state.items() if k != "decoder.conv_out.bias"}, partial)
    with pytest.raises(UserError, match=r"lacks 1 tensors \(first: decoder.conv_out.bias\)"):
        load_vae(str(partial))
    misshapen = tmp_path / "misshapen.pt"
    torch.save(dict(state, **{"decoder.conv_out.weight": torch.zeros(3, 5, 3, 3)}), misshapen)
    with pytest.raises(UserError, match="do not fit one LDM autoencoder"):
        load_vae(str(misshapen))
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    crafted = tmp_path / "crafted.pt"
    torch.save({"state_dict": state, "attack": Payload()}, crafted)
    with pytest.raises(UserError, match="holds Python objects besides tensors") as refusal:
        load_vae(str(crafted))
    assert not marker.exists()
    # the fix names no flag: extract-latents, train and sample have no --trust-checkpoint
    assert "--trust-checkpoint" not in str(refusal.value) and "save its tensors alone once" in str(
        refusal.value
    )
    for shape in ((0, 3, 3, 3), ()):
        odd = tmp_path / f"conv-{len(shape)}.pt"
        torch.save(dict(state, **{"encoder.conv_in.weight": torch.zeros(shape)}), odd)
        with pytest.raises(UserError, match=r"encoder\.conv_in\.weight has shape .*not a convolution's"):
            load_vae(str(odd))


def test_per_channel_normalisation_round_trips_and_reads_lightningdits_stats_file(tmp_path):
    mean, std = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2.0, 0.5, 1.0])
    norm = LatentNorm.of_statistics(mean, std)
    z = torch.randn(4, 3, 2, 2)
    x = norm.normalize(z)
    torch.testing.assert_close(x, (z - mean.view(3, 1, 1)) / std.view(3, 1, 1))
    torch.testing.assert_close(norm.denormalize(x), z)
    assert LatentNorm.from_json(json.loads(json.dumps(norm.to_json()))) == norm
    stats = tmp_path / "latents_stats.pt"  # LightningDiT's file: (1, C, 1, 1) tensors
    torch.save({"mean": mean.view(1, 3, 1, 1), "std": std.view(1, 3, 1, 1)}, stats)
    assert read_latent_statistics(stats) == norm
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"mean": mean, "std": std, "attack": Payload()}, stats)
    with pytest.raises(UserError, match="cannot be read as plain data.*refused"):
        read_latent_statistics(stats)
    assert not marker.exists()
    with pytest.raises(UserError, match="one finite mean and one positive std per channel"):
        LatentNorm.of_statistics([0.0, 1.0], [1.0, 0.0])


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is not JSON"),
        ("[1]", "holds a JSON list, not an object"),
        ('{"format": FORMAT, "latent_norm": "per-pixel"}', "is neither 'scale' nor 'channel'"),
        (
            '{"format": FORMAT, "latent_norm": "channel", "statistics": {"mean": "a", "std": "b"}}',
            "statistics",
        ),
        (
            '{"format": FORMAT, "latent_norm": "channel", "statistics": {"mean": [0], "std": [-1]}}',
            "statistics",
        ),
    ],
)
def test_a_vae_folders_tokenizer_record_is_checked_in_one_line(tmp_path, text, says):
    """dit_accel_vae.json garbage, a list or string statistics were tracebacks from the first reader."""
    from dit_accel.models.vae import read_tokenizer_record
    from dit_accel.models.vavae import TOKENIZER_FILE, TOKENIZER_FORMAT

    (tmp_path / TOKENIZER_FILE).write_text(text.replace("FORMAT", json.dumps(TOKENIZER_FORMAT)))
    with pytest.raises(UserError, match=re.escape(says)) as refusal:
        read_tokenizer_record(tmp_path)
    assert len(str(refusal.value).splitlines()) == 1
