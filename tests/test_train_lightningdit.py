"""LightningDiT on VA-VAE latents through the trainer, as a user runs it: demo images, a tiny random VA-VAE
(`demo-data --vae-family va-vae`), extract-latents (per-channel statistics), a plan made by dit-plan, the
lightningdit-xl1-64ep recipe, two processes over gloo with `accelerate launch`. A run resumed from its step-2
checkpoint ends bit-identical to the straight run; a zero3 launch of the same plan trains the same first step,
and a zero2 one in FSDP2's bf16;
the run samples under the paper's protocol, decoded with the statistics it recorded."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import launch_port
from safetensors.torch import load_file
from test_train_e2e import _env

from dit_accel.run import checkpoint as ckpt

PLAN = [
    "--model",
    "LightningDiT-B/1",
    "--depth",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--num-classes",
    "4",
    "--resolution",
    "32",
    "--gpus",
    "2",
    "--vram",
    "8G",
    "--global-batch",
    "8",
    "--precision",
    "fp32",
    "--checkpointing",
    "1",
    "--max-micro-batch",
    "4",
]
TRAIN = ["--config", "lightningdit-xl1-64ep", "--lr", "3e-3", "--num-workers", "0", "--no-progress-bar"]
TRAIN += ["--log-every", "1", "--no-tensorboard", "--sample-every", "0", "--checkpoint-every", "2"]


def _plan(out: Path, *args) -> Path:
    from planner.cli import main as dit_plan

    assert dit_plan([*PLAN, *args, "--out", str(out)]) == 0
    return out


def _launch(plan: Path, latents: Path, run: Path, *args) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(plan / "accelerate_config.yaml"),
    ]
    command += ["--num_processes", "2", "--main_process_port", launch_port(), "-m", "dit_accel.train"]
    command += ["--plan", str(plan / "plan.json"), "--latents", str(latents), "--output-dir", str(run)]
    command += [*TRAIN, *map(str, args)]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dit_accel.data.demo import write_demo_data, write_demo_vae
    from dit_accel.data.latents import ExtractConfig, extract_latents

    root = tmp_path_factory.mktemp("lightningdit")
    write_demo_data(root / "images", classes=4, per_class=8, resolution=32, seed=0)
    write_demo_vae(root / "vae", root / "images", family="va-vae")
    config = ExtractConfig(
        data_path=str(root / "images"),
        vae=str(root / "vae"),
        resolution=32,
        out=str(root / "latents"),
        num_workers=0,
    )
    extract_latents(config)
    ddp, zero3 = (
        _plan(root / "plan_ddp", "--sharding", "ddp"),
        _plan(root / "plan_zero3", "--sharding", "zero3"),
    )
    zero2_bf16 = _plan(root / "plan_zero2_bf16", "--sharding", "zero2", "--precision", "bf16")
    latents = root / "latents"
    started = [
        _launch(ddp, latents, root / "straight", "--max-steps", 4),
        _launch(ddp, latents, root / "resumed", "--max-steps", 2),
        _launch(zero3, latents, root / "zero3", "--max-steps", 1),
        _launch(zero2_bf16, latents, root / "zero2_bf16", "--max-steps", 2),
    ]
    outputs = [_finish(process) for process in started]
    outputs.append(_finish(_launch(ddp, latents, root / "resumed", "--max-steps", 4, "--resume", "auto")))
    return dict(root=root, latents=latents, outputs=outputs, plan=ddp)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.launched
def test_the_cache_is_normalised_per_channel_and_the_plan_is_lightningdits(runs):
    manifest = json.loads((runs["latents"] / "manifest.json").read_text())
    assert manifest["latent_shape"] == [32, 2, 2] and manifest["latent_norm"]["kind"] == "channel"
    assert manifest["vae"]["tokenizer"] == "va-vae"
    plan = json.loads((runs["plan"] / "plan.json").read_text())
    assert (plan["model"]["family"], plan["objective"], plan["model"]["out_channels"]) == (
        "lightningdit",
        "flow",
        32,
    )


@pytest.mark.launched
def test_a_resumed_lightningdit_run_ends_bit_identical_to_the_straight_one(runs):
    straight, resumed = runs["root"] / "straight", runs["root"] / "resumed"
    assert "resumed from" in (resumed / "logs" / "rank0.log").read_text()
    assert "parameters, replicated (DDP);" in (straight / "logs" / "rank0.log").read_text()  # 2 processes
    a, b = (run / "checkpoints" / "step_00000004" for run in (straight, resumed))
    for name in (ckpt.MODEL_WEIGHTS, ckpt.EMA_WEIGHTS):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    assert (a / "lr_scheduler.json").read_text() == (b / "lr_scheduler.json").read_text()
    assert [m["loss"] for m in _metrics(straight)] == [m["loss"] for m in _metrics(resumed)]
    assert [m["step"] for m in _metrics(straight)] == [1, 2, 3, 4]
    sidecar = json.loads((a / "dit_accel.json").read_text())
    assert sidecar["spec"]["family"] == "lightningdit" and sidecar["objective"]["cosine_loss_weight"] == 1.0
    manifest = json.loads((runs["latents"] / "manifest.json").read_text())
    assert sidecar["latent_norm"] == manifest["latent_norm"]  # sampling decodes with what it trained on


@pytest.mark.launched
def test_a_zero3_launch_of_the_same_plan_trains_the_same_first_step(runs):
    zero3, straight = _metrics(runs["root"] / "zero3"), _metrics(runs["root"] / "straight")
    assert "sharded zero3" in runs["outputs"][2]
    assert zero3[0]["loss"] == pytest.approx(straight[0]["loss"], rel=1e-5)


@pytest.mark.launched
def test_fsdp2s_bf16_parameters_train_lightningdit(runs):
    """Under FSDP2's mixed precision the parameters themselves are bf16 (no autocast): the fp32 sin-cos and
    rotary tables and the timestep features are cast to them, so the steps run and land near fp32's. (The
    first loss is the same in any precision: the zero-initialised final layer outputs exactly 0.)"""
    bf16, fp32 = _metrics(runs["root"] / "zero2_bf16"), _metrics(runs["root"] / "straight")
    assert "sharded zero2" in runs["outputs"][3] and "precision bf16" in runs["outputs"][3]
    assert bf16[1]["loss"] == pytest.approx(fp32[1]["loss"], rel=0.05) and bf16[1]["loss"] != fp32[1]["loss"]


@pytest.mark.launched
def test_the_trained_run_samples_under_the_papers_protocol(runs, tmp_path, capsys):
    from dit_accel.cli import main

    grid = tmp_path / "grid.png"
    argv = ["--checkpoint", runs["root"] / "straight", "--protocol", "lightningdit-xl1-64ep", "--out", grid]
    assert main(["sample", *map(str, argv)]) == 0
    assert grid.is_file() and len(list((tmp_path / "grid_images").glob("*.png"))) == 4
    assert "ode 249 steps, cfg 10.0" in capsys.readouterr().out
