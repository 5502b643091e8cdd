"""benchmarks/gpu_check.sh, the one command a session with a lent GPU machine runs, without the machine.

The launched test builds what that machine is (docs/benchmarks.md, "What the machine has"): a fresh venv
holding only distributions the machine's image has (this environment's own, linked in: its CPU torch stands
in for the machine's CUDA one), no diffusers or datasets, the project as a plain copied tree (not installed),
only `python3` (no `python`, `dit-plan`, `dit-accel`: stand-ins that record any call), the diffusers wheel
carried in `.whl/` as `benchmarks/gpu_wheels.sh` downloads it, and an `$OUT` folder. `--dry-run` must pass
there and leave what the machine brings back: at most 8 files, at most two folders down.
The unit tests feed the summary what a GPU run writes (metrics with memory figures, a calibration file).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20

# The Python distributions of the lent machine's image (the H200's, as read there in 2026-11), by name.
DEVICE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
CARRIED = ("diffusers", "torchao")  # what benchmarks/gpu_wheels.sh downloads
# What a carried wheel declares but never imports on the machine's Python 3.12:
UNUSED = {"importlib-metadata": "diffusers imports it only on Python < 3.8"}
NOT_THERE = ("diffusers", "datasets")
ALLOWED_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


# --- the simulated machine ------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def _requirements(dist) -> list[str]:
    """The names a distribution needs unconditionally here (no extras; markers evaluated for this Python)."""
    from packaging.requirements import Requirement

    names = []
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(_canonical(requirement.name))
    return names


def _project_requirements() -> list[str]:
    """The names pyproject.toml's [project] dependencies list (the installed metadata where tomllib is not)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        return _requirements(importlib.metadata.distribution("dit-accel"))
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [_canonical(Requirement(text).name) for text in dependencies]


def _wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel file (its METADATA), for what the carried diffusers needs on the machine."""
    import zipfile
    from email.parser import Parser

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]
    return [_canonical(r.name) for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(roots) -> dict:
    """Each root and everything it needs, as installed here: name -> distribution."""
    found, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not needed here either (e.g. a dependency of another platform)
        todo += _requirements(found[name])
    return found


def _link_distribution(dist, site: Path) -> None:
    """The distribution's top-level packages, modules and dist-info linked into `site`."""
    tops = {Path(str(f)).parts[0] for f in dist.files or []}
    for top in sorted(tops):
        if top in ("..", "__pycache__") or top.startswith("__editable__"):
            continue
        source = Path(dist.locate_file(top))
        if source.exists() and not (site / top).exists():
            (site / top).symlink_to(source)


def _wheels(tmp: Path) -> list[Path]:
    """The carried wheels: .whl/ of the checkout when it has them, else downloaded as the docs say."""
    carried = sorted((ROOT / ".whl").glob("*.whl"))
    if all(any(_canonical(w.name.split("-")[0]) == name for w in carried) for name in CARRIED):
        return [w for w in carried if _canonical(w.name.split("-")[0]) in CARRIED]
    folder = tmp / "downloaded"
    fetch = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_wheels.sh"), str(folder)],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheels = sorted(folder.glob("*.whl"))
    if fetch.returncode != 0 or len(wheels) != len(CARRIED):
        last = (fetch.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(
            f"the carried wheels cannot be had: no .whl/ and benchmarks/gpu_wheels.sh failed ({last})"
        )
    return wheels


def _device_machine(tmp: Path) -> dict:
    """The folders and environment of the simulated machine; returns the paths the test looks at."""
    wheels = _wheels(tmp)
    roots = (set(_project_requirements()) - set(NOT_THERE)) | {"pip"}
    for wheel in wheels:
        roots |= set(_wheel_requirements(wheel)) - set(CARRIED) - set(UNUSED)
    assert roots <= DEVICE_PACKAGES, (
        f"the project needs what the machine lacks: {sorted(roots - DEVICE_PACKAGES)}"
    )
    linked = _closure(roots)
    assert not set(NOT_THERE) & set(linked)

    venv = tmp / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (venv / "bin" / "python").unlink()  # the machine has python3 only
    site = next((venv / "lib").glob("python3*/site-packages"))
    for dist in linked.values():
        _link_distribution(dist, site)

    # Stand-ins for what the machine does not have: each records that it was called, and fails.
    shims, calls = tmp / "shims", tmp / "shim-calls.txt"
    shims.mkdir()
    for name in ("python", "dit-plan", "dit-accel"):
        (shims / name).write_text(
            f'#!/bin/sh\necho "{name} $*" >> {calls}\necho "{name}: not here" >&2\nexit 127\n'
        )
        (shims / name).chmod(0o755)

    tree = (
        tmp / "tree"
    )  # the working tree as the machine receives it: tracked and untracked-not-ignored files
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for relative in filter(None, listed.split("\0")):
        source = ROOT / relative
        if source.is_file():
            (tree / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / relative)
    (tree / ".whl").mkdir(exist_ok=True)
    for wheel in wheels:
        shutil.copy2(wheel, tree / ".whl" / wheel.name)

    out, work, home = tmp / "OUT", tmp / "work", tmp / "home"
    out.mkdir(), home.mkdir()
    env = {
        "PATH": f"{shims}:{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(tmp),
        "OUT": str(out),
        "GPU_CHECK_WORK": str(work),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return {
        "env": env,
        "tree": tree,
        "out": out,
        "work": work,
        "calls": calls,
        "python3": venv / "bin" / "python3",
    }


@pytest.mark.launched
def test_the_dry_run_passes_on_a_simulated_device_machine(tmp_path):
    machine = _device_machine(tmp_path)
    env = machine["env"]
    # the machine as built: torch and accelerate there, diffusers not, the tree not installed
    probe = "import torch, accelerate, safetensors, tabulate, matplotlib, tensorboard; import diffusers"
    lacking = subprocess.run([str(machine["python3"]), "-c", probe], env=env, capture_output=True, text=True)
    assert "No module named 'diffusers'" in lacking.stderr
    assert shutil.which("python", path=env["PATH"]).startswith(str(tmp_path / "shims"))

    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run"],
        cwd=machine["tree"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out, work = machine["out"], machine["work"]
    tail = (out / "log-tail.txt").read_text() if (out / "log-tail.txt").exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + tail
    assert not machine["calls"].exists(), machine["calls"].read_text()

    # What comes back from $OUT: at most 8 plain files, at most two folders down, plain names.
    files = [p for p in out.rglob("*") if not p.is_dir()]
    assert 1 <= len(files) <= 8 and all(p.is_file() and not p.is_symlink() for p in files)
    assert all(len(p.relative_to(out).parts) <= 3 and ALLOWED_NAME.match(p.name) for p in files)
    assert all(p.stat().st_size <= 16 * MiB for p in files)
    assert {"summary.json", "summary.md", "log-tail.txt", "plan.json", "runs.tar.gz"} <= {
        p.name for p in files
    }

    summary = json.loads((out / "summary.json").read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    for name in ("plan", "images", "latents", "eager", "compiled"):
        assert stages[name]["status"] == "ok", tail
    for name in (
        "plan-lightningdit",
        "images-vavae",
        "latents-vavae",
        "lightningdit",
        "profile",
        "plan-fp8",
        "fp8",
    ):
        assert stages[name]["status"] == "ok", tail
    fp8 = summary["runs"][
        "fp8"
    ]  # torchao from the carried wheel, emulated on this CPU, beside the compiled run
    assert fp8["steps"] == 4 and fp8["compiled_blocks"] == "2/2" and fp8["final_loss"] > 0
    profile = summary["profile"]  # the step's time by kind, on the CPU here: operators, not kernels
    assert (
        profile["device"] == "cpu" and profile["steps"] == 3 and profile["kinds"]["matmul"]["s_per_step"] > 0
    )
    assert profile["kinds"]["optimizer"]["s_per_step"] > 0 and profile["kinds"]["ema"]["s_per_step"] > 0
    assert abs(sum(k["share"] for k in profile["kinds"].values()) - 1) < 1e-6 and len(profile["top"]) == 10
    assert "| kind | ms per step | share |" in (out / "summary.md").read_text()
    assert stages["calibrate"]["exit"] == 2 and "no CUDA GPU" in tail  # calibrate refuses a CPU in one line
    assert summary["machine"]["dit_accel_from"] == str(machine["tree"].resolve())
    assert summary["machine"]["diffusers_from"] == str((work / "site").resolve())  # from the carried wheel
    eager, compiled = summary["runs"]["eager"], summary["runs"]["compiled"]
    assert eager["steps"] == compiled["steps"] == 4 and eager["images_per_s"] > 0 < compiled["images_per_s"]
    assert compiled["compiled_blocks"] == "2/2" and eager["compiled_blocks"] == "off"
    assert eager["checkpoints"] == compiled["checkpoints"] == []  # --no-final-checkpoint: no weights written
    assert not list(work.glob("run-*/checkpoints/step_*"))
    assert summary["plan"]["micro_batch"] == 8 and "| eager |" in (out / "summary.md").read_text()
    lightningdit = summary["runs"][
        "lightningdit"
    ]  # measured against its own plan, compiled, on VA-VAE latents
    assert lightningdit["model"].startswith("LightningDiT-B/1") and lightningdit["steps"] == 4
    assert lightningdit["compiled_blocks"] == "2/2" and lightningdit["images_per_s"] > 0
    assert "| lightningdit | LightningDiT-B/1" in (out / "summary.md").read_text()
    with tarfile.open(out / "runs.tar.gz") as archive:
        names = archive.getnames()
    assert {f"run-{mode}/metrics.jsonl" for mode in ("eager", "compiled", "lightningdit")} <= set(names)
    assert not [n for n in names if "checkpoint" in n or n.endswith((".safetensors", ".bin"))]


# --- the summary of what a GPU run writes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def h200_plan(tmp_path_factory):
    """The plan the check trains: `dit-plan --gpu h200 --gpus 1` for DiT-XL/2 @256 bf16, precomputed latents."""
    from planner.cli import main as dit_plan

    folder = tmp_path_factory.mktemp("work") / "plan"
    flags = [
        "--gpu",
        "h200",
        "--gpus",
        "1",
        "--model",
        "DiT-XL/2",
        "--resolution",
        "256",
        "--precision",
        "bf16",
    ]
    assert dit_plan([*flags, "--latents", "precomputed", "--out", str(folder)]) == 0
    return folder.parent


def _write_metrics(run: Path, windows: list[float], allocated: int, reserved: int) -> None:
    (run / "logs").mkdir(parents=True)
    lines = [
        {
            "step": 6 * (i + 1),
            "loss": 1.0,
            "images_per_s": rate,
            "peak_allocated_bytes": allocated - i * MiB,
            "peak_reserved_bytes": reserved,
        }
        for i, rate in enumerate(windows)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "logs" / "rank0.log").write_text(
        "compiled blocks: 28/28, torch.compile per block (--compile); ...\n"
    )


def test_the_summary_sets_what_a_gpu_run_measured_against_the_plan(h200_plan, tmp_path):
    from planner.planfile import read_plan
    from planner.search import image_step_flops

    work, out = h200_plan, tmp_path / "OUT"
    out.mkdir()
    plan = read_plan(work / "plan" / "plan.json")
    shutil.rmtree(work / "run-eager", ignore_errors=True)
    shutil.rmtree(work / "run-compiled", ignore_errors=True)
    _write_metrics(work / "run-eager", [40.0, 300.0, 310.0, 290.0], 120 * GiB, 124 * GiB)
    _write_metrics(work / "run-compiled", [5.0, 360.0, 370.0], 110 * GiB, 113 * GiB)
    (work / "stages.tsv").write_text("plan\t0\t3\t60\neager\t0\t80\t120\ncompiled\t124\t170\t170\n")

    summary = gpu_check.write_outputs(work, out)
    eager, compiled = summary["runs"]["eager"], summary["runs"]["compiled"]
    assert eager["images_per_s"] == 300.0 and compiled["images_per_s"] == 365.0  # windows after the first
    assert summary["compiled_over_eager"] == pytest.approx(365 / 300)
    h200_bf16 = gpu_check.peak_flops(plan)
    assert eager["mfu"] == pytest.approx(300 * image_step_flops(plan.spec(), plan.decision) / h200_bf16)
    assert (
        eager["max_allocated_bytes"] == 120 * GiB and eager["plan_tensor_bytes"] == plan.memory.tensor_bytes
    )
    assert eager["allocated_over_plan"] == pytest.approx(120 * GiB / plan.memory.tensor_bytes)
    assert [s["status"] for s in summary["stages"]] == ["ok", "ok", "timed out"]
    text = (out / "summary.md").read_text()
    assert "| eager | DiT-XL/2, 256 | 300.0 | 574 |" in text and "compiled / eager: 1.217x" in text
    assert "28/28" in text and "lightningdit" not in summary["runs"]  # its stages did not run
    assert json.loads((out / "plan.json").read_text())["decision"]["micro_batch"] == plan.decision.micro_batch


def test_the_planners_estimate_at_the_planned_micro_batch_is_the_plans_own(h200_plan):
    from planner.planfile import read_plan

    plan = read_plan(h200_plan / "plan" / "plan.json")
    estimate = gpu_check.planned_memory(plan, plan.decision.micro_batch)
    assert estimate.peak_bytes == plan.memory.peak_bytes
    assert estimate.allocated_peak_bytes == plan.memory.tensor_bytes
    assert gpu_check.planned_memory(plan, 32).peak_bytes < plan.memory.peak_bytes


def test_calibration_points_are_set_against_the_planner_also_when_the_run_stopped_part_way(
    h200_plan, tmp_path
):
    """A calibration stopped after its requested micro-batches (complete: false) is reported as such."""
    from dit_accel.memtrace import calibrate as cal
    from planner.planfile import read_plan

    plan = read_plan(h200_plan / "plan" / "plan.json")
    planned = {mb: gpu_check.planned_memory(plan, mb) for mb in (32, 64, 128)}

    def measure(micro_batch):  # 2% above the planner's tensors, reserved 1% above that
        if micro_batch > 200:
            raise cal.MeasureOOM(micro_batch)
        allocated = int(planned.get(micro_batch, planned[128]).allocated_peak_bytes * 1.02)
        return cal.Measurement(
            micro_batch, allocated, int(allocated * 1.01), micro_batch / 300, allocated + GiB
        )

    out = tmp_path / "OUT"
    saved = []
    gpu = {"name": "NVIDIA H200", "total_bytes": 140 * GiB, "preset": "h200", "_preset": None}
    save = lambda document: saved.append(json.loads(json.dumps(document)))  # the file as written then
    cal.calibrate(plan, [32, 64, 128], 1, None, measure, gpu, log=lambda line: None, save=save)
    stopped = next(d for d in saved if "fit" in d)  # what a timeout during the search leaves
    out.mkdir()
    (out / "calibration.json").write_text(json.dumps(stopped))
    summary = gpu_check.summarise(h200_plan, out)
    calibration = summary["calibrations"]["calibration"]
    assert calibration["complete"] is False and calibration["largest_micro_batch"] == 128
    assert [p["micro_batch"] for p in calibration["points"]] == [32, 64, 128]
    for point in calibration["points"]:
        assert point["allocated_error"] == pytest.approx(1 / 1.02 - 1, abs=1e-6)
    text = gpu_check.markdown(summary)
    assert "INCOMPLETE" in text and "| 32 |" in text and "-2.0%" in text


def test_the_modes_table_sets_each_calibration_against_the_planner_and_derives_the_vae_rate(
    h200_plan, tmp_path
):
    """benchmarks/gpu_modes.sh's folders: each point beside the planner at its micro-batch, and the VAE
    encoder's MFU from an online mode whose precomputed twin was measured at the same micro-batch."""
    from planner.cli import main as dit_plan
    from planner.planfile import read_plan
    from planner.search import implied_vae_mfu

    folder = tmp_path / "modes"
    flags = [
        "--gpu",
        "h200",
        "--gpus",
        "1",
        "--precision",
        "bf16",
        "--global-batch",
        "64",
        "--checkpointing",
        "none",
    ]
    speeds = {"precomputed": 400.0, "online": 250.0}
    for latents, images_per_s in speeds.items():
        assert dit_plan([*flags, "--latents", latents, "--out", str(folder / latents)]) == 0
        plan = read_plan(folder / latents / "plan.json")
        measurements = []
        for mb in (32, 64):
            allocated = int(gpu_check.planned_memory(plan, mb).allocated_peak_bytes / 1.02)  # planner +2%
            measurements.append(
                {
                    "micro_batch": mb,
                    "max_allocated_bytes": allocated,
                    "max_reserved_bytes": allocated,
                    "images_per_s": images_per_s,
                }
            )
        (folder / latents / "calibration.json").write_text(
            json.dumps({"measurements": measurements, "fit": {"outside_allocator_bytes": 0}})
        )
    table = gpu_check.modes_table(folder)
    rows = [
        line for line in table.splitlines() if line.startswith("| online") or line.startswith("| precomputed")
    ]
    assert len(rows) == 4 and all("| +2.0% |" in row for row in rows)
    assert all(f"/ {speeds[row.split()[1]]:.1f} |" in row for row in rows)
    online = read_plan(folder / "online" / "plan.json")
    rate = implied_vae_mfu(
        online.spec(),
        dataclasses.replace(online.decision, micro_batch=64, grad_accum=1),
        gpu_check.plan_cluster(online),
        gpu_check.plan_assumptions(online),
        250.0,
        400.0,
    )
    assert f"- bf16, 0 checkpointed, micro-batch 64: VAE encoder MFU {rate:.3f}" in table


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("aten::addmm", "matmul"),
        ("flash_fwd_kernel", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("triton_per_fused_native_layer_norm_0", "norm and modulation"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "elementwise"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<LerpFunctor>", "ema"),
        ("void at::native::fused_adam_kernel", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("TorchDynamo Cache Lookup", "other"),
    ],
)
def test_the_profile_sorts_kernels_into_kinds_by_name(name, kind):
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.kind_of(name) == kind


def test_the_profile_summary_takes_the_marked_ranges_and_the_idle_time():
    """On a GPU the wall time the kernels leave is idle; an op inside the optimizer's or the EMA's marked range
    is theirs whatever its name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    events = [
        ("sm90_gemm", 0.6, None),
        ("vectorized_elementwise_kernel", 0.1, "dit_accel.optimizer_step"),
        ("multi_tensor_apply_kernel<LerpFunctor>", 0.05, "dit_accel.ema_update"),
    ]
    summary = module.summarise(events, wall_s=1.0, device="cuda", step_flops=3e14, steps=1)
    kinds = {kind: value["s_per_step"] for kind, value in summary["kinds"].items()}
    assert kinds["matmul"] == 0.6 and kinds["optimizer"] == 0.1 and kinds["ema"] == 0.05
    assert kinds["idle between kernels"] == pytest.approx(0.25) and summary["matmul_tflops"] == pytest.approx(
        500
    )
