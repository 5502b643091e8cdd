"""The latent cache, with a tiny real AutoencoderKL saved by the test and demo images: what is stored is
the VAE's posterior, the reader samples and scales it, an interrupted extraction resumes, a cache made
differently is refused, and two real `accelerate launch` processes write separate shards."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from accelerate.state import PartialState
from diffusers import AutoencoderKL
from PIL import Image
from ports import launch_port
from safetensors import safe_open
from teardown_probe import SCRIPT, teardowns

from dit_accel.data.demo import write_demo_data
from dit_accel.data.latent_cache import LatentCache, check_cache_matches, read_manifest, verify_cache
from dit_accel.data.latents import ExtractConfig, build_parser, extract_latents, main
from dit_accel.errors import UserError
from dit_accel.models.vae import load_vae

RESOLUTION = 32
CLASSES, PER_CLASS = 3, 6  # 18 images; shard_size 4 -> 5 shards, the last one short


def _tiny_vae(seed):
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=RESOLUTION,
    )


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("latent_assets")
    _tiny_vae(0).save_pretrained(root / "vae")
    _tiny_vae(1).save_pretrained(root / "other_vae")
    write_demo_data(root / "images", classes=CLASSES, per_class=PER_CLASS, resolution=RESOLUTION, seed=3)
    return root


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """extract_latents creates accelerate's process-wide PartialState; leave none behind for other tests."""
    yield
    PartialState._reset_state()


def _extract(assets, out, **overrides):
    config = ExtractConfig(
        data_path=str(assets / "images"),
        vae=str(assets / "vae"),
        out=str(out),
        resolution=RESOLUTION,
        batch_size=3,
        shard_size=4,
        num_workers=0,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return extract_latents(config)


def _pixels(path):
    """A demo image as the VAE sees it; demo images are already RESOLUTION px, so the crop is the identity."""
    array = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1


@pytest.mark.parametrize("dtype, flip", [("float32", True), ("float16", False)])
def test_stored_mean_and_std_are_the_vae_posterior(assets, tmp_path, dtype, flip):
    result = _extract(assets, tmp_path / "cache", dtype=dtype, flip=flip)
    assert result.count == CLASSES * PER_CLASS and result.shards_written == [0, 1, 2, 3, 4]
    manifest = read_manifest(tmp_path / "cache")
    assert manifest["latent_shape"] == [4, RESOLUTION // 2, RESOLUTION // 2]
    assert manifest["views"] == (2 if flip else 1) and manifest["dtype"] == dtype
    assert manifest["latent_norm"] == {
        "kind": "scale",
        "shift": [0.0] * 4,
        "scale": [pytest.approx(0.18215)] * 4,
    }
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 4, 4, 2]
    assert manifest["images_per_class"] == {name: PER_CLASS for name in manifest["classes"]}

    vae = AutoencoderKL.from_pretrained(assets / "vae").eval()
    files = sorted((assets / "images").glob("*/*.png"))
    pixels = torch.stack([_pixels(path) for path in files])
    with torch.no_grad():
        expected = [vae.encode(pixels).latent_dist]
        if flip:
            expected.append(vae.encode(pixels.flip(-1)).latent_dist)
    cache = LatentCache(tmp_path / "cache")
    assert cache.labels.tolist() == [i // PER_CLASS for i in range(len(files))]
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-3, atol=2e-3)
    for index in range(len(files)):
        for view, posterior in enumerate(expected):
            mean, std = cache.posterior(index, view)
            torch.testing.assert_close(mean, posterior.mean[index], **tolerance)
            torch.testing.assert_close(std, posterior.std[index], **tolerance)
    if flip:  # the mirror image's latent is not simply the mirrored latent: it was really encoded
        assert not torch.allclose(cache.posterior(0, 1)[0], cache.posterior(0, 0)[0].flip(-1), atol=1e-3)


def test_reader_draws_scaled_posterior_samples(assets, tmp_path):
    _extract(assets, tmp_path / "cache", dtype="float32")
    cache = LatentCache(tmp_path / "cache", flip=False)
    mean, std = cache.posterior(5, 0)
    draws = torch.stack([cache[5][0] for _ in range(800)])
    scale = cache.latent_norm.scale[0]
    # latent = (mean + std * noise) * scale: the draws' moments, within 5 standard errors
    assert (draws.mean(0) - scale * mean).abs().max() < 5 * (scale * std).max() / 800**0.5
    assert torch.allclose(draws.std(0), scale * std, rtol=0.25)
    assert cache[5][1].dtype == torch.int64 and cache[5][1].item() == 5 // PER_CLASS


def test_seeded_reads_are_reproducible_across_workers_and_flip_at_random(assets, tmp_path):
    _extract(assets, tmp_path / "cache", dtype="float32")
    cache = LatentCache(tmp_path / "cache", seed=11)
    in_process = [cache[i][0] for i in range(len(cache))]
    loader = torch.utils.data.DataLoader(cache, batch_size=4, num_workers=2)  # workers open their own maps
    through_workers = torch.cat([latents for latents, _ in loader])
    assert torch.equal(torch.stack(in_process), through_workers)
    cache.set_epoch(1)
    assert not torch.equal(cache[0][0], in_process[0])

    def nearer_to_mirror(latent, index):
        mean0, mean1 = (cache.posterior(index, view)[0] * cache.latent_norm.scale[0] for view in (0, 1))
        return (latent - mean1).norm() < (latent - mean0).norm()

    mirrored = sum(nearer_to_mirror(latent, i) for i, latent in enumerate(in_process))
    assert 3 <= mirrored <= len(cache) - 3


def _contents(out):
    """Shard name -> hash of its tensors (file bytes differ between writes: metadata order is not fixed)."""
    return {p.name: safe_open(p, "pt").metadata()["content_sha256"] for p in sorted(out.glob("shard-*"))}


def test_resume_after_a_kill_keeps_complete_shards(assets, tmp_path):
    out = tmp_path / "cache"
    _extract(assets, out)
    original = _contents(out)
    kept_inode = (out / "shard-00000.safetensors").stat().st_ino

    # The state a kill leaves: no manifest, a shard never renamed into place, one missing, one damaged.
    (out / "manifest.json").unlink()
    (out / "shard-00002.safetensors").rename(out / ".shard-00002.safetensors.abc123.tmp")
    (out / "shard-00001.safetensors").unlink()
    damaged = bytearray((out / "shard-00003.safetensors").read_bytes())
    damaged[-10] ^= 0xFF
    (out / "shard-00003.safetensors").write_bytes(bytes(damaged))
    with pytest.raises(UserError, match="incomplete .*re-run the same `dit-accel extract-latents"):
        LatentCache(out)

    PartialState._reset_state()
    result = _extract(assets, out)
    assert result.shards_reused == [0, 4] and result.shards_written == [1, 2, 3]
    assert (out / "shard-00000.safetensors").stat().st_ino == kept_inode
    assert not list(out.glob(".*.tmp"))
    assert _contents(out) == original  # the re-encoded shards hold the same tensors
    assert verify_cache(out) > 0 and len(LatentCache(out)) == CLASSES * PER_CLASS

    # A different resolution is a different cache: nothing is reused.
    PartialState._reset_state()
    assert _extract(assets, out, resolution=16, overwrite=True).shards_reused == []


def test_damaged_or_missing_shards_are_refused(assets, tmp_path):
    out = tmp_path / "cache"
    _extract(assets, out)
    shard = out / "shard-00001.safetensors"
    payload = bytearray(shard.read_bytes())
    payload[-1] ^= 0x01
    shard.write_bytes(bytes(payload))
    read_manifest(out)  # same size: the cheap check passes, the checksum does not
    with pytest.raises(UserError, match="shard-00001.safetensors does not match its checksum"):
        verify_cache(out)
    shard.unlink()
    with pytest.raises(UserError, match="damaged: shard-00001.safetensors is missing; re-run"):
        LatentCache(out)


def _edit_manifest(out, edit) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def _point_outside(manifest, target) -> None:
    manifest["shards"][1]["file"] = target


def _drop_last_shard(manifest) -> None:  # and its count, consistently: the data set shrinks
    dropped = manifest["shards"].pop()
    manifest["count"] -= dropped["count"]


def _edit_one_count(manifest) -> None:  # and the total, consistently: only the shard itself disagrees
    manifest["shards"][0]["count"] += 1
    manifest["count"] += 1


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda out: _edit_manifest(out, lambda m: _point_outside(m, "../outside.safetensors")),
            "not a file in",
        ),
        (lambda out: _edit_manifest(out, lambda m: _point_outside(m, "/etc/hostname")), "not a file in"),
        (lambda out: _edit_manifest(out, _drop_last_shard), "holds shard files its manifest does not list"),
        (
            lambda out: _edit_manifest(out, _edit_one_count),
            "shard-00000.safetensors holds mean of shape (4, 2, 4, 16, 16), its manifest says (5, 2",
        ),
        (
            lambda out: _edit_manifest(out, lambda m: m.update(count=m["count"] - 1)),
            "its shards count 18 entries, its manifest 17",
        ),
        (  # the same file listed twice (under shard numbers that still run 0..n-1): read twice once
            lambda out: _edit_manifest(
                out, lambda m: m["shards"].__setitem__(1, dict(m["shards"][0], shard=1))
            ),
            "its manifest lists the same shard twice (shard-00000.safetensors)",
        ),
        (
            lambda out: _edit_manifest(out, lambda m: m.update(count=str(m["count"]))),
            "count is '18', not a whole",
        ),
        (
            lambda out: _edit_manifest(out, lambda m: m.update(shards={"0": m["shards"][0]})),
            "shards is a dict, not a list of shard records",
        ),
        (lambda out: (out / "manifest.json").write_text("[1, 2]"), "holds a JSON list, not a manifest"),
    ],
    ids=[
        "dot-dot",
        "absolute",
        "dropped-shard",
        "shard-count",
        "total-count",
        "shard-twice",
        "count-string",
        "shards-object",
        "a-list",
    ],
)
def test_an_edited_manifest_is_refused_before_training_reads_it(assets, tmp_path, damage, expected):
    """Each once passed silently (a shard read from wherever the manifest pointed, a data set one shard
    smaller) or ended the run with an IndexError in a DataLoader worker (a shard's count edited)."""
    out = tmp_path / "cache"
    _extract(assets, out)
    (tmp_path / "outside.safetensors").write_bytes((out / "shard-00001.safetensors").read_bytes())
    damage(out)
    with pytest.raises(UserError, match=re.escape(expected)):
        LatentCache(out)


def _rewrite_header(shard, edit, length=None) -> None:
    """A shard with its safetensors header edited (and the header length, or `length` as a lie)."""
    data = shard.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = edit(json.loads(data[8 : 8 + size]))
    text = json.dumps(header).encode()
    shard.write_bytes((length or len(text)).to_bytes(8, "little") + text + data[8 + size :])


def _first_entry(edit):
    def on_header(header):
        name = next(key for key in header if key != "__metadata__")
        edit(header[name])
        return header

    return on_header


@pytest.mark.parametrize(
    "edit, length, says",
    [
        (lambda header: [header], None, "its header is a JSON list, not an object"),
        (_first_entry(lambda entry: entry.update(shape=[2**40, *entry["shape"][1:]])), None, "which hold"),
        (lambda header: header, 2**62, "its header claims 4,611,686,018,427,387,904 bytes"),
        (_first_entry(lambda entry: entry.update(data_offsets=[0, 2**50])), None, "at bytes 0-"),
        (
            _first_entry(lambda entry: entry.update(dtype="BF16")),
            None,
            "as bf16, which this reader does not take",
        ),
    ],
    ids=["a-list", "2^40-rows", "2^62-header", "offsets-past-end", "bf16"],
)
def test_a_shard_whose_header_lies_is_one_line(assets, tmp_path, edit, length, says):
    """A shard header that is a list, claims 2^40 rows, or a 2^62-byte header was a traceback or a
    MemoryError; a bf16 shard was 'not a readable safetensors file' (it is readable; the dtype is not taken)."""
    out = tmp_path / "cache"
    _extract(assets, out)
    shard = out / "shard-00000.safetensors"
    _rewrite_header(shard, edit, length)
    _edit_manifest(out, lambda m: m["shards"][0].update(bytes=shard.stat().st_size))
    with pytest.raises(UserError, match=re.escape(says)) as refusal:
        LatentCache(out)
    assert len(str(refusal.value).splitlines()) == 1


def test_non_finite_latents_or_normalisation_name_the_data_not_the_lr(assets, tmp_path):
    """NaN latents or a NaN latent_norm scale once stopped the run with "lower --lr or set --grad-clip";
    the data is the cause, and is named before any step."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "cache"
    _extract(assets, out)
    shard = out / "shard-00001.safetensors"
    tensors = load_file(str(shard))
    tensors["mean"][2, 0, 0, 0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt", "count": str(len(tensors["label"]))})
    _edit_manifest(out, lambda m: m["shards"][1].update(bytes=shard.stat().st_size))
    cache = LatentCache(out, flip=False)
    first = int(cache._starts[1])
    cache[first + 1]  # a finite entry of the same shard reads
    with pytest.raises(UserError, match=r"shard-00001\.safetensors row 2 holds non-finite latents"):
        cache.__getitems__([0, first + 2])
    for scale in (float("nan"), 0.0):
        _edit_manifest(out, lambda m: m["latent_norm"].update(scale=[scale] * len(m["latent_norm"]["scale"])))
        with pytest.raises(UserError, match="latent_norm"):
            LatentCache(out)


def test_a_shard_linked_from_outside_the_cache_is_refused(assets, tmp_path):
    out = tmp_path / "cache"
    _extract(assets, out)
    moved = tmp_path / "elsewhere.safetensors"
    (out / "shard-00001.safetensors").rename(moved)
    (out / "shard-00001.safetensors").symlink_to(moved)
    with pytest.raises(UserError, match="names the shard 'shard-00001.safetensors', which is not a file in"):
        read_manifest(out)
    linked = tmp_path / "linked"  # the whole folder behind a link: fine
    linked.symlink_to(out)
    (out / "shard-00001.safetensors").unlink()
    moved.rename(out / "shard-00001.safetensors")
    assert len(LatentCache(linked)) == CLASSES * PER_CLASS


def test_cache_made_with_another_vae_or_resolution_is_refused(assets, tmp_path):
    _extract(assets, tmp_path / "cache")
    manifest = read_manifest(tmp_path / "cache")
    with pytest.raises(UserError, match="made at 32 px but the run asks for 64 px"):
        check_cache_matches(manifest, 64)
    with pytest.raises(UserError, match="another VAE"):
        check_cache_matches(tmp_path / "cache", RESOLUTION, str(assets / "other_vae"))
    moved = tmp_path / "moved_vae"
    shutil.copytree(assets / "vae", moved)
    check_cache_matches(LatentCache(tmp_path / "cache"), RESOLUTION, str(moved))  # same weights: accepted
    check_cache_matches(manifest, RESOLUTION, load_vae(str(assets / "vae"))[1])


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")
def test_vae_that_cannot_be_loaded_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="--vae .*nope does not exist"):
        load_vae(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="no hub model 'someone/tiny-vae' in the local Hugging Face cache"):
        load_vae("someone/tiny-vae")


HUB_ID_RUN = """
import sys, time
import dit_accel.data.latents  # torch, safetensors: imported before the clock starts
from dit_accel.cli import main
from dit_accel.models.vae import load_vae
if sys.argv[1] == "load":
    print(load_vae(sys.argv[2])[1]["source"])
else:
    start = time.perf_counter()
    code = main(["extract-latents", "--data-path", sys.argv[2], "--vae", "nope", "--out", sys.argv[3]])
    print(code, time.perf_counter() - start)
"""


@pytest.mark.launched
def test_a_hub_id_is_read_from_the_local_cache_only(assets, tmp_path):
    """No network at run time, whatever HF_HUB_OFFLINE says: `--vae nope` (a missing folder, or an id no
    cache holds) fails at once in one line naming both, where it used to retry the hub 5 times (~23 s, 14
    lines); an id the local Hugging Face cache holds loads from it."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")
    out = tmp_path / "cache"
    run = [sys.executable, "-c", HUB_ID_RUN]
    result = subprocess.run(
        [*run, "extract", str(assets / "images"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    code, _seconds = result.stdout.split()  # the time is printed, never judged: a busy box is slow too
    assert int(code) == 2, result.stdout
    [line] = result.stderr.strip().splitlines()  # the hub's retries printed a warning each (14 lines)
    assert (
        "--vae nope: no folder" in line and str(tmp_path / "hf" / "hub") in line and "save_pretrained" in line
    )
    assert not out.exists()
    # the hub cache's layout: models--ORG--NAME/refs/main names the snapshot that holds the files
    repo, snapshot = (
        tmp_path / "hf" / "hub" / "models--someone--tiny-vae",
        "0123456789abcdef" * 2 + "01234567",
    )
    shutil.copytree(assets / "vae", repo / "snapshots" / snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot)
    result = subprocess.run(
        [*run, "load", "someone/tiny-vae"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "someone/tiny-vae", result.stderr


def test_bad_image_stops_the_cli_or_is_skipped_and_counted(assets, tmp_path, capsys):
    images = tmp_path / "images"
    shutil.copytree(assets / "images", images)
    bad = sorted(sorted(images.iterdir())[1].glob("*.png"))[
        2
    ]  # not the first of its class: the sample check passes
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    args = [
        "--data_path",
        str(images),
        "--vae",
        str(assets / "vae"),
        "--resolution",
        str(RESOLUTION),
        "--out",
        str(tmp_path / "cache"),
        "--shard-size",
        "4",
        "--num-workers",
        "1",
    ]
    assert main(args) == 2
    stderr = capsys.readouterr().err
    last_line = [line for line in re.split(r"[\r\n]", stderr) if line.strip()][-1]
    assert last_line.startswith(f"dit-accel extract-latents: error: cannot decode image {bad}: ")
    assert last_line.endswith("or pass --skip-bad-images to skip such files") and "Traceback" not in stderr
    assert not (tmp_path / "cache" / "manifest.json").exists()

    PartialState._reset_state()
    assert main(args + ["--skip-bad-images"]) == 0
    manifest = read_manifest(tmp_path / "cache")
    relative = f"{bad.parent.name}/{bad.name}"
    assert manifest["skipped"] == [relative] and manifest["count"] == CLASSES * PER_CLASS - 1
    assert manifest["images_per_class"][bad.parent.name] == PER_CLASS - 1
    shard = (
        tmp_path / "cache" / f"shard-{(PER_CLASS + 2) // 4:05d}.safetensors"
    )  # listing index // shard size
    assert json.loads(safe_open(shard, "pt").metadata()["skipped"]) == [relative]
    assert "17 images x 2 views, 1 undecodable images skipped" in capsys.readouterr().out


def test_a_failure_before_any_shard_leaves_no_cache_folder(assets, tmp_path, capsys):
    """A bad image in the only shard: the command fails in one line, and the --out folder it made is gone
    (it once stayed behind, empty, looking like a cache to the next command)."""
    images = tmp_path / "images"
    shutil.copytree(assets / "images", images)
    bad = sorted(sorted(images.iterdir())[0].glob("*.png"))[2]  # not the first: the sample check passes
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    out = tmp_path / "cache"
    args = ["--data-path", str(images), "--vae", str(assets / "vae"), "--resolution", str(RESOLUTION)]
    args += ["--out", str(out), "--shard-size", "1000", "--num-workers", "0"]
    assert main(args) == 2
    assert "cannot decode image" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()  # a folder the user made is theirs: left in place
    PartialState._reset_state()
    assert main(args) == 2 and out.is_dir()


@pytest.mark.launched
def test_a_stop_signal_during_start_up_exits_4_and_leaves_nothing(assets, tmp_path):
    """SIGTERM once the command has installed its handler (/proc's SigCgt says so) and before any shard:
    the interpreter's default action once ended it with 143; now exit 4, one line, no --out folder."""
    import signal
    import time

    out = tmp_path / "cache"
    command = [sys.executable, "-m", "dit_accel.data.latents", "--data-path", str(assets / "images")]
    command += ["--vae", str(assets / "vae"), "--resolution", str(RESOLUTION), "--out", str(out)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _catches(process.pid, signal.SIGTERM):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 4, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        "dit-accel extract-latents: preempted by SIGTERM during start-up, before any shard was encoded; exit 4 "
        "(rerun the same command)"
    ]
    assert not out.exists()


def _catches(pid: int, sig) -> bool:
    """Whether process `pid` has a handler installed for `sig` (the SigCgt mask of /proc/PID/status)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (int(sig) - 1)))


def test_cli_accepts_both_spellings_of_every_option():
    for spelling in (
        ["--data-path", "D", "--batch-size", "8", "--no-flip"],
        ["--data_path", "D", "--batch_size", "8", "--no_flip"],
    ):
        args = build_parser().parse_args(spelling + ["--vae", "V", "--out", "O"])
        assert (args.data_path, args.batch_size, args.flip) == ("D", 8, False)


ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
"""


@pytest.mark.launched
def test_two_processes_under_accelerate_launch_write_their_own_shards(assets, tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text(ACCELERATE_CONFIG)
    out = tmp_path / "cache"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"))
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        "--main_process_port",
        launch_port(),
        SCRIPT,  # `-m dit_accel.data.latents`, then the threads left (tests/teardown_probe.py)
        "dit_accel.data.latents",
        "--data-path",
        str(assets / "images"),
        "--vae",
        str(assets / "vae"),
        "--resolution",
        str(RESOLUTION),
        "--out",
        str(out),
        "--shard-size",
        "4",
        "--batch-size",
        "3",
        "--num-workers",
        "0",
        "--dtype",
        "float32",
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "RuntimeWarning" not in run.stderr
    assert teardowns(run.stderr) == []  # ended by exit_command, the process group never freed

    manifest = read_manifest(out)
    assert manifest["world_size"] == 2 and manifest["count"] == CLASSES * PER_CLASS
    assert [(s["shard"], s["rank"], s["world_size"]) for s in manifest["shards"]] == [
        (0, 0, 2),
        (1, 1, 2),
        (2, 0, 2),
        (3, 1, 2),
        (4, 0, 2),
    ]
    assert run.stdout.count("latent cache") == 1  # rank 0 reports; rank 1 stays quiet

    # The same latents as one process computes.
    _extract(assets, tmp_path / "single", dtype="float32")
    two, one = LatentCache(out), LatentCache(tmp_path / "single")
    assert torch.equal(two.labels, one.labels)
    for index in range(len(one)):
        torch.testing.assert_close(two.posterior(index, 1), one.posterior(index, 1), rtol=1e-5, atol=1e-6)

    # Both ranks replace the complete cache through the staging folder, which is swapped in whole.
    at_16 = [
        *command[: command.index("--resolution") + 1],
        "16",
        *command[command.index("--resolution") + 2 :],
    ]
    run = subprocess.run([*at_16, "--overwrite"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = read_manifest(out)
    assert manifest["resolution"] == 16 and manifest["world_size"] == 2 and verify_cache(out) > 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failed_rerun_leaves_the_complete_cache_whole(assets, tmp_path):
    """A re-run that fails half-way (an image that no longer decodes) must not cost the complete cache."""
    images = tmp_path / "images"
    shutil.copytree(assets / "images", images)
    out = tmp_path / "cache"
    _extract(assets, out, data_path=str(images))
    before = _contents(out)
    bad = sorted(sorted(images.iterdir())[2].glob("*.png"))[
        3
    ]  # not the first of its class: the sample check passes
    bad.write_bytes(bad.read_bytes()[:60])  # a truncated PNG: the shard it is in must be encoded again

    PartialState._reset_state()
    with pytest.raises(UserError, match="cannot decode image"):
        _extract(assets, out, data_path=str(images), resolution=16, overwrite=True)
    assert _contents(out) == before and verify_cache(out) > 0
    assert read_manifest(out)["resolution"] == RESOLUTION and len(LatentCache(out)) == CLASSES * PER_CLASS

    # Run again, skipping the bad image: the failed run's shards are reused, the cache swapped in whole.
    PartialState._reset_state()
    result = _extract(assets, out, data_path=str(images), resolution=16, overwrite=True, skip_bad_images=True)
    assert result.shards_reused == [0, 1, 2] and result.shards_written == [3, 4]
    assert read_manifest(out)["resolution"] == 16 and verify_cache(out) > 0
    assert read_manifest(out)["skipped"] == [f"{bad.parent.name}/{bad.name}"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_another_resolution_of_a_complete_cache_needs_overwrite(assets, tmp_path, capsys):
    out = tmp_path / "cache"
    _extract(assets, out)
    before = _contents(out)
    args = ["--data-path", str(assets / "images"), "--vae", str(assets / "vae"), "--out", str(out)]
    args += ["--resolution", "16", "--shard-size", "4", "--num-workers", "0"]
    PartialState._reset_state()
    capsys.readouterr()
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--resolution 32 -> 16" in lines[0] and "--overwrite" in lines[0]
    assert _contents(out) == before and read_manifest(out)["resolution"] == RESOLUTION

    PartialState._reset_state()
    assert main(args + ["--overwrite"]) == 0
    assert read_manifest(out)["resolution"] == 16 and verify_cache(out) > 0


@pytest.mark.launched
def test_a_stop_signal_to_the_process_group_keeps_complete_shards_and_exits_4(assets, tmp_path):
    """SIGTERM to the whole process group (what SLURM or `kill -- -PGID` does), DataLoader workers included:
    the workers must not die of it first; the extraction stops at a batch, keeps its complete shards, writes
    no manifest, says so in one line and exits 4; the same command then finishes the cache."""
    import signal
    import time

    images = tmp_path / "images"
    write_demo_data(images, classes=2, per_class=100, resolution=RESOLUTION, seed=5)
    out = tmp_path / "cache"
    command = [sys.executable, "-m", "dit_accel.data.latents", "--data-path", str(images)]
    command += ["--vae", str(assets / "vae"), "--resolution", str(RESOLUTION), "--out", str(out)]
    command += ["--shard-size", "2", "--batch-size", "2", "--num-workers", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out / "shard-00000.safetensors").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 4, err[-3000:]
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]
    line = next(line for line in err.splitlines() if "preempted" in line)
    kept = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert line == (
        f"dit-accel extract-latents: preempted by SIGTERM: {len(kept)} of 100 shards of {out} are complete "
        f"and kept, no manifest written; exit 4 (rerun the same command to resume)"
    )
    assert 0 < len(kept) < 100 and not (out / "manifest.json").exists()
    assert not list(out.glob(".*.tmp"))

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert verify_cache(out) > 0 and read_manifest(out)["count"] == 200
