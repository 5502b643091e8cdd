"""REPA from a latent cache: each entry's source image read beside its latent (dit_accel.data.cache_images),
the same pixels the folder or dataset gives, mirrored with the latent's view; a run on a cache trains the
projector; the planner counts the images the workers then hand over."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import PartialState

from dit_accel.data.folder import center_crop_adm, image_to_uint8, load_rgb, uint8_to_unit_range
from dit_accel.errors import UserError

RESOLUTION = 32


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A demo folder, the same images as a save_to_disk dataset, and a flipped latent cache of each."""
    import datasets

    from dit_accel.data.demo import demo_vae, write_demo_data
    from dit_accel.data.folder import validate_image_folder
    from dit_accel.data.latents import ExtractConfig, extract_latents

    root = tmp_path_factory.mktemp("repa_cache")
    images = write_demo_data(root / "images", classes=2, per_class=3, resolution=40, seed=2)
    listing = validate_image_folder(images).listing
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=listing.classes)}
    )
    rows = {"image": [{"bytes": (images / rel).read_bytes(), "path": None} for rel in listing.paths]}
    datasets.Dataset.from_dict({**rows, "label": list(listing.labels)}, features=features).save_to_disk(
        str(root / "saved")
    )
    demo_vae(RESOLUTION).save_pretrained(root / "vae")
    out = {"images": images, "paths": listing.paths, "vae": root / "vae", "saved": root / "saved"}
    for name, source in (("folder", images), ("dataset", root / "saved")):
        config = ExtractConfig(
            data_path=str(source),
            vae=str(root / "vae"),
            out=str(root / name),
            resolution=RESOLUTION,
            batch_size=4,
            shard_size=4,  # 6 images: 2 shards
            num_workers=0,
            dtype="float32",
        )
        extract_latents(config)
        PartialState._reset_state()
        out[name] = root / name
    return out


def _expected(images, rel: str, mirrored: bool) -> torch.Tensor:
    return uint8_to_unit_range(
        image_to_uint8(center_crop_adm(load_rgb(images / rel), RESOLUTION), flip=mirrored)
    )


@pytest.mark.parametrize("source", ["folder", "dataset"])
def test_each_entry_reads_the_image_it_was_encoded_from_mirrored_with_its_view(caches, source):
    from dit_accel.data.cache_images import CacheImages
    from dit_accel.data.latent_cache import LatentCache
    from dit_accel.data.source_kind import DatasetOptions

    cache = LatentCache(caches[source], flip=True, seed=7)
    cache.images = CacheImages(cache.dir, cache.manifest, None, DatasetOptions())
    assert len(cache.images) == len(cache) == 6
    for index, rel in enumerate(caches["paths"]):
        for mirrored in (False, True):
            assert torch.equal(
                cache.images.pixels(index, mirrored), _expected(caches["images"], rel, mirrored)
            )
    items = cache.__getitems__(list(range(6)))
    plain = LatentCache(caches[source], flip=True, seed=7).__getitems__(list(range(6)))
    seen = set()
    for (latent, label, image), (same_latent, same_label), rel in zip(items, plain, caches["paths"]):
        assert torch.equal(latent, same_latent) and label == same_label  # the images change no draw
        mirrored = torch.equal(image, _expected(caches["images"], rel, True))
        assert mirrored or torch.equal(image, _expected(caches["images"], rel, False))
        seen.add(mirrored)
    cache.flip = False  # --no-hflip: view 0 and the image itself, always
    assert all(
        torch.equal(image, _expected(caches["images"], rel, False))
        for (_, _, image), rel in zip(cache.__getitems__(list(range(6))), caches["paths"])
    )
    assert seen == {False, True}  # seed 7 draws both views among 6 entries


def test_a_moved_folder_is_found_with_data_path_and_a_missing_one_is_one_line(caches, tmp_path):
    import json
    import shutil

    from dit_accel.data.cache_images import CacheImages
    from dit_accel.data.latent_cache import read_manifest
    from dit_accel.data.source_kind import DatasetOptions

    manifest = read_manifest(caches["folder"])
    moved = shutil.copytree(caches["images"], tmp_path / "moved")
    gone = dict(manifest, data_path=str(tmp_path / "gone"))
    with pytest.raises(UserError, match="was made from .*gone, which is not here.*pass --data-path"):
        CacheImages(caches["folder"], gone, None, DatasetOptions())
    images = CacheImages(caches["folder"], gone, str(moved), DatasetOptions())
    assert torch.equal(images.pixels(0, False), _expected(caches["images"], caches["paths"][0], False))
    old = tmp_path / "old"
    shutil.copytree(caches["folder"], old)
    for shard in old.glob("shard-*.safetensors"):  # a cache from before shards named their sources
        from safetensors.torch import load_file, save_file

        save_file(load_file(shard), shard, metadata={"format": "pt"})
    with pytest.raises(UserError, match="names no source images.*extract the latents again"):
        CacheImages(old, json.loads((old / "manifest.json").read_text()), None, DatasetOptions())


def test_a_repa_run_trains_from_a_latent_cache_with_its_images(caches, tmp_path):
    """Two steps in process on a cache: the loader's batches carry the images, the projector learns."""
    from safetensors.torch import load_file
    from test_repa import save_tiny_encoder
    from test_train_e2e import QUIET, run_in_process

    from planner.cli import main as plan_main

    plan = tmp_path / "plan"
    argv = [
        *("--model", "DiT-S/2", "--depth", "2", "--hidden", "32", "--heads", "2", "--num-classes", "2"),
        *("--resolution", str(RESOLUTION), "--latents", "precomputed", "--vram", "8G", "--gpus", "1"),
        *("--global-batch", "2", "--precision", "fp32", "--repa", "dinov2-s", "--repa-projector-dim", "16"),
        *("--out", str(plan)),
    ]
    assert plan_main(argv) == 0
    save_tiny_encoder(tmp_path / "enc.pth")
    out = tmp_path / "run"
    code = run_in_process(
        [
            *("--plan", plan / "plan.json", "--latents", caches["folder"], "--output-dir", out),
            *("--repa-encoder", tmp_path / "enc.pth", "--repa-depth", "1", "--repa-projector-dim", "16"),
            *(
                "--max-steps",
                "2",
                "--checkpoint-every",
                "2",
                "--no-tensorboard",
                "--num-workers",
                "0",
                *QUIET,
            ),
        ]
    )
    assert code == 0
    weights = load_file(next((out / "checkpoints" / "step_00000002").rglob("model.safetensors")))
    assert any(key.startswith("repa_projector") for key in weights)


@pytest.mark.parametrize("name", ["../../secret.png", "/etc/hostname", "a/../../x.png"])
def test_a_source_name_outside_the_images_folder_is_refused(caches, tmp_path, name):
    """A shard's metadata comes with the cache: its names must not make a run read other files."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from dit_accel.data.cache_images import CacheImages
    from dit_accel.data.source_kind import DatasetOptions

    cache = shutil.copytree(caches["folder"], tmp_path / "cache")
    shard = cache / "shard-00000.safetensors"
    with safe_open(str(shard), "pt") as handle:
        metadata = handle.metadata()
    sources = json.loads(metadata["sources"])
    metadata["sources"] = json.dumps([name, *sources[1:]])
    save_file(load_file(shard), shard, metadata=metadata)
    manifest = json.loads((cache / "manifest.json").read_text())
    with pytest.raises(
        UserError, match="names the source image .*which is not a path inside the images' folder"
    ):
        CacheImages(cache, manifest, str(caches["images"]), DatasetOptions())


def test_a_source_image_replaced_since_extraction_stops_the_run_in_one_line(caches, tmp_path, capsys):
    """REPA aligned the latent of one image with the encoder's view of another, without a word; each
    source's size as encoded is now recorded and held to the file the worker reads."""
    import shutil

    from test_repa import save_tiny_encoder
    from test_train_e2e import QUIET, run_in_process

    from planner.cli import main as plan_main

    images = shutil.copytree(caches["images"], tmp_path / "images")
    first, other = images / caches["paths"][0], images / caches["paths"][-1]
    assert first.stat().st_size != other.stat().st_size
    shutil.copyfile(other, first)  # another image under the first one's name
    plan = tmp_path / "plan"
    argv = [
        *("--model", "DiT-S/2", "--depth", "1", "--hidden", "32", "--heads", "2", "--num-classes", "2"),
        *("--resolution", str(RESOLUTION), "--latents", "precomputed", "--vram", "8G", "--gpus", "1"),
        *("--global-batch", "6", "--precision", "fp32", "--repa", "dinov2-s", "--repa-projector-dim", "16"),
        *("--out", str(plan)),
    ]
    assert plan_main(argv) == 0
    save_tiny_encoder(tmp_path / "enc.pth")
    code = run_in_process(
        [
            *("--plan", plan / "plan.json", "--latents", caches["folder"], "--data-path", images),
            *("--output-dir", tmp_path / "run", "--repa-encoder", tmp_path / "enc.pth", "--repa-depth", "1"),
            *(
                "--repa-projector-dim",
                "16",
                "--max-steps",
                "1",
                "--no-tensorboard",
                "--num-workers",
                "0",
                *QUIET,
            ),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"REPA's source image {first} has changed since its latent was extracted" in err[0]


def test_the_planner_counts_the_images_a_cache_run_hands_over():
    from planner.plan import make_plan

    common = dict(gpus=8, vram="80G", global_batch=256, sharding="ddp", max_micro_batch=32)
    plain, aligned = make_plan(**common), make_plan(**common, repa="dinov2-b")
    pixels = 4 * 3 * 256 * 256  # fp32 RGB beside each fp32 latent
    assert aligned["decision"]["latents"] == "precomputed"
    for part in ("loader_prefetch", "pinned_batches"):
        per_sample = (aligned["host"]["per_rank"][part] - plain["host"]["per_rank"][part]) // 32
        assert per_sample * 32 == aligned["host"]["per_rank"][part] - plain["host"]["per_rank"][part]
        assert per_sample in (pixels * 4 * 2, pixels * 2)  # workers x prefetch batches, or 2 pinned batches
    assert aligned["host"]["per_rank"]["folder_index"] > 0 == plain["host"]["per_rank"]["folder_index"]
    assert aligned["host"]["main_process_once"] == {"folder_listing": 0}


# --- the doctor's REPA rows ----------------------------------------------------------------------------------


def _doctor_rows(argv: list, capsys) -> tuple[int, dict]:
    """`dit-accel doctor` on a simulated 1-GPU node, as JSON rows by name."""
    import json

    from test_doctor_preflight import env, gpus, host

    from dit_accel.doctor import Probes, run

    probes = Probes(environment=lambda: env(gpus=gpus(1)), host=lambda: host())
    capsys.readouterr()  # what came before (dit-plan's tables)
    code = run([str(arg) for arg in argv] + ["--format", "json"], probes)
    return code, {row["name"]: row for row in json.loads(capsys.readouterr().out)["checks"]}


def _plan(folder, *more) -> str:
    from planner.cli import main as plan_main

    argv = [
        *("--model", "DiT-S/2", "--depth", "2", "--hidden", "32", "--heads", "2", "--num-classes", "2"),
        *("--resolution", str(RESOLUTION), "--latents", "precomputed", "--vram", "8G", "--gpus", "1"),
        *("--global-batch", "2", "--precision", "fp32", *more, "--out", str(folder)),
    ]
    assert plan_main(argv) == 0
    return str(folder / "plan.json")


def test_the_doctor_checks_a_repa_runs_encoder_and_the_caches_images(caches, tmp_path, capsys):
    """The encoder loads as the trainer loads it (a test encoder: no published shape, a warning), the cache's
    source images are read for a sample of entries and timed against the plan's rate; without the encoder,
    with the folder moved or an image gone, a FAIL that names the fix; --data-path finds the moved folder."""
    import json
    import shutil

    from test_repa import save_tiny_encoder

    plan = _plan(tmp_path / "plan", "--repa", "dinov2-s", "--repa-projector-dim", "16")
    save_tiny_encoder(tmp_path / "enc.pth")
    cache = shutil.copytree(caches["folder"], tmp_path / "cache")
    base = ["--plan", plan, "--latents", cache, "--output-dir", tmp_path / "run"]
    code, rows = _doctor_rows([*base, "--repa-encoder", tmp_path / "enc.pth"], capsys)
    assert code == 2 and "--repa-projector-dim 2048 but the plan counts a projector of width 16" in str(rows)
    base += ["--repa-projector-dim", "16"]  # the plan's width, as the launch must pass it
    code, rows = _doctor_rows([*base, "--repa-encoder", tmp_path / "enc.pth"], capsys)
    assert code == 0, rows
    assert (
        rows["REPA encoder"]["status"] == "WARN" and "no published DINOv2" in rows["REPA encoder"]["reason"]
    )
    assert rows["REPA images"]["status"] == "PASS" and "6 of the cache's 6" in rows["REPA images"]["reason"]
    assert rows["decode rate"]["status"] == "PASS" and "5 sampled" in rows["decode rate"]["reason"]

    code, rows = _doctor_rows(base, capsys)
    assert code == 2 and rows["REPA encoder"]["status"] == "FAIL"
    assert "--repa-encoder is not given" in rows["REPA encoder"]["reason"]

    moved = shutil.copytree(caches["images"], tmp_path / "moved")
    manifest = json.loads((cache / "manifest.json").read_text())
    (cache / "manifest.json").write_text(json.dumps(dict(manifest, data_path=str(tmp_path / "gone"))))
    encoder = ["--repa-encoder", tmp_path / "enc.pth"]
    code, rows = _doctor_rows([*base, *encoder], capsys)
    assert code == 2 and "which is not here" in rows["REPA images"]["reason"]
    assert "--data-path" in rows["REPA images"]["fix"]
    code, rows = _doctor_rows([*base, *encoder, "--data-path", moved], capsys)
    assert (
        code == 0 and rows["REPA images"]["status"] == "PASS" and str(moved) in rows["REPA images"]["reason"]
    )
    (moved / caches["paths"][0]).unlink()
    code, rows = _doctor_rows([*base, *encoder, "--data-path", moved], capsys)
    assert code == 2 and "1 of 6 sampled source images" in rows["REPA images"]["reason"]
    assert "restore those images" in rows["REPA images"]["fix"]  # the folder is right, one image is gone
    code, rows = _doctor_rows([*base, *encoder, "--data-path", moved, "--full"], capsys)
    assert code == 2 and "1 of 6 source images" in rows["REPA images"]["reason"]  # every entry read


def test_the_doctor_refuses_an_encoder_for_a_plan_without_repa(caches, tmp_path, capsys):
    from test_repa import save_tiny_encoder

    save_tiny_encoder(tmp_path / "enc.pth")
    argv = [
        "--plan",
        _plan(tmp_path / "plan"),
        "--latents",
        caches["folder"],
        "--output-dir",
        tmp_path / "run",
    ]
    code, rows = _doctor_rows([*argv, "--repa-encoder", tmp_path / "enc.pth"], capsys)
    assert code == 2 and "the plan counts no REPA encoder" in rows["REPA encoder"]["reason"]
    code, rows = _doctor_rows(argv, capsys)
    assert code == 0 and "REPA encoder" not in rows and "decode rate" not in rows


def test_a_cache_beside_an_online_repa_plans_images_is_refused_as_the_trainer_refuses_it(
    caches, tmp_path, capsys
):
    """--latents beside --data-path means REPA's images only for a precomputed plan; an online plan trains on
    the folder, and the cache would be silently unused: refused, by the trainer's check."""
    import json
    from pathlib import Path

    from test_repa import save_tiny_encoder

    plan = _plan(tmp_path / "plan", "--repa", "dinov2-s", "--repa-projector-dim", "16")
    online = tmp_path / "online.json"
    document = json.loads(Path(plan).read_text())
    document["decision"]["latents"] = "online"
    online.write_text(json.dumps(document))
    save_tiny_encoder(tmp_path / "enc.pth")
    argv = ["--plan", online, "--data-path", caches["images"], "--latents", caches["folder"], "--vae"]
    code, rows = _doctor_rows(
        [*argv, caches["vae"], "--repa-encoder", tmp_path / "enc.pth", "--output-dir", tmp_path / "run"],
        capsys,
    )
    assert code == 2 and rows["data vs plan"]["status"] == "FAIL" and "REPA images" not in rows
    assert "--latents is given but the plan trains on online" in rows["data vs plan"]["reason"]
    assert "drop --latents" in rows["data vs plan"]["fix"]  # the trainer's own refusal
