"""Hugging Face datasets as --data-path: each form (save_to_disk, a DatasetDict, parquet, webdataset tar
shards) made with `datasets` itself from the very PNG files of a demo image folder, in its listing order, so
that the folder and each dataset must give the same pixels, the same latent cache and the same training run.
"""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dit_accel.data.folder import ImageFolderData, validate_image_folder
from dit_accel.data.hf_source import DatasetImageData, DatasetOptions, validate_dataset, validate_image_source
from dit_accel.data.source_kind import dataset_kind
from dit_accel.errors import UserError

RESOLUTION = 32
CLASSES, PER_CLASS = 4, 4


def write_forms(root: Path, images: Path) -> dict[str, Path]:
    """The folder `images` as a save_to_disk folder, a DatasetDict, parquet in the Hub's layout and
    webdataset shards; every row holds the PNG bytes of one file, in the folder's listing order."""
    import datasets

    listing = validate_image_folder(images).listing
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=listing.classes)}
    )
    rows = {
        "image": [{"bytes": (images / rel).read_bytes(), "path": None} for rel in listing.paths],
        "label": list(listing.labels),
    }
    table = datasets.Dataset.from_dict(rows, features=features)
    table.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": table, "validation": table.select(range(3))}).save_to_disk(
        str(root / "dict")
    )
    (root / "parquet" / "data").mkdir(parents=True)
    table.to_parquet(str(root / "parquet" / "data" / "train-00000-of-00001.parquet"))
    (root / "tars").mkdir()
    for shard in range(2):  # two shards, rows in order across them
        with tarfile.open(root / "tars" / f"shard-{shard:04d}.tar", "w") as tar:
            for index in range(shard * len(listing) // 2, (shard + 1) * len(listing) // 2):
                for suffix, data in (
                    ("png", rows["image"][index]["bytes"]),
                    ("cls", str(rows["label"][index]).encode()),
                ):
                    member = tarfile.TarInfo(f"{index:06d}.{suffix}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return {
        "saved": root / "saved",
        "dict": root / "dict",
        "parquet": root / "parquet",
        "parquet_glob": root / "parquet" / "data" / "*.parquet",
        "tars": root / "tars",
        "table": table,
    }


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    from dit_accel.data.demo import write_demo_data

    root = tmp_path_factory.mktemp("hf_forms")
    images = write_demo_data(root / "images", classes=CLASSES, per_class=PER_CLASS, resolution=40, seed=5)
    return {"images": images, **write_forms(root, images)}


WEBDATASET = DatasetOptions(image_column="png", label_column="cls")


def test_each_form_is_recognised_and_an_image_folder_is_not(forms):
    assert dataset_kind(forms["images"]) is None
    assert dataset_kind(forms["saved"]) == dataset_kind(forms["dict"]) == "saved"
    assert dataset_kind(forms["parquet"]) == dataset_kind(forms["parquet_glob"]) == "parquet"
    assert dataset_kind(forms["tars"]) == "webdataset"
    assert dataset_kind(forms["tars"] / "shard-0000.tar") == "webdataset"


@pytest.mark.parametrize("form", ["saved", "dict", "parquet", "parquet_glob"])
def test_random_access_forms_give_the_folders_pixels_labels_and_classes(forms, form):
    folder = ImageFolderData(forms["images"], RESOLUTION, flip=True, seed=3)
    summary = validate_image_source(forms[form], sample=True)
    assert summary.kind in ("saved", "parquet") and summary.split == "train"
    assert summary.classes == folder.classes and summary.num_images == CLASSES * PER_CLASS
    assert summary.images_decoded == CLASSES  # the first image of every class, as for a folder
    data = DatasetImageData(summary, RESOLUTION, flip=True, seed=3)
    assert len(data) == len(folder)
    for index in range(len(folder)):
        (x, y), (fx, fy) = data[index], folder[index]
        assert torch.equal(x, fx) and int(y) == int(fy)  # same crop, same seeded flip


def test_a_dataset_dict_split_is_chosen_by_name(forms):
    assert validate_dataset(forms["dict"], DatasetOptions(split="validation")).num_images == 3
    with pytest.raises(UserError, match="has no split 'test' .*validation"):
        validate_dataset(forms["dict"], DatasetOptions(split="test"))


def test_webdataset_shards_are_a_stream_and_training_says_to_extract_first(forms):
    from dit_accel.data.hf_source import training_refusal

    summary = validate_dataset(forms["tars"], WEBDATASET, sample=True)
    assert summary.listing is None and summary.images_decoded == CLASSES * PER_CLASS  # all 16 < 16 rows
    with pytest.raises(UserError, match="read only as a stream.*extract latents first"):
        training_refusal(summary, str(forms["tars"]))


def _bad_dataset(tmp_path, rows, features=None):
    import datasets

    path = tmp_path / "bad"
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(path))
    return path


def _png_bytes(colour=(10, 200, 10)):
    stream = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(stream, format="PNG")
    return stream.getvalue()


def test_bad_datasets_are_one_line_each(forms, tmp_path):
    import datasets

    with pytest.raises(UserError, match="has no column 'image' .*png, cls.*pass --image-column"):
        validate_dataset(forms["tars"], DatasetOptions())
    with pytest.raises(UserError, match="has no column 'class'.*pass --label-column"):
        validate_dataset(forms["saved"], DatasetOptions(label_column="class"))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    image = {"bytes": _png_bytes(), "path": None}
    unlabelled = _bad_dataset(tmp_path / "1", {"image": [image] * 3, "label": [0, -1, 1]}, features)
    with pytest.raises(UserError, match=r"1 row has a label outside its 2 classes \(row 1: -1\).*--split"):
        validate_dataset(unlabelled, DatasetOptions())
    empty = datasets.Dataset.from_dict({"image": [image], "label": [0]}, features=features).select([])
    empty.save_to_disk(str(tmp_path / "empty"))
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    for path in (tmp_path / "empty", tmp_path / "empty.parquet"):
        with pytest.raises(UserError, match=r"\(split train\) is empty; pass a split that holds images"):
            validate_dataset(path, DatasetOptions())
    broken = _bad_dataset(
        tmp_path / "3", {"image": [image, {"bytes": b"not a png", "path": None}], "label": [0, 1]}, features
    )
    with pytest.raises(UserError, match="cannot decode image .* row 1.*--skip-bad-images"):
        validate_dataset(broken, DatasetOptions(), sample=True)
    skipped = validate_dataset(broken, DatasetOptions(), sample=True, skip_bad_images=True)
    assert skipped.bad_images == ["row 1"] and skipped.num_images == 1
    assert skipped.images_per_class == {"a": 1, "b": 0}


def test_extract_latents_from_a_bad_dataset_exits_2_with_one_line_and_writes_nothing(
    forms, extracted, tmp_path, capsys
):
    """The command, not only the check: each bad form is one stderr line, exit 2, no cache folder."""
    import datasets
    from accelerate.state import PartialState

    from dit_accel.cli import main

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    image = {"bytes": _png_bytes(), "path": None}
    bad = {
        "a missing column": ([str(forms["saved"]), "--label-column", "class"], "has no column 'class'"),
        "a label outside": (
            [str(_bad_dataset(tmp_path / "l", {"image": [image] * 2, "label": [0, -1]}, features))],
            "label outside its 2 classes",
        ),
        "an undecodable row": (
            [
                str(
                    _bad_dataset(
                        tmp_path / "d",
                        {"image": [image, {"bytes": b"no", "path": None}], "label": [0, 1]},
                        features,
                    )
                )
            ],
            "cannot decode image",
        ),
        "an empty split": ([str(tmp_path / "empty")], "is empty"),
    }
    datasets.Dataset.from_dict({"image": [image], "label": [0]}, features=features).select([]).save_to_disk(
        str(tmp_path / "empty")
    )
    capsys.readouterr()  # the datasets' own progress bars, written above
    for case, (data_args, reason) in bad.items():
        out = tmp_path / case.replace(" ", "_")
        argv = [
            "extract-latents",
            "--data-path",
            *data_args,
            "--vae",
            str(extracted["vae"]),
            "--out",
            str(out),
        ]
        code = main([*argv, "--resolution", str(RESOLUTION)])
        PartialState._reset_state()
        err = capsys.readouterr().err.strip()
        assert code == 2, case
        assert reason in err and len(err.splitlines()) == 1 and "Traceback" not in err, (case, err)
        assert not out.exists(), case


def test_string_labels_are_classes_in_sorted_order(tmp_path):
    image = {"bytes": _png_bytes(), "path": None}
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")})
    path = _bad_dataset(tmp_path, {"image": [image] * 3, "label": ["zebra", "ant", "zebra"]}, features)
    summary = validate_dataset(path, DatasetOptions())
    assert summary.classes == ["ant", "zebra"] and summary.listing.labels.tolist() == [1, 0, 1]
    assert json.loads(json.dumps(summary.images_per_class)) == {"ant": 1, "zebra": 2}
    assert np.array_equal(summary.listing.rows, [0, 1, 2])


# --- extract-latents --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extracted(forms, tmp_path_factory):
    """The folder's latent cache, made once: the reference every dataset form's cache must equal."""
    from accelerate.state import PartialState

    from dit_accel.data.demo import demo_vae

    root = tmp_path_factory.mktemp("hf_latents")
    demo_vae(RESOLUTION).save_pretrained(root / "vae")
    _extract(forms["images"], root / "vae", root / "folder")
    PartialState._reset_state()
    return {"vae": root / "vae", "folder": root / "folder"}


def _extract(data_path, vae, out, **options):
    from dit_accel.data.latents import ExtractConfig, extract_latents

    config = ExtractConfig(
        data_path=str(data_path),
        vae=str(vae),
        out=str(out),
        resolution=RESOLUTION,
        batch_size=3,
        shard_size=5,  # 16 images: 4 shards, the last one short
        num_workers=0,
        dtype="float32",
        **options,
    )
    return extract_latents(config)


def _shards(cache: Path) -> list[dict]:
    from safetensors import safe_open

    found = []
    for path in sorted(cache.glob("shard-*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            tensors["sources"] = json.loads(handle.metadata()["sources"])
        found.append(tensors)
    return found


def assert_same_cache(cache: Path, reference: Path, sources: list[str], named: bool = True) -> None:
    """The same latents, labels and order as the folder's cache; each entry names the row it came from.
    `named`: the classes have the folder's names (a ClassLabel), else their indices ('0', '1', ...)."""
    from dit_accel.data.latent_cache import read_manifest

    made, wanted = _shards(cache), _shards(reference)
    assert len(made) == len(wanted) == 4
    for mine, theirs in zip(made, wanted):
        for name in ("mean", "std", "label", "source_index"):
            assert torch.equal(mine[name], theirs[name]), name
    assert [name for shard in made for name in shard["sources"]] == sources
    manifest, folder = read_manifest(cache), read_manifest(reference)
    names = folder["classes"] if named else [str(k) for k in range(len(folder["classes"]))]
    assert manifest["classes"] == names and manifest["count"] == folder["count"] == 16
    assert list(manifest["images_per_class"].values()) == list(folder["images_per_class"].values())
    assert list(manifest["images_per_class"]) == names


@pytest.mark.parametrize("form", ["saved", "parquet"])
def test_extraction_from_a_dataset_writes_the_folders_cache(forms, extracted, form, tmp_path):
    from accelerate.state import PartialState

    try:
        result = _extract(forms[form], extracted["vae"], tmp_path / "cache")
        assert result.count == 16
        assert_same_cache(tmp_path / "cache", extracted["folder"], [f"row {i}" for i in range(16)])
        folder_sources = [name for shard in _shards(extracted["folder"]) for name in shard["sources"]]
        assert folder_sources == validate_image_folder(forms["images"]).listing.paths
        # Rerun: every shard is reused; another split of the same dataset is another cache.
        rerun = _extract(forms[form], extracted["vae"], tmp_path / "cache")
        assert rerun.shards_reused == [0, 1, 2, 3] and not rerun.shards_written
    finally:
        PartialState._reset_state()


def test_extraction_from_webdataset_shards_is_one_ordered_pass_to_the_same_cache(forms, extracted, tmp_path):
    from accelerate.state import PartialState

    from dit_accel.data.latents import shard_name

    out = tmp_path / "cache"
    try:
        options = {"image_column": "png", "label_column": "cls"}
        assert _extract(forms["tars"], extracted["vae"], out, **options).count == 16
        assert_same_cache(out, extracted["folder"], [f"row {i}" for i in range(16)], named=False)
        # A killed run left shards 0 and 2 and no manifest: the rerun keeps them and writes the rest.
        (out / "manifest.json").unlink()
        for shard in (1, 3):
            (out / shard_name(shard)).unlink()
        PartialState._reset_state()
        rerun = _extract(forms["tars"], extracted["vae"], out, **options)
        assert rerun.shards_reused == [0, 2] and rerun.shards_written == [1, 3]
        assert_same_cache(out, extracted["folder"], [f"row {i}" for i in range(16)], named=False)
    finally:
        PartialState._reset_state()


# --- doctor ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pixel_plan(tmp_path_factory):
    from dit_accel.doctor.plan import load_plan
    from planner.outputs import write_plan_dir
    from planner.plan import make_plan

    plan = make_plan(
        gpus=2, vram="8G", global_batch=8, model="DiT-S/2", depth=2, hidden=32, heads=2, resolution=32,
        num_classes=CLASSES, latents="pixel",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("hf_plan")
    write_plan_dir(plan, folder)
    return load_plan(folder / "plan.json")


@pytest.mark.parametrize("form", ["saved", "dict", "parquet", "parquet_glob", "tars"])
def test_doctor_passes_each_form_and_says_what_a_rank_holds(forms, pixel_plan, form):
    from dit_accel.doctor.checks import Status
    from dit_accel.doctor.data import check_data

    options = WEBDATASET if form == "tars" else DatasetOptions()
    checks = {check.name: check for check in check_data(pixel_plan, forms[form], None, None, True, options)}
    assert "dataset" in checks and "split train" in checks["dataset"].reason
    if form == "tars":  # a stream: its rows decode, and training needs latents first (a warning, exit 0)
        assert (
            checks["random access"].status == Status.WARN
            and "extract latents first" in checks["random access"].fix
        )
        assert [c.name for c in checks.values() if c.status != Status.PASS] == ["random access"]
        return
    assert all(check.status == Status.PASS for check in checks.values()), checks
    assert "16 images decoded (every image)" in checks["decoding"].reason
    assert "4 classes, 4-4 images per class; 2 steps per epoch" in checks["classes"].reason
    assert "resident (row and label arrays" in checks["dataset memory"].reason
    assert "memory-mapped" in checks["dataset memory"].reason
    # a dataset is a dataset, and its entries rows (it was "the image folder" and its "files")
    assert f"from the dataset {forms[form]}" in checks["data vs plan"].reason
    sampled = {check.name: check for check in check_data(pixel_plan, forms[form], None, None, False, options)}
    assert "of 16 rows" in sampled["decoding"].reason and "files" not in sampled["decoding"].reason


def test_doctor_fails_a_bad_dataset_with_its_one_line(forms, pixel_plan):
    from dit_accel.doctor.checks import Status
    from dit_accel.doctor.data import check_data

    checks = check_data(pixel_plan, forms["saved"], None, None, False, DatasetOptions(label_column="class"))
    failing = [check for check in checks if check.status == Status.FAIL]
    assert [check.name for check in failing] == ["dataset"] and "has no column 'class'" in failing[0].reason


# --- training from parquet, launched ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched_runs(tmp_path_factory):
    """One 2-process configuration (pixel space at 8 px, micro 2 x accumulation 2, global batch 8, 16 images:
    2 steps an epoch) trained three ways: from the folder to step 4; from parquet to step 2; that parquet
    run resumed to step 4."""
    from test_train_e2e import _env, _make_plan, launch_command

    from dit_accel.data.demo import write_demo_data

    root = tmp_path_factory.mktemp("hf_train")
    images = write_demo_data(root / "images", classes=CLASSES, per_class=PER_CLASS, resolution=8, seed=2)
    parquet = write_forms(root, images)["parquet"]
    plan_path = _make_plan(root / "plan2", gpus=2, micro_batch=2, grad_accum=2)
    plan = json.loads(plan_path.read_text())
    plan["decision"]["latents"], plan["model"]["resolution"] = "pixel", 8  # 3 channels, 8x8 like latents
    plan_path.write_text(json.dumps(plan))
    workspace = {"plan2": plan_path, "latents": None}

    def launch(data, out, *args):
        command = launch_command(workspace, out, "--no-tensorboard", "--checkpoint-every", 2, *args)
        at = command.index("--latents")
        command[at : at + 2] = ["--data-path", str(data)]
        import subprocess

        return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)

    runs = {"folder": root / "folder", "parquet": root / "parquet_run"}
    results = {
        "folder": launch(images, runs["folder"], "--max-steps", 4),
        "parquet": launch(parquet, runs["parquet"], "--max-steps", 2),
        "resumed": launch(parquet, runs["parquet"], "--max-steps", 4, "--resume", "auto"),
    }
    return runs, results


@pytest.mark.launched
def test_two_processes_train_from_parquet_as_from_the_folder_and_resume_exactly(launched_runs):
    from test_train_e2e import _losses, assert_same_state

    runs, results = launched_runs
    for name, result in results.items():
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    assert (
        "(parquet, split train): 16 images in 4 classes"
        in (runs["parquet"] / "logs" / "rank0.log").read_text()
    )
    folder, parquet = (runs[name] / "checkpoints" for name in ("folder", "parquet"))
    # The same samples, pixels and flips in the same layout: the very same computation, bit for bit.
    assert_same_state(folder / "step_00000002", parquet / "step_00000002")
    # Resumed from its step-2 checkpoint, the parquet run continues as the straight (folder) run did.
    assert_same_state(folder / "step_00000004", parquet / "step_00000004")
    assert _losses(runs["parquet"]) == _losses(runs["folder"])
