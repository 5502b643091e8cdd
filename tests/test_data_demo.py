"""`dit-accel demo-data`: a deterministic, valid, learnable image folder, written all at once."""

import hashlib

import numpy as np
import pytest
from PIL import Image

from dit_accel.data.demo import COLOURS, SHAPES, class_name, main, write_demo_data
from dit_accel.data.folder import validate_image_folder
from dit_accel.errors import UserError


def _fingerprint(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.png"))
    }


def test_demo_folder_passes_full_validation_in_the_imagenet_layout(tmp_path):
    assert main([str(tmp_path / "demo"), "--classes", "5", "--per_class", "4", "--resolution", "24"]) == 0
    summary = validate_image_folder(tmp_path / "demo", full=True)
    # the names a pipeline user types; labels are their sorted order, as for any image folder
    assert summary.classes == [
        "blue_triangle",
        "green_square",
        "magenta_cross",
        "red_circle",
        "yellow_diamond",
    ]
    assert summary.images_per_class == {name: 4 for name in summary.classes}
    assert all(Image.open(tmp_path / "demo" / rel).size == (24, 24) for rel in summary.listing.paths)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_same_seed_same_bytes_other_seed_other_images(tmp_path):
    write_demo_data(tmp_path / "a", classes=2, per_class=3, resolution=16, seed=5)
    write_demo_data(tmp_path / "b", classes=2, per_class=3, resolution=16, seed=5)
    write_demo_data(tmp_path / "c", classes=2, per_class=3, resolution=16, seed=6)
    assert _fingerprint(tmp_path / "a") == _fingerprint(tmp_path / "b")
    assert _fingerprint(tmp_path / "a").keys() == _fingerprint(tmp_path / "c").keys()
    assert _fingerprint(tmp_path / "a") != _fingerprint(tmp_path / "c")


def test_every_image_shows_its_class_colour_and_images_vary(tmp_path):
    classes = 8
    write_demo_data(tmp_path / "d", classes=classes, per_class=6, resolution=32)
    assert len({class_name(i) for i in range(len(SHAPES) * len(COLOURS))}) == len(SHAPES) * len(COLOURS)
    for index in range(classes):
        colour = np.array(COLOURS[class_name(index).split("_")[0]])
        images = [
            np.asarray(Image.open(p), dtype=np.int16)
            for p in sorted((tmp_path / "d" / class_name(index)).iterdir())
        ]
        for pixels in images:
            near = (np.abs(pixels - colour).max(-1) <= 45).mean()
            assert near > 0.03, f"class {index}: only {near:.1%} of the pixels have the class colour"
        assert len({pixels.tobytes() for pixels in images}) == len(images)


def test_refuses_a_non_empty_folder_unless_forced(tmp_path, capsys):
    target = tmp_path / "demo"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert main([str(target), "--per-class", "2", "--resolution", "16"]) == 2
    assert "not empty; pick a new folder or pass --force" in capsys.readouterr().err
    assert (target / "keep.txt").exists()
    assert main([str(target), "--per-class", "2", "--resolution", "16", "--force"]) == 0
    assert not (target / "keep.txt").exists() and len(list(target.rglob("*.png"))) == 8


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(classes=0), "--classes must be between 1 and 36"),
        (dict(per_class=0), "--per-class must be at least 1"),
        (dict(resolution=4), "--resolution must be at least 8"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, arguments, message):
    with pytest.raises(UserError, match=message):
        write_demo_data(tmp_path / "x", **arguments)
    assert not (tmp_path / "x").exists()


def test_vae_writes_a_loadable_autoencoder_whose_scaled_latents_have_unit_std(tmp_path, capsys):
    import torch
    from diffusers import AutoencoderKL

    from dit_accel.models.vae import encode_posterior

    assert (
        main([str(tmp_path / "d"), "--per-class", "4", "--resolution", "16", "--vae", str(tmp_path / "v")])
        == 0
    )
    assert "2x2x4 latents" in capsys.readouterr().out
    vae = AutoencoderKL.from_pretrained(tmp_path / "v", local_files_only=True)
    pixels = torch.stack(
        [
            torch.from_numpy(np.asarray(Image.open(p), dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
            for p in sorted((tmp_path / "d").rglob("*.png"))
        ]
    )
    mean, _ = encode_posterior(vae, pixels)
    assert mean.shape == (16, 4, 2, 2)
    assert (mean * vae.config.scaling_factor).std().item() == pytest.approx(1.0, rel=1e-4)


def test_a_bad_vae_request_is_refused_before_any_image_is_drawn(tmp_path, capsys):
    assert main([str(tmp_path / "d"), "--resolution", "12", "--vae", str(tmp_path / "v")]) == 2
    assert "divisible by 8" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine").write_text("x")
    assert main([str(tmp_path / "d"), "--resolution", "16", "--vae", str(tmp_path / "taken")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert not (tmp_path / "d").exists() and not (tmp_path / "v").exists()
