"""Image folders: each validation failure is one clear UserError; the crop, flip and scaling are right."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from dit_accel.data.folder import (
    ImageFolderData,
    center_crop_adm,
    list_image_folder,
    read_classes_json,
    read_folder_index,
    validate_image_folder,
    write_classes_json,
    write_folder_index,
)
from dit_accel.errors import UserError


def _png(path, size=(40, 30), colour=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    for name, colour in (("zebra", (250, 250, 250)), ("ant", (10, 10, 10)), ("cat", (0, 120, 0))):
        for i in range(3):
            _png(root / name / f"{i}.png", colour=colour)
    (root / "cat" / "notes.txt").write_text("not an image")
    _png(root / "cat" / "nested" / "deep.PNG", colour=(0, 120, 0))  # upper-case suffix, as ImageNet
    return root


def test_listing_sorts_classes_and_files_and_maps_labels(folder):
    summary = validate_image_folder(folder)
    assert summary.classes == ["ant", "cat", "zebra"]
    assert summary.images_per_class == {"ant": 3, "cat": 4, "zebra": 3}
    assert summary.num_images == 10 and summary.ignored_files == 1 and summary.images_decoded == 0
    listing = summary.listing
    assert listing.paths[:4] == ["ant/0.png", "ant/1.png", "ant/2.png", "cat/0.png"]
    assert "cat/nested/deep.PNG" in listing.paths
    assert listing.labels == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert listing.class_to_index == {"ant": 0, "cat": 1, "zebra": 2}
    assert "10 images in 3 classes" in summary.describe()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist"),
        ("file", "is a file, not a directory"),
        ("flat", "holds 2 images directly but no class sub-folders; move them into one sub-folder per class"),
        ("nothing", "has no class sub-folders; expected one sub-folder per class"),
        ("all_empty", "no images in"),
        ("one_empty", "1 class folder in"),
    ],
)
def test_each_layout_problem_is_one_line_naming_it(tmp_path, case, expected):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case == "flat":
        _png(root / "a.png"), _png(root / "b.jpg")
    elif case == "nothing":
        root.mkdir()
        (root / "readme.txt").write_text("x")
    elif case == "all_empty":
        (root / "a").mkdir(parents=True), (root / "b").mkdir()
    elif case == "one_empty":
        _png(root / "full" / "x.png")
        (root / "hollow").mkdir()
        (root / "hollow" / "list.csv").write_text("no images here")
    with pytest.raises(UserError) as error:
        validate_image_folder(root)
    message = str(error.value)
    assert expected in message and "\n" not in message
    if case == "flat":
        assert f"{root}/<class>/<image>.jpg" in message
    if case == "one_empty":
        assert "hollow" in message and "full" not in message.split(":")[1]


def test_unreadable_folder_is_named(folder, monkeypatch):
    # Tests run as root, where chmod cannot make a folder unreadable; simulate the refusal instead.
    real_scandir = os.scandir

    def refuse(path):
        if os.fspath(path) == os.fspath(folder):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(UserError, match="is not readable .*Permission denied.*chmod"):
        list_image_folder(folder)


def test_bad_image_is_named_or_skipped_and_counted(folder):
    (folder / "ant" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    validate_image_folder(folder)  # listing only: the bad file is not opened
    with pytest.raises(UserError, match=r"cannot decode image .*ant/0\.png.*--skip-bad-images"):
        validate_image_folder(folder, sample=True)  # first image of each class
    summary = validate_image_folder(folder, full=True, skip_bad_images=True)
    assert summary.bad_images == ["ant/0.png"] and summary.images_decoded == 10
    assert summary.num_images == 9 and summary.images_per_class["ant"] == 2
    assert "ant/0.png" not in summary.listing.paths


def test_full_check_finds_a_bad_image_the_sample_misses(folder):
    (folder / "zebra" / "2.png").write_bytes(b"garbage")
    assert validate_image_folder(folder, sample=True).images_decoded == 3
    with pytest.raises(UserError, match="zebra/2.png"):
        validate_image_folder(folder, full=True)


def test_a_folder_index_is_the_listing_every_rank_reads(folder, tmp_path):
    """What the main process writes once for all ranks (the summary, the paths and labels memory-mapped)
    serves the same items as a rank's own listing, bad images it skipped included."""
    (folder / "ant" / "0.png").write_bytes(b"garbage")
    summary = validate_image_folder(folder, sample=True, skip_bad_images=True)
    index = write_folder_index(summary, tmp_path / "run" / "data_index")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["data_index"]  # no staging left behind
    read, records = read_folder_index(index)
    assert read.listing is None and read.describe() == summary.describe()
    assert (read.bad_images, read.images_per_class) == (["ant/0.png"], summary.images_per_class)
    own = ImageFolderData(folder, 8, flip=False, summary=summary, skip_bad_images=True)
    shared = ImageFolderData(folder, 8, flip=False, summary=read, records=records, skip_bad_images=True)
    assert len(shared) == len(own) == 9 and shared.bad_images_seen == own.bad_images_seen == 1
    for index_ in range(len(own)):
        assert all(torch.equal(a, b) for a, b in zip(own[index_], shared[index_]))
    write_folder_index(summary, index)  # a later start replaces it whole
    assert read_folder_index(index)[0].num_images == 9


def test_classes_json_is_written_atomically_and_read_back(tmp_path):
    path = write_classes_json(tmp_path / "run", ["ant", "cat"])
    assert json.loads(path.read_text())["class_to_index"] == {"ant": 0, "cat": 1}
    assert read_classes_json(tmp_path / "run") == ["ant", "cat"]
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["classes.json"]  # no temporary left behind


def test_adm_crop_halves_with_box_then_bicubic_then_centers():
    # 3 vertical bands: the center crop of a 600x200 image must be the middle (green) band only.
    pixels = np.zeros((200, 600, 3), dtype=np.uint8)
    pixels[:, :200] = (255, 0, 0)
    pixels[:, 200:400] = (0, 255, 0)
    pixels[:, 400:] = (0, 0, 255)
    cropped = np.asarray(center_crop_adm(Image.fromarray(pixels), 64))
    assert cropped.shape == (64, 64, 3)
    assert (cropped[:, 2:-2] == (0, 255, 0)).all()
    # The halving step: 600x200 -> 300x100 (box) -> 192x64 (bicubic), the same as doing it by hand.
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 600, 3), dtype=np.uint8))
    by_hand = image.resize((300, 100), Image.BOX).resize((192, 64), Image.BICUBIC).crop((64, 0, 128, 64))
    assert np.array_equal(np.asarray(center_crop_adm(image, 64)), np.asarray(by_hand))
    # A short side below 2x the target is not halved; an image already at the target is unchanged.
    assert np.array_equal(
        np.asarray(center_crop_adm(image.crop((0, 0, 64, 64)), 64)), np.asarray(image.crop((0, 0, 64, 64)))
    )


def test_image_folder_data_yields_scaled_chw_tensors_and_int64_labels(tmp_path):
    root = tmp_path / "data"
    pixels = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    for name in ("a", "b"):
        Image.fromarray(pixels).save(_png(root / name / "x.png"))
    data = ImageFolderData(root, 16, flip=False)
    image, label = data[1]
    assert image.dtype == torch.float32 and image.shape == (3, 16, 16)
    assert label.dtype == torch.int64 and label.item() == 1
    expected = torch.from_numpy(pixels).permute(2, 0, 1).float() / 127.5 - 1
    assert torch.allclose(image, expected) and image.min() >= -1 and image.max() <= 1
    images, labels = next(iter(torch.utils.data.DataLoader(data, batch_size=2)))
    assert images.shape == (2, 3, 16, 16) and labels.tolist() == [0, 1]


def test_seeded_flips_are_reproducible_change_per_epoch_and_mirror(tmp_path):
    root = tmp_path / "data"
    pixels = np.random.default_rng(2).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    for i in range(32):
        Image.fromarray(pixels).save(_png(root / "only" / f"{i:02d}.png"))
    plain = ImageFolderData(root, 8, flip=False)[0][0]

    def flips(data):
        return [not torch.equal(data[i][0], plain) for i in range(len(data))]

    first = ImageFolderData(root, 8, seed=7)
    pattern = flips(first)
    assert 4 < sum(pattern) < 28  # a fair coin, not always or never
    assert flips(ImageFolderData(root, 8, seed=7)) == pattern
    first.set_epoch(1)
    assert flips(first) != pattern
    mirrored = next(first[i][0] for i in range(32) if not torch.equal(first[i][0], plain))
    assert torch.equal(mirrored, plain.flip(-1))


def test_bad_image_at_access_raises_or_is_replaced(tmp_path):
    root = tmp_path / "data"
    _png(root / "a" / "0.png", colour=(255, 255, 255))
    _png(root / "a" / "1.png", colour=(0, 0, 0))
    (root / "a" / "0.png").write_bytes(b"broken")  # the sample check decodes a/0.png: skip that check
    with pytest.raises(UserError, match="a/0.png"):
        ImageFolderData(root, 8, check="none")[0]
    data = ImageFolderData(root, 8, check="none", skip_bad_images=True, flip=False)
    image, _ = data[0]
    assert torch.allclose(image, torch.full_like(image, -1.0))  # served a/1.png (black) instead
    assert data.bad_images_seen == 1


def test_a_16_bit_png_comes_through_as_value_over_257(tmp_path):
    """PIL's own convert("RGB") clips 16-bit grey at 255: mid-grey would train as white."""
    from dit_accel.data.folder import load_rgb

    values = np.array([[0, 257, 32896, 65535], [1000, 20000, 40000, 60000]] * 2, dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "grey16.png")
    with Image.open(tmp_path / "grey16.png") as image:
        assert image.mode in ("I;16", "I") and np.asarray(image).max() == 65535  # really 16-bit on disk
    rgb = np.asarray(load_rgb(tmp_path / "grey16.png"))
    expected = np.rint(values / 257).astype(np.uint8)
    assert rgb.shape == (4, 4, 3) and (rgb == expected[..., None]).all()
    assert rgb[0, 2, 0] == 128  # mid-grey stays mid-grey

    _png(tmp_path / "data" / "a" / "0.png", colour=(0, 0, 0))
    Image.fromarray(np.full((8, 8), 32896, dtype=np.uint16)).save(tmp_path / "data" / "a" / "1.png")
    image, _ = ImageFolderData(tmp_path / "data", 8, flip=False)[1]
    assert torch.allclose(image, torch.full_like(image, 128 / 127.5 - 1), atol=1e-6)
