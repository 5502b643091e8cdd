"""`dit-accel train --fp8`: the blocks' linear layers in FP8 through torchao's float8 training, emulated on the
CPU. A step lands beside bf16's, the run resumes exactly, and its checkpoints, samples and export hold the
plain fp32 weights (no FP8 tensor or module leaks out)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train_e2e import TINY_MODEL, make_workspace, run_in_process

from dit_accel.errors import UserError
from dit_accel.run import checkpoint as ckpt

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from planner.cli import main as dit_plan

    root = tmp_path_factory.mktemp("fp8")
    work = make_workspace(root)
    bf16 = [a if a != "fp32" else "bf16" for a in TINY_MODEL]
    assert dit_plan([*bf16, "--gpus", "1", "--global-batch", "8", "--out", str(root / "plan_bf16")]) == 0
    work["plan_bf16"] = root / "plan_bf16" / "plan.json"
    return work


def _components(plan_path, fp8: bool):
    from dit_accel.train.config import TrainConfig
    from dit_accel.train.step import build_components
    from planner.planfile import read_plan

    config = TrainConfig(plan="p", output_dir="o", latents="l", fp8=fp8, seed=3, lr=1e-2)
    return build_components(read_plan(plan_path), config, device="cpu")


def test_a_step_in_fp8_lands_beside_bf16_and_the_weights_stay_plain(workspace):
    from dit_accel.train.step import train_micro_step

    plain, fp8 = _components(workspace["plan_bf16"], False), _components(workspace["plan_bf16"], True)
    assert fp8.fp8["linears"] > 0 and fp8.fp8["emulated"] and fp8.fp8["library"].startswith("torchao ")
    converted = [name for name, m in fp8.raw_model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted and all(name.startswith("transformer_blocks.") for name in converted)
    assert not any(".emb." in name for name in converted)  # DiT's shared embedder stays bf16
    assert fp8.raw_model.state_dict().keys() == plain.raw_model.state_dict().keys()
    assert all(v.dtype == torch.float32 for v in fp8.raw_model.state_dict().values())
    from dit_accel.memtrace.driver import fake_batch  # outside a FakeTensorMode: real tensors

    torch.manual_seed(0)
    batch = fake_batch(plain.spec, 8, torch.device("cpu"), online=False)
    losses = {}
    for name, components in (("bf16", plain), ("fp8", fp8)):
        # adaLN-Zero: at its init every block's output is gated by 0, so no precision shows; random weights
        torch.manual_seed(5)
        with torch.no_grad():
            for param in components.raw_model.parameters():
                param.normal_(0, 0.2)
        torch.manual_seed(1)
        losses[name] = train_micro_step(components, batch).item()
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.05) and losses["fp8"] != losses["bf16"]
    assert all(torch.isfinite(p).all() for p in fp8.raw_model.parameters())


def test_fp8_needs_a_bf16_plan(workspace):
    with pytest.raises(UserError, match="the plan's precision is fp32.*dit-plan --precision bf16"):
        _components(workspace["plan1"], True)


def test_fp8_trains_resumes_exactly_samples_and_exports(workspace, tmp_path, capsys):
    from test_sample import fresh_accelerate_state

    from dit_accel.convert.export import main as export
    from dit_accel.sample.command import main as sample

    common = ["--plan", workspace["plan_bf16"], "--latents", workspace["latents"], "--num-workers", 0]
    common += ["--checkpoint-every", 2, "--no-progress-bar", "--no-tensorboard", "--fp8", "--lr", "3e-3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_in_process([*common, "--output-dir", straight, "--max-steps", 4]) == 0
    assert run_in_process([*common, "--output-dir", resumed, "--max-steps", 2]) == 0
    assert run_in_process([*common, "--output-dir", resumed, "--max-steps", 4, "--resume", "auto"]) == 0
    a, b = (run / "checkpoints" / "step_00000004" for run in (straight, resumed))
    for name in (ckpt.MODEL_WEIGHTS, ckpt.EMA_WEIGHTS):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        assert all(t.dtype == torch.float32 for t in x.values()), name  # no FP8 tensor in a checkpoint
    sidecar = json.loads((a / "dit_accel.json").read_text())
    assert sidecar["fp8"]["recipe"].startswith("tensorwise") and sidecar["fp8"]["linears"] > 0
    log = (straight / "logs" / "rank0.log").read_text()
    assert "linear layers of the blocks in FP8" in log and "FP8's are unmeasured" in log
    assert json.loads((resumed / ckpt.TRAIN_CONFIG).read_text())["fp8"] is True  # held on resume
    capsys.readouterr()
    with fresh_accelerate_state():
        flags = ["--checkpoint", straight, "--classes", "0,1", "--per-class", 1, "--steps", 2, "--out"]
        assert sample([str(v) for v in [*flags, tmp_path / "grid.png"]]) == 0
    assert (
        export(
            ["--checkpoint", str(straight), "--vae", str(workspace["vae"]), "--out", str(tmp_path / "pipe")]
        )
        == 0
    )
    weights = load_file(str(tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(t.dtype in (torch.float32, torch.float16) for t in weights.values())
