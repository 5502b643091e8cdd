"""Sharded plans (zero2 / zero3, FSDP2) on the CPU: configs written by dit-plan, two real processes over gloo
with `accelerate launch`, compared with the DDP run of the same samples; exact resume of a sharded run;
checkpointed blocks inside FSDP units; load_for_inference on a sharded checkpoint; the launch-config checks.

Pixel-space 32 px demo images keep the runs small (no VAE); four of the six launches run side by side, then
the other two.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence import has_true_gradient, layout_atol
from ports import launch_port
from safetensors.torch import load_file

from dit_accel.errors import UserError
from dit_accel.run import checkpoint as ckpt
from dit_accel.run.weights import load_for_inference

TINY = [
    "--model",
    "DiT-S/2",
    "--depth",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--resolution",
    "32",
    "--latents",
    "pixel",
    "--num-classes",
    "4",
    "--gpus",
    "2",
    "--vram",
    "8G",
    "--global-batch",
    "8",
]
STEPS = 4
LR = 3e-3
QUIET = [
    "--num-workers",
    "0",
    "--no-progress-bar",
    "--log-every",
    "1",
    "--lr",
    str(LR),
    "--no-tensorboard",
    "--max-steps",
    str(STEPS),
    "--checkpoint-every",
    "2",
    "--keep-last",
    "2",
]


def _plan(out: Path, *args: str) -> Path:
    from planner.cli import main as dit_plan

    assert dit_plan([*TINY, *args, "--out", str(out)]) == 0
    return out


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "DIT_ACCEL_INJECT_NAN"):
        env.pop(name, None)
    return env


# The trainer, launched through this instead of `-m dit_accel.train`, records what a block computes in: a
# forward pre-hook on every transformer block (its input) and on its first linear inside the FSDP unit (the
# gathered weight, its input, and whether autocast is on), written per rank to probe_rank<N>.json beside it.
DTYPE_PROBE = """
import json, os, sys
from pathlib import Path
import torch
from torch.nn.modules.module import register_module_forward_pre_hook
records = []

def autocast_on():
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")

def record_linear(module, args):
    if len(records) < 16:
        records.append({"where": "attn1.to_q", "weight": str(module.weight.dtype), "input": str(args[0].dtype),
                        "weight_type": type(module.weight).__name__, "autocast": autocast_on()})

def record_block(module, args):
    if type(module).__name__ != "BasicTransformerBlock" or len(records) >= 16:
        return
    records.append({"where": "block input", "input": str(args[0].dtype) if args else "(keyword)",
                    "autocast": autocast_on()})
    if not getattr(module.attn1.to_q, "_probed", False):
        module.attn1.to_q._probed = True
        module.attn1.to_q.register_forward_pre_hook(record_linear)

register_module_forward_pre_hook(record_block)
from dit_accel.train.loop import main
code = main(sys.argv[1:])
Path(__file__).with_name(f"probe_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(records))
sys.exit(code)
"""


# A --init-from run launched through this records, right after build_components (before any step), the
# sharded model's full weights and EMA, gathered as the trainer gathers them (full_tensor, EMA.save): step 0.
INIT_PROBE = """
import os, sys
from pathlib import Path
from safetensors.torch import save_file
import dit_accel.train.step as step
import dit_accel.train.loop as train
from dit_accel.distributed.fsdp import full_tensor
build_components = step.build_components

def build_and_record(*args, **kwargs):
    components = build_components(*args, **kwargs)
    here, main = Path(__file__).parent, os.environ.get("RANK", "0") == "0"
    full = {name: full_tensor(param.detach()).clone() for name, param in components.raw_model.named_parameters()}
    assert any(hasattr(param, "full_tensor") for param in components.raw_model.parameters())  # really sharded
    if main:
        save_file(full, str(here / "init_step0_weights.safetensors"))
    components.ema.save(here / "init_step0_ema.safetensors", write=main)
    return components

step.build_components = build_and_record  # train() imports it when it runs
sys.exit(train.main(sys.argv[1:]))
"""


def _start(
    plan_dir: Path,
    images: Path,
    out: Path,
    *args,
    program: tuple = ("-m", "dit_accel.train"),
    processes: int = 2,
    launcher: tuple = (),
    quiet: list = QUIET,
) -> tuple[Path, subprocess.Popen]:
    """`accelerate launch` of the trainer with the plan's config; `launcher`: more of accelerate's flags."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(plan_dir / "accelerate_config.yaml"),
        *launcher,
        "--num_processes",
        str(processes),
        "--main_process_port",
        launch_port(),
        *program,
        "--plan",
        str(plan_dir / "plan.json"),
        "--data-path",
        str(images),
        "--output-dir",
        str(out),
        *quiet,
        *map(str, args),
    ]
    return out, subprocess.Popen(
        command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(started: tuple[Path, subprocess.Popen]) -> Path:
    out, process = started
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, output[-5000:]
    return out


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _dcp(folder: Path) -> dict:
    """A torch.distributed.checkpoint folder as one flat dict, read in this process."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/state.pt")
        nested = torch.load(f"{tmp}/state.pt", weights_only=False)

    def flatten(value, prefix=""):
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    return flatten(nested)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    model, _, info = load_for_inference(checkpoint, use_ema=False)
    assert info["weights"] == "model"
    return {name: param.detach() for name, param in model.named_parameters()}


def _assert_close(a: dict, b: dict, atol: float, what: str, layouts_differ: bool = False) -> None:
    """Within atol; where the runs' layouts differ, over the parameters with a true gradient only
    (tests/equivalence.py: the key biases' updates follow rounding noise)."""
    assert a.keys() == b.keys(), what
    worst = max(
        (a[k].float() - b[k].float()).abs().max().item()
        for k in a
        if has_true_gradient(k) or not layouts_differ
    )
    assert worst <= atol, f"{what}: max difference {worst}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One DDP reference and the sharded runs of the same 4 x 8 samples (all fp32 but `zero2_bf16`)."""
    from dit_accel.data.demo import write_demo_data

    root = tmp_path_factory.mktemp("fsdp")
    images = root / "images"
    write_demo_data(images, classes=4, per_class=8, resolution=32, seed=0)
    fp32 = ["--precision", "fp32"]
    plans = {
        "ddp": _plan(root / "plan_ddp", "--sharding", "ddp", *fp32),
        # zero3 with accumulation (micro 2 x accum 2) and one checkpointed block inside the FSDP units
        "zero3": _plan(
            root / "plan_zero3",
            "--sharding",
            "zero3",
            "--max-micro-batch",
            "2",
            "--checkpointing",
            "1",
            *fp32,
        ),
        "zero2": _plan(root / "plan_zero2", "--sharding", "zero2", *fp32),
        "zero2_bf16": _plan(
            root / "plan_zero2_bf16", "--sharding", "zero2"
        ),  # the planner's own precision: bf16
    }
    # The four independent runs start together: most of a launch is interpreter start-up and imports, which
    # overlap well; each run is still two real processes of its own.
    probe = root / "dtype_probe.py"
    probe.write_text(DTYPE_PROBE)
    started = {
        name: _start(
            plan, images, root / f"run_{name}", **({"program": (str(probe),)} if name == "zero2_bf16" else {})
        )
        for name, plan in plans.items()
    }
    out = {name: _finish(run) for name, run in started.items()}
    # zero3 again from its own step-2 checkpoint, in another folder; beside it a 2-step zero3 run fine-tuned
    # from the DDP run's final weights (--init-from), recording its step-0 weights through INIT_PROBE
    init_probe = root / "init_probe.py"
    init_probe.write_text(INIT_PROBE)
    resumed = _start(
        plans["zero3"],
        images,
        root / "run_zero3_resumed",
        "--resume",
        out["zero3"] / "checkpoints" / "step_00000002",
    )
    from_ddp = _start(
        plans["zero3"],
        images,
        root / "run_zero3_init",
        "--max-steps",
        2,
        "--init-from",
        out["ddp"] / "checkpoints" / "step_00000004",
        program=(str(init_probe),),
    )
    out["zero3_resumed"], out["zero3_init"] = _finish(resumed), _finish(from_ddp)
    out["plans"], out["root"] = plans, root
    return out


@pytest.mark.launched
def test_a_zero2_bf16_block_computes_in_pure_bf16_without_autocast(runs):
    """What the planner's pure low-precision model of sharded plans rests on (planner.activations.element_bytes with
    pure=True): under FSDP2's MixedPrecisionPolicy a block's input and its gathered parameters are bf16 and no
    autocast is on, so nothing is cast and there is no autocast cache. Recorded in the launched zero2 bf16 run."""
    for rank in (0, 1):
        records = json.loads((runs["root"] / f"probe_rank{rank}.json").read_text())
        blocks = [r for r in records if r["where"] == "block input"]
        linears = [r for r in records if r["where"] == "attn1.to_q"]
        assert len(blocks) >= 2 and len(linears) >= 2, records  # both blocks of the first step, at least
        assert all(r["input"] == "torch.bfloat16" and r["autocast"] is False for r in blocks), blocks
        assert all(
            r["weight"] == r["input"] == "torch.bfloat16" and r["autocast"] is False for r in linears
        ), linears
        assert all(r["weight_type"] != "DTensor" for r in linears)  # the gathered, unsharded parameter


@pytest.mark.launched
def test_plans_are_what_the_runs_claim(runs):
    decisions = {
        name: json.loads((plan / "plan.json").read_text())["decision"] for name, plan in runs["plans"].items()
    }
    assert decisions["zero3"]["sharding"] == "zero3" and decisions["zero2"]["sharding"] == "zero2"
    assert (
        decisions["zero3"]["micro_batch"],
        decisions["zero3"]["grad_accum"],
        decisions["zero3"]["checkpointed_blocks"],
    ) == (2, 2, 1)
    assert (decisions["ddp"]["micro_batch"], decisions["ddp"]["grad_accum"]) == (4, 1)
    assert decisions["zero2_bf16"]["precision"] == "bf16"
    lines = (runs["zero3"] / "logs" / "rank0.log").read_text().splitlines()
    first_line = next(line for line in lines if "parameters," in line)  # the run's description
    assert (
        "sharded zero3 (FSDP2, reshard after forward: True)" in first_line and "TF32 n/a on CPU" in first_line
    )
    assert "checkpointed blocks 1/2" in first_line and "accumulation 2" in first_line
    assert (
        "sharded zero2 (FSDP2, reshard after forward: False)"
        in (runs["zero2"] / "logs" / "rank1.log").read_text()
    )


@pytest.mark.launched
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_sharded_run_trains_and_equals_the_ddp_update(runs, sharding):
    ddp, sharded = runs["ddp"], runs[sharding]
    losses = _losses(sharded)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.03
    assert losses == pytest.approx(_losses(ddp), abs=1e-5)  # the same samples, noise and timesteps
    final = "checkpoints/step_00000004"
    atol = layout_atol(LR, STEPS)
    _assert_close(
        _weights(sharded / final), _weights(ddp / final), atol, f"{sharding} weights", layouts_differ=True
    )
    ema, ddp_ema = (
        load_file(str(sharded / final / ckpt.EMA_WEIGHTS)),
        load_file(str(ddp / final / ckpt.EMA_WEIGHTS)),
    )
    assert all(t.dtype == torch.float32 for t in ema.values())
    _assert_close(ema, ddp_ema, atol, f"{sharding} EMA", layouts_differ=True)
    assert (sharded / final / ckpt.SHARDED_MODEL).is_dir() and not (
        sharded / final / ckpt.MODEL_WEIGHTS
    ).exists()


@pytest.mark.launched
def test_bf16_sharded_run_trains_close_to_fp32(runs):
    losses = _losses(runs["zero2_bf16"])
    assert losses[-1] < losses[0] - 0.03
    assert losses == pytest.approx(_losses(runs["ddp"]), abs=2e-2)
    assert losses != _losses(runs["ddp"])  # bf16 compute really happened
    ema = load_file(str(runs["zero2_bf16"] / "checkpoints" / "step_00000004" / ckpt.EMA_WEIGHTS))
    assert all(t.dtype == torch.float32 for t in ema.values())  # fp32 master weights and EMA
    assert "precision bf16" in (runs["zero2_bf16"] / "logs" / "rank0.log").read_text()


@pytest.mark.launched
def test_sharded_resume_is_bit_identical(runs):
    straight, resumed = (runs[name] / "checkpoints" / "step_00000004" for name in ("zero3", "zero3_resumed"))
    assert "resumed from" in (runs["zero3_resumed"] / "logs" / "rank0.log").read_text()
    for folder in (ckpt.SHARDED_MODEL, "optimizer_0"):
        a, b = _dcp(straight / folder), _dcp(resumed / folder)
        assert a.keys() == b.keys() and any(
            ".exp_avg_sq" in key for key in (a if folder == "optimizer_0" else {"x.exp_avg_sq": 0})
        )
        differing = [
            k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])
        ]
        assert not differing, f"{folder}: {differing[:3]}"
    a, b = load_file(str(straight / ckpt.EMA_WEIGHTS)), load_file(str(resumed / ckpt.EMA_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ckpt.read_train_state(resumed)["step"] == STEPS


@pytest.mark.launched
def test_init_from_a_ddp_checkpoint_under_a_sharded_plan(runs):
    """docs/training.md: --init-from weights are loaded before sharding, so the gathered zero3 model and its EMA
    at step 0 are exactly the source weights; the run then trains from them."""
    source = _weights(runs["ddp"] / "checkpoints" / "step_00000004")
    at_step0 = load_file(str(runs["root"] / "init_step0_weights.safetensors"))
    ema_at_step0 = load_file(str(runs["root"] / "init_step0_ema.safetensors"))
    _assert_close(at_step0, source, 0.0, "zero3 weights at step 0")
    _assert_close(ema_at_step0, source, 0.0, "zero3 EMA at step 0")
    assert all(t.dtype == torch.float32 for t in ema_at_step0.values())

    run = runs["zero3_init"]
    assert "initialized from" in (run / "logs" / "rank0.log").read_text()
    losses = _losses(run)
    assert len(losses) == 2 and all(map(math.isfinite, losses))
    assert (
        losses[0] < _losses(runs["ddp"])[0] - 0.03
    )  # trained weights on the same first batch as random ones
    final = run / "checkpoints" / "step_00000002"
    assert ckpt.read_train_state(final)["init_from"].startswith(
        str(runs["ddp"] / "checkpoints" / "step_00000004")
    )
    trained = _weights(final)
    assert max((trained[k] - source[k]).abs().max().item() for k in source) > 1e-4  # it moved off the source


@pytest.mark.launched
def test_load_for_inference_reads_a_sharded_checkpoint(runs):
    from dit_accel.models.dit import embedders_tied

    model, spec, info = load_for_inference(runs["zero3"])
    assert (info["weights"], info["step"], spec.depth) == ("ema", STEPS, 2)
    assert embedders_tied(model) and not any(hasattr(p, "to_local") for p in model.parameters())
    ema = load_file(str(runs["zero3"] / "checkpoints" / "step_00000004" / ckpt.EMA_WEIGHTS))
    assert all(torch.equal(p, ema[n]) for n, p in model.named_parameters())
    raw = _weights(runs["zero3"] / "checkpoints" / "step_00000004")
    assert not torch.equal(raw["proj_out_2.weight"], model.proj_out_2.weight)  # the EMA lags the weights
    with torch.no_grad():  # a normal full model: it runs
        out = model(
            torch.randn(2, spec.in_channels, 32, 32),
            timestep=torch.tensor([1, 500]),
            class_labels=torch.tensor([0, 3]),
        ).sample
    assert out.shape == (2, spec.out_channels, 32, 32) and torch.isfinite(out).all()


def _crafted(runs, sharding: str, folder: str, attack: str, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of a launched run whose newest checkpoint's `folder` meets `attack` (tests/sharded_attacks.py; "weight
    as bytes": a model tensor re-declared as a pickled bytes entry), its manifest rewritten as an attacker
    would: (run, the attacked folder, the marker its payload would touch)."""
    import shutil

    import sharded_attacks as attacks
    from test_untrusted_checkpoint import _revouch

    run = tmp_path / f"{sharding}-{folder}-{attack.replace(' ', '-')}"
    shutil.copytree(runs[sharding], run)
    newest = run / "checkpoints" / "step_00000004"
    marker = tmp_path / f"PWNED-{run.name}"
    if attack == "weight as bytes":
        attacks.bytes_entry(newest / folder, marker, fqn=attacks.first_tensor(newest / folder))
    else:
        attacks.ATTACKS[attack](newest / folder, marker)
    _revouch(newest)
    return run, newest / folder, marker


OPTIMIZER_SAVE = "optimizer_0"
SHARDED_ATTACKS = [*sorted(__import__("sharded_attacks").ATTACKS), "weight as bytes"]


@pytest.mark.launched
def test_no_crafted_sharded_save_runs_code_on_a_launched_resume_or_init_from(runs, tmp_path):
    """The audit's routes as they were reported, each a real 2-process launch on a crafted copy of a launched
    run: a bytes entry of AdamW's zero2 save pointed at a payload, the same save's index replaced by rank-local
    ones, a zero3 model weight re-declared as bytes (`--resume auto`), and that model weight through
    `--init-from`. Each is refused in one line before torch reads the folder, and no payload runs."""
    cases = {
        "resume zero2 optimizer bytes": ("zero2", OPTIMIZER_SAVE, "bytes entry", "--resume", "auto"),
        "resume zero2 rank-local index": ("zero2", OPTIMIZER_SAVE, "rank-local index", "--resume", "auto"),
        "resume zero3 model weight": ("zero3", ckpt.SHARDED_MODEL, "weight as bytes", "--resume", "auto"),
        "init-from zero2 model weight": ("zero2", ckpt.SHARDED_MODEL, "weight as bytes", "--init-from"),
    }
    started, markers = {}, []
    for name, (sharding, folder, attack, *how) in cases.items():
        run, attacked, marker = _crafted(runs, sharding, folder, attack, tmp_path)
        markers.append(marker)
        out, extra = (run, how) if how[0] == "--resume" else (tmp_path / f"fine-{run.name}", [*how, run])
        plan = runs["plans"][sharding]
        started[name] = (attacked, _start(plan, runs["root"] / "images", out, *extra, "--max-steps", 5))
    for name, (attacked, (_, process)) in started.items():
        output, _ = process.communicate(timeout=300)
        before_elastic = output.split("torch/distributed/elastic")[0]
        assert process.returncode != 0 and "Traceback" not in before_elastic, (name, output[-3000:])
        refusal = [line for line in output.splitlines() if f"{attacked}" in line and "refused" in line]
        assert refusal, (name, output[-3000:])
    assert not any(marker.exists() for marker in markers)


@pytest.mark.launched
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_every_crafted_sharded_save_is_refused_by_every_reader(runs, tmp_path, capsys, sharding):
    """Every attack on both folders of a launched zero2 and zero3 save: what each rank checks before
    `load_state` refuses it in one line; on the model's folder `sample --no-ema` and `export --no-ema` (which
    `--init-from` shares, `run.weights.load_for_inference`) exit 2 with one line. No payload runs."""
    from dit_accel.cli import main as dit_accel
    from dit_accel.run.sharded import check_sharded_saves

    markers = []
    for folder in (OPTIMIZER_SAVE, ckpt.SHARDED_MODEL):
        for attack in SHARDED_ATTACKS:
            if (attack == "weight as bytes") != (folder == ckpt.SHARDED_MODEL) and "bytes" in attack:
                continue  # a model's save holds no bytes entries: its attack re-declares a weight
            run, attacked, marker = _crafted(runs, sharding, folder, attack, tmp_path)
            markers.append(marker)
            with pytest.raises(UserError, match="refused") as refusal:
                check_sharded_saves(attacked.parent)
            assert str(attacked) in str(refusal.value) and len(str(refusal.value).splitlines()) == 1
            if folder != ckpt.SHARDED_MODEL:
                continue
            capsys.readouterr()
            commands = {
                "sample": [*("--npz", tmp_path / f"{run.name}.npz", "--num-samples", 2, "--steps", 2)],
                "export": ["--out", tmp_path / f"{run.name}-pipe"],
            }
            for command, flags in commands.items():
                argv = [command, "--checkpoint", run, "--no-ema", *flags]
                assert dit_accel([str(arg) for arg in argv]) == 2, (command, attack)
                err = capsys.readouterr().err.strip()
                assert len(err.splitlines()) == 1 and str(attacked) in err and "refused" in err, (
                    command,
                    err,
                )
    assert not any(marker.exists() for marker in markers)


# --- in-process: the units, the YAML and the launch-config checks --------------------------------------------


def test_block_units_leave_the_shared_embedder_to_the_root():
    from dit_accel.distributed.fsdp import _children_without
    from dit_accel.models.dit import build_model, conditioning_embedder
    from planner.spec import custom_spec

    model = build_model(
        custom_spec(depth=3, hidden=32, heads=2, patch=2, resolution=32, latents="pixel", num_classes=4)
    )
    embedder_params = {id(p) for p in conditioning_embedder(model).parameters()}
    seen = []
    for block in model.transformer_blocks:
        units = _children_without(block, block.norm1.emb)
        params = [p for unit in units for p in unit.parameters()]
        assert not embedder_params & {id(p) for p in params}
        # the unit is the whole block but the embedder
        assert {id(p) for p in params} == {id(p) for p in block.parameters()} - embedder_params
        seen.extend(id(p) for p in params)
    assert len(seen) == len(set(seen))  # no parameter in two units


def _fsdp_env(monkeypatch, plan_dir: Path) -> None:
    """The FSDP_* environment `accelerate launch` exports for this config."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        [
            "--config_file",
            str(plan_dir / "accelerate_config.yaml"),
            "--main_process_port",
            "0",
            "-m",
            "dit_accel.train",
        ]
    )
    args, _, _ = _validate_launch_command(args)
    for name, value in prepare_multi_gpu_env(args).items():
        if name.startswith(("FSDP_", "ACCELERATE_USE_FSDP")):
            monkeypatch.setenv(name, value)


@pytest.mark.parametrize("sharding, reshard", [("zero2", False), ("zero3", True)])
def test_launch_env_from_the_yaml_gives_the_planned_fsdp2_plugin(tmp_path, monkeypatch, sharding, reshard):
    from dit_accel.distributed.accelerator import fsdp_plugin_for
    from planner.planfile import read_plan

    plan_dir = _plan(tmp_path / sharding, "--sharding", sharding)
    plan = read_plan(plan_dir / "plan.json")
    _fsdp_env(monkeypatch, plan_dir)
    assert (
        os.environ["FSDP_VERSION"] == "2" and os.environ["FSDP_RESHARD_AFTER_FORWARD"] == str(reshard).lower()
    )
    plugin = fsdp_plugin_for(plan, "plan.json")
    assert (
        plugin.fsdp_version == 2
        and plugin.reshard_after_forward is reshard
        and plugin.auto_wrap_policy is None
    )

    # the other level's config, an FSDP1 config, a DDP launch: each refused with the fix
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", str(not reshard).lower())
    with pytest.raises(
        UserError,
        match=f"fsdp_reshard_after_forward is {str(not reshard).lower()}, the plan's "
        f"{sharding} needs {str(reshard).lower()}",
    ):
        fsdp_plugin_for(plan, "plan.json")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UserError, match="fsdp_version is 1, dit-accel shards with FSDP2"):
        fsdp_plugin_for(plan, "plan.json")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(
        UserError,
        match=f"distributed_type is NO, the plan's {sharding} needs FSDP; launch with the "
        f"accelerate_config.yaml",
    ):
        fsdp_plugin_for(plan, "plan.json")


def test_a_ddp_plan_refuses_an_fsdp_launch(tmp_path, monkeypatch):
    from dit_accel.distributed.accelerator import fsdp_plugin_for
    from planner.planfile import read_plan

    plan = read_plan(_plan(tmp_path / "ddp", "--sharding", "ddp") / "plan.json")
    assert fsdp_plugin_for(plan, "plan.json") is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match="replicates the model"):
        fsdp_plugin_for(plan, "plan.json")


def test_tf32_flag_and_switch():
    from dit_accel.distributed.accelerator import set_tf32
    from dit_accel.train.flags import parse_config

    required = ["--plan", "p", "--output-dir", "o", "--latents", "l"]
    assert parse_config(required).tf32 is True
    assert parse_config(required + ["--no-tf32"]).tf32 is False
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        assert set_tf32(True, torch.device("cpu")) is False and not matmul.allow_tf32  # off CUDA: untouched
        assert set_tf32(True, torch.device("cuda")) is True and matmul.allow_tf32 and cudnn.allow_tf32
        assert set_tf32(False, torch.device("cuda")) is False and not (matmul.allow_tf32 or cudnn.allow_tf32)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
