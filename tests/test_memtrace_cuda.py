"""CUDA's autocast traced without a GPU (dit_accel.memtrace.fake_cuda): the pieces any build can test, and the
whole trace where a CUDA build of torch is importable (CI has the CPU build: those tests skip there; run
them with a CUDA build, e.g. `/tmp/cudatorch/bin/python -m pytest tests/test_memtrace_cuda.py`)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dit_accel.memtrace import fake_cuda
from planner.planfile import parse_plan

needs_cuda_build = pytest.mark.skipif(
    not fake_cuda.without_a_device(), reason="needs a CUDA build of torch on a machine without a GPU"
)


def test_cuda_autocast_switches_cuda_autocast_on_and_restores_what_was_there():
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with fake_cuda.cuda_autocast(torch.bfloat16):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        with fake_cuda.cuda_autocast(torch.float16):
            assert torch.get_autocast_dtype("cuda") == torch.float16
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == before


def test_attention_is_pinned_to_flash_for_half_precision_and_to_memory_efficient_otherwise():
    kernel = fake_cuda.pinned_attention_kernel
    assert kernel(torch.bfloat16, 72, has_mask=False) == "flash"  # DiT-XL/2: 1152 / 16 heads
    assert kernel(torch.float16, 64, has_mask=False) == "flash"
    assert kernel(torch.float32, 72, has_mask=False) == "efficient"  # flash has no fp32
    assert kernel(torch.bfloat16, 70, has_mask=False) == "efficient"  # not a multiple of 8
    assert kernel(torch.bfloat16, 264, has_mask=False) == "efficient"
    assert kernel(torch.bfloat16, 64, has_mask=True) == "efficient"


def test_the_attention_mode_routes_sdpa_and_nothing_else(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(len(args))
        return args[0]

    monkeypatch.setattr(fake_cuda, "pinned_attention", spy)
    q = torch.ones(1, 1, 2, 8)
    with fake_cuda.PinnedAttention():
        assert F.scaled_dot_product_attention(q, q, q) is q
        assert torch.equal(torch.add(q, q), 2 * q)
    assert calls == [3]


def test_gradients_stand_in_for_the_backward_once_and_accumulate_in_place():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model[1].bias.requires_grad_(False)
    seen = []
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.data_ptr()))
    fake_cuda.gradients_as_after_backward(model)
    first = [p.grad for p in model.parameters()]
    fake_cuda.gradients_as_after_backward(model)  # a second micro-step adds into the same storage
    assert model[1].bias.grad is None and len(seen) == 2 * 3
    for param, grad in zip(model.parameters(), first):
        if param.requires_grad:
            assert param.grad is grad and param.grad.shape == param.shape and not param.grad.any()
    assert seen[:3] == seen[3:]


def _tiny_bf16_plan():
    return parse_plan(
        {
            "schema": "dit-plan/1",
            "inputs": {},
            "model": {
                "name": "DiT-custom",
                "resolution": 64,
                "depth": 2,
                "hidden": 64,
                "heads": 4,
                "patch": 2,
            },
            "cluster": {"world_size": 1},
            "global_batch": 16,
            "decision": {
                "micro_batch": 8,
                "grad_accum": 2,
                "checkpointed_blocks": 0,
                "precision": "bf16",
                "sharding": "ddp",
                "latents": "precomputed",
                "ema": True,
            },
        }
    )


@pytest.fixture(scope="module")
def cuda_trace():
    from dit_accel.memtrace import trace_training_step

    return trace_training_step(_tiny_bf16_plan(), autocast_device="cuda")


@needs_cuda_build
def test_a_cuda_trace_without_a_gpu_runs_the_step_under_cuda_autocast(cuda_trace):
    from dit_accel.memtrace import trace_training_step

    cpu = trace_training_step(_tiny_bf16_plan(), autocast_device="cpu")
    parts = cuda_trace.components
    assert cuda_trace.autocast_device == "cuda" and cuda_trace.traced_depths == [2]
    assert parts["autocast_cache"] > 0  # autocast was on: torch.autocast alone turns itself off here
    assert parts["optimizer"] == cpu.components["optimizer"] > 0  # AdamW stepped on the stand-in gradients
    assert parts["grads"] == cpu.components["grads"] > 0  # micro-step 2's forward holds micro-step 1's
    assert parts["activations"] > cpu.components["activations"]  # CUDA keeps layer_norm's output in fp32
    assert not cuda_trace.peak_at.startswith("backward")  # no backward window: it is not traced
    notes = " ".join(cuda_trace.unseen)
    assert "CPU-vs-CUDA" not in notes and "under CPU autocast (same shapes) peaks at" in notes


@needs_cuda_build
def test_a_cuda_trace_saves_no_attention_matrix(cuda_trace, monkeypatch):
    from dit_accel.memtrace import trace_training_step

    monkeypatch.setattr(  # SDPA left to choose without a device: the math path, which saves the matrix
        fake_cuda.PinnedAttention, "__torch_function__", lambda self, f, t, a=(), k=None: f(*a, **(k or {}))
    )
    unpinned = trace_training_step(_tiny_bf16_plan(), autocast_device="cuda")
    assert unpinned.components["activations"] > cuda_trace.components["activations"]
