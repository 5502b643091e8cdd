"""Memory components of one step, hand-checked on small cases, and the facts they start from."""

import dataclasses

import pytest
import torch

from planner import vae
from planner.activations import (
    backward_temporary_bytes,
    block_matrix_params,
    block_saved_bytes,
    element_bytes,
    saved_activation_bytes,
)
from planner.components import ALLOCATED
from planner.decision import Cluster, Decision
from planner.errors import PlanError
from planner.hardware import CALIBRATABLE, Assumptions, gpu_preset, gpu_presets
from planner.memory import step_memory
from planner.spec import model_spec
from planner.units import format_bytes, parse_bytes, parse_headroom

GiB = 2**30
XL2 = model_spec("DiT-XL/2", 256)
P = XL2.params_trainable


def decision(**changes):
    base = Decision(
        micro_batch=32,
        grad_accum=1,
        checkpointed_blocks=0,
        precision="bf16",
        sharding="ddp",
        latents="precomputed",
        ema=True,
        adamw="foreach",
        gradient_as_bucket_view=False,
    )
    return dataclasses.replace(base, **changes)


def memory(dec=None, cluster=None, assumptions=None, spec=XL2):
    return step_memory(
        spec, dec or decision(), cluster or Cluster(1, 8, 80 * 10**9), assumptions or Assumptions()
    )


# --- units ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40G", 40 * 10**9),
        ("40GB", 40 * 10**9),
        ("40gb", 40 * 10**9),
        ("40GiB", 40 * 2**30),
        ("80000M", 80 * 10**9),
        ("81920MiB", 80 * 2**30),
        ("39.5GiB", int(39.5 * 2**30)),
        ("1T", 10**12),
    ],
)
def test_sizes_parse_with_si_and_iec_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [("40", "no unit"), ("40XB", "unknown unit"), ("forty", "not a size"), ("0G", "positive")],
)
def test_bad_sizes_say_why(text, fragment):
    with pytest.raises(PlanError, match=fragment):
        parse_bytes(text)


def test_headroom_is_a_share_or_a_size():
    assert parse_headroom("5%", 1000) == 50
    assert parse_headroom("0.1", 1000) == 100
    assert parse_headroom("2GiB", 80 * GiB) == 2 * GiB
    with pytest.raises(PlanError):
        parse_headroom("150%", 1000)
    assert format_bytes(40 * 10**9) == "37.25 GiB"


# --- presets -------------------------------------------------------------------------------------------


def test_presets_carry_datasheet_rates_and_sources():
    presets = gpu_presets()
    for required in ("a100-40g", "a100-80g", "h100-80g", "h200", "l40s", "rtx4090", "v100-32g", "v100-16g"):
        assert required in presets
    for preset in presets.values():
        assert preset.source and preset.memory_bytes > 10 * GiB
        assert preset.peak_flops["fp16"] >= preset.peak_flops["fp32"]
    assert gpu_preset("A100-40GB").name == "a100-40g" and gpu_preset("4090").name == "rtx4090"
    with pytest.raises(PlanError, match="ambiguous"):  # two cards of different memory: never a silent pick
        gpu_preset("A100")
    assert gpu_preset("a100-80g").matmul_peak_flops("bf16") == 312e12
    assert gpu_preset("a100-80g").matmul_peak_flops("fp32") == 156e12  # TF32
    assert gpu_preset("v100-32g").matmul_peak_flops("fp32") == 15.7e12  # no TF32 on Volta
    with pytest.raises(PlanError, match="no bf16"):
        gpu_preset("v100-16g").matmul_peak_flops("bf16")


def test_assumptions_are_overridable_and_validated():
    changed = Assumptions().replace(fragmentation=0.1, cuda_context_bytes=GiB)
    assert changed.fragmentation == 0.1 and changed.cuda_context_bytes == GiB
    with pytest.raises(PlanError, match="unknown assumption"):
        Assumptions().replace(warp_drive=1)
    with pytest.raises(PlanError, match="fraction"):
        Assumptions().replace(fragmentation=1.5)
    with pytest.raises(PlanError, match="not measurable"):
        Assumptions().calibrated({"vae_params": 1})
    assert Assumptions().calibrated({"mfu_mixed": 0.4}).mfu("bf16") == 0.4
    assert set(CALIBRATABLE) <= {f.name for f in dataclasses.fields(Assumptions)}


# --- activations: the starting figures of docs/architecture.md -----------------------------------------


def test_xl2_activation_figures_match_the_design_traces():
    """The starting traces of XL/2 @256, micro-batch 32 (docs/architecture.md): fp32 19.86 GiB; CPU bf16
    autocast 10.36 GiB + 0.83 GiB weight copies (that trace filed the adaLN weight copies under activations:
    the sums agree); checkpointed 0.55 GiB bf16 / 1.09 GiB fp32."""
    fp32, cpu_bf16 = element_bytes("fp32"), element_bytes("bf16", "cpu")
    assert saved_activation_bytes(XL2, 32, fp32) / GiB == pytest.approx(19.86, abs=0.01)
    assert saved_activation_bytes(XL2, 32, fp32, 28) / GiB == pytest.approx(1.09, abs=0.01)
    assert saved_activation_bytes(XL2, 32, cpu_bf16, 28) / GiB == pytest.approx(0.55, abs=0.01)
    weight_copies = memory(decision()).phases["start_of_backward"]["autocast_cache"]
    assert (saved_activation_bytes(XL2, 32, cpu_bf16) + weight_copies) / GiB == pytest.approx(
        10.36 + 0.83, abs=0.02
    )


def test_block_bytes_per_element_by_regime():
    """Per token x hidden of one block: 20 fp32 tensors (80 B); CPU bf16 the same 20 in 2 B; CUDA bf16 keeps
    layer_norm's fp32 copies (4 x 4 B) and casts the fp32 modulated input for q, k, v separately (3 x 2 B)."""
    spec = model_spec("DiT-XL/2", 256)
    big = {
        name: v
        for name, v in block_saved_bytes(spec, 1, element_bytes("fp32")).items()
        if "embedder" not in name
    }
    per = lambda eb: (
        sum(
            v
            for k, v in block_saved_bytes(spec, 1, eb).items()
            if k not in ("embedder+adaLN", "1+scale (x2)")
        )
        / (spec.tokens * spec.hidden)
    )
    assert per(element_bytes("fp32")) == pytest.approx(80, abs=0.5)
    assert per(element_bytes("bf16", "cpu")) == pytest.approx(40, abs=0.5)
    assert per(element_bytes("bf16", "cuda")) == pytest.approx(52, abs=0.5)
    assert per(element_bytes("fp16", "cuda")) == per(element_bytes("bf16", "cuda"))
    assert len(big) >= 12


def test_non_fused_attention_adds_the_softmax():
    spec, eb = model_spec("DiT-XL/2", 256), element_bytes("bf16")
    extra = saved_activation_bytes(spec, 32, eb, attention="math") - saved_activation_bytes(spec, 32, eb)
    assert extra == 2 * spec.heads * spec.tokens**2 * 32 * spec.depth  # e * a * s^2 * b per block
    assert extra / GiB == pytest.approx(1.75, abs=0.01)  # docs/architecture.md: 22.56 - 20.82 GiB


# --- model states --------------------------------------------------------------------------------------


def test_ddp_states_hand_checked():
    parts = memory(decision()).phases["optimizer_step"]
    buffer = 4 * XL2.tokens * XL2.hidden
    assert parts["weights"] == 4 * P + buffer
    assert parts["grads"] == 8 * P  # grads + DDP buckets
    assert parts["optimizer"] == 8 * P
    assert parts["ema"] == 4 * P
    assert parts["temporaries"] == 4 * P  # the foreach AdamW intermediate
    assert parts["activations"] == parts["autocast_cache"] == 0


def test_torch_2_0s_foreach_adamw_holds_a_second_intermediate():
    """torch 2.0's foreach AdamW made the denominator out of place beside sqrt(v) (pytorch/pytorch#97712, fixed
    in 2.1 by #104780): --assume foreach_adamw_lists=2 counts 8 B/param at the update, and only there."""
    old = memory(assumptions=Assumptions(foreach_adamw_lists=2)).phases
    new = memory().phases
    assert old["optimizer_step"]["temporaries"] == 8 * P
    assert all(old[m]["temporaries"] == new[m]["temporaries"] for m in new if m != "optimizer_step")
    fused = memory(decision(adamw="fused"), assumptions=Assumptions(foreach_adamw_lists=2))
    assert fused.phases["optimizer_step"]["temporaries"] == 0
    with pytest.raises(PlanError, match="foreach_adamw_lists must be 1"):
        Assumptions(foreach_adamw_lists=3).validate()


def test_zero_grad_that_only_zeroes_keeps_every_gradient_through_the_step():
    """torch 1.13's zero_grad (set_to_none=False) zeroes the gradients in place, so they exist from the
    forward on: --assume zero_grad=zeros counts 4 B/param at every moment (one GPU: no buckets), where the
    default frees them until backward makes them, and the peak can move out of the optimizer step."""
    one = Cluster(1, 1, 80 * 10**9)
    kept = memory(decision(), one, Assumptions(zero_grad="zeros")).phases
    freed = memory(decision(), one).phases
    assert all(parts["grads"] == 4 * P for parts in kept.values())
    assert freed["end_of_forward"]["grads"] == 0 < freed["end_of_backward"]["grads"]
    assert kept["optimizer_step"] == freed["optimizer_step"]
    with pytest.raises(PlanError, match="zero_grad must be none"):
        Assumptions(zero_grad="keep").validate()


def test_single_gpu_has_no_buckets_nor_nccl():
    one = memory(cluster=Cluster(1, 1, 80 * 10**9)).phases["optimizer_step"]
    eight = memory().phases["optimizer_step"]
    assert one["grads"] == 4 * P and eight["grads"] == 8 * P
    # the overhead is memory outside the caching allocator: NCCL's buffers are the only difference
    assert eight["overhead"] - one["overhead"] == Assumptions().nccl_buffer_bytes


def test_bucket_view_fused_adamw_and_no_ema_each_save_four_bytes_per_param():
    base = memory().phases["optimizer_step"]
    for change in (dict(gradient_as_bucket_view=True), dict(adamw="fused"), dict(ema=False)):
        other = memory(decision(**change)).phases["optimizer_step"]
        saved = sum(base[k] - other[k] for k in ALLOCATED)  # the tensors, not the allocator's share
        assert saved == 4 * P, change


def test_gradients_appear_as_backward_makes_them():
    """With one micro-step `zero_grad(set_to_none=True)` leaves none before the backward; the final layer's
    come first, then each block's; inside block 0's backward all but block 0's, the shared embedder's and the
    patch embedding's exist (traced: 2,592,530,048 B at DiT-XL/2). Accumulating keeps all of them alive."""
    buckets = 4 * P  # 8 GPUs, no gradient_as_bucket_view
    once = memory(decision(grad_accum=1)).phases
    accumulating = memory(decision(grad_accum=4)).phases
    assert once["end_of_forward"]["grads"] == buckets
    assert once["start_of_backward"]["grads"] == buckets + 4 * XL2.param_breakdown()["final_layer"]
    assert once["end_of_backward"]["grads"] == buckets + 2_592_530_048
    for moment in ("end_of_forward", "start_of_backward", "end_of_backward", "optimizer_step"):
        assert accumulating[moment]["grads"] == buckets + 4 * P, moment


def test_backward_temporaries_match_the_traced_bytes():
    """Inside a block's backward (DiT-XL/2, micro-batch 32): the MLP-hidden gradient, two hidden-sized ones, a
    per-image modulation gradient, the MLP's weight and bias gradients and the shared embedder's buffered
    gradients; the trace of the trainer's step (CPU autocast) holds 131,800,320 B of temporaries there."""
    assert backward_temporary_bytes(XL2, 32, element_bytes("bf16", "cpu")) == 131_800_320
    at = memory(decision(), cluster=Cluster(1, 1, 80 * 10**9)).phases
    assert at["start_of_backward"]["temporaries"] == at["end_of_backward"]["temporaries"] > 0
    assert at["end_of_forward"]["temporaries"] == 0


def test_autocast_cache_holds_the_weights_cast_outside_checkpointed_blocks_until_the_forward_ends():
    """autocast's cache keeps a copy of every weight cast outside a checkpointed block (all but the class table
    and the checkpointed blocks' own weights, which are cast uncached; the shared embedder stays cached) until
    it exits after the loss; in backward only the copies linears saved remain."""
    c = 2
    for checkpointed in (0, 14, 28):
        at = memory(decision(checkpointed_blocks=checkpointed)).phases
        assert at["end_of_forward"]["autocast_cache"] == c * (
            P - 1001 * XL2.hidden - checkpointed * XL2.block_params
        )
        stored = XL2.depth - checkpointed
        held = 4 * 2 * 2 * XL2.hidden + XL2.hidden**2  # patch conv + the embedder's second timestep linear
        expected = (
            c * (stored * block_matrix_params(XL2) + held)
            if stored
            else c * (block_matrix_params(XL2) + held)
        )
        assert at["start_of_backward"]["autocast_cache"] == expected
    every = memory(
        decision(checkpointed_blocks=28)
    ).phases  # inside block 27: the patch conv and the embedder
    timestep_mlp = XL2.embedder_params - 1001 * XL2.hidden
    assert every["last_block_forward"]["autocast_cache"] == c * (
        XL2.param_breakdown()["patch_embed"] + timestep_mlp
    )
    assert memory(decision(precision="fp32")).phases["end_of_forward"]["autocast_cache"] == 0


def test_every_block_checkpointed_adds_the_last_blocks_forward_and_can_peak_at_block_0():
    """With every block checkpointed the forward's last block holds every block's input plus its MLP working
    set, and block 0's backward holds nearly every gradient: at micro-batch 64 (fused AdamW) that is the peak,
    as the trace finds it."""
    all_checkpointed = memory(
        decision(checkpointed_blocks=28, micro_batch=64, adamw="fused"), cluster=Cluster(1, 1, 80 * 10**9)
    )
    assert "last_block_forward" in all_checkpointed.phases
    assert all_checkpointed.peak_phase == "end_of_backward"
    assert "last_block_forward" not in memory(decision(checkpointed_blocks=27)).phases


def test_sharding_divides_model_states_and_adds_gathered_copies():
    cluster = Cluster(1, 8, 80 * 10**9)
    zero2 = memory(decision(sharding="zero2"), cluster)
    zero3 = memory(decision(sharding="zero3"), cluster)
    for estimate in (zero2, zero3):
        step = estimate.phases["optimizer_step"]
        assert step["optimizer"] == 8 * P // 8 and step["ema"] == 4 * P // 8 and step["grads"] == 4 * P // 8
    bwd2, bwd3 = zero2.phases["start_of_backward"], zero3.phases["start_of_backward"]
    buffer = 4 * XL2.tokens * XL2.hidden
    assert bwd2["weights"] == 4 * P // 8 + buffer + 2 * P  # SHARD_GRAD_OP keeps every unit gathered in bf16
    outside_blocks = P - XL2.depth * XL2.block_params
    assert bwd3["weights"] == 4 * P // 8 + buffer + 2 * (2 * XL2.block_params + outside_blocks)
    assert bwd2["autocast_cache"] == bwd3["autocast_cache"] == 0  # FSDP params are already bf16
    assert zero3.peak_bytes < zero2.peak_bytes < memory(decision(), cluster).peak_bytes


def test_checkpointing_trades_activations_and_weight_copies():
    full = memory(decision(checkpointed_blocks=0)).phases["start_of_backward"]
    half = memory(decision(checkpointed_blocks=14)).phases["start_of_backward"]
    every = memory(decision(checkpointed_blocks=28)).phases["start_of_backward"]
    assert full["activations"] > half["activations"] > every["activations"]
    assert full["autocast_cache"] > half["autocast_cache"] > every["autocast_cache"] > 0
    # all 28 checkpointed: inputs (2 B/elem) + one block recomputed, far below the stored network
    assert every["activations"] < full["activations"] / 10


def test_peak_is_the_larger_moment():
    lean = memory(decision(micro_batch=1, checkpointed_blocks=28))
    assert lean.peak_phase == "optimizer_step"
    fat = memory(decision(micro_batch=32))
    assert fat.peak_phase == "start_of_backward"
    assert fat.peak_bytes == max(fat.phase_bytes(p) for p in fat.phases)
    assert sum(fat.components.values()) == fat.peak_bytes


def test_the_allocators_reserve_and_the_fixed_overheads_are_added():
    base = memory()
    none = memory(
        assumptions=Assumptions(cuda_context_bytes=0, cublas_workspace_bytes=0, nccl_buffer_bytes=0)
    )
    a = Assumptions()
    # the cuBLAS workspaces are reserved memory (PyTorch allocates them through its caching allocator)
    assert none.components["overhead"] == 0
    assert none.components["allocator"] == base.components["allocator"] - a.cublas_workspace_bytes
    assert base.components["overhead"] == a.cuda_context_bytes + a.nccl_buffer_bytes
    # peak = reserved + overhead, reserved = allocated + the allocator's share (at the peak moment)
    assert base.peak_bytes == base.reserved_peak_bytes + base.components["overhead"]
    allocated = sum(base.components[name] for name in ALLOCATED)
    assert base.reserved_peak_bytes == allocated + base.components["allocator"] > allocated
    # a measured fragmentation (a calibration) replaces the model
    measured = memory(assumptions=Assumptions(fragmentation=0.1))
    assert measured.components["allocator"] == pytest.approx(
        0.1 * allocated + a.cublas_workspace_bytes, abs=1
    )


# --- the VAE -------------------------------------------------------------------------------------------


def _sd_vae():
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=2,
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=list(vae.ENCODER_CHANNELS),
        )


def test_vae_sizes_match_diffusers_autoencoder():
    model = _sd_vae()
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(model.encoder) + count(model.quant_conv) == vae.ENCODER_PARAMS
    assert count(model) == Assumptions().vae_params


def test_vae_encoder_macs_match_a_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    model = _sd_vae().to_empty(device="cpu").eval()
    image = torch.zeros(1, 3, 64, 64)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.encode(image)
    assert vae.encoder_macs_per_image(64) == pytest.approx(counter.get_total_flops() / 2, rel=0.02)


def test_online_latents_add_the_vae():
    online = memory(decision(latents="online"), spec=model_spec("DiT-XL/2", 256, "online"))
    assert "vae_encode" in online.phases
    weights = Assumptions().vae_params * 4
    assert online.phases["optimizer_step"]["vae"] == weights
    assert online.phases["vae_encode"]["vae"] == weights + vae.encoder_activation_bytes(256, 32, 5.0)
    # traced at micro-batch 8 (CPU): weights + five 128-channel maps of 256 x 256 per image, exactly
    eight = memory(decision(latents="online", micro_batch=8), spec=model_spec("DiT-XL/2", 256, "online"))
    assert eight.phases["vae_encode"]["vae"] == 1_676_792_732
    assert "vae_encode" not in memory().phases


def test_published_runs_that_fit_their_gpus_fit_and_those_that_ran_out_of_memory_do_not():
    """The public record of docs/planner-accuracy.md (benchmarks/public_runs.py holds each run's conditions):
    every run that trained fits its GPUs in the planner at the batch it ran (OpenDiT's, told only as a run,
    too), and the two that ran out of memory (fast-DiT's first row, DiT issue #22 on RTX 3090s) do not fit
    at theirs."""
    import importlib.util
    from pathlib import Path

    from planner.memory import step_memory
    from planner.plan import make_plan

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "public_runs.py"
    module_spec = importlib.util.spec_from_file_location("public_runs", path)
    runs = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(runs)
    for _, flags, _ in runs.THROUGHPUT:
        plan = make_plan(**flags)
        assert plan["memory"]["needed_bytes"] <= plan["memory"]["budget_bytes"]
        assert (
            plan["decision"]["micro_batch"]
            * plan["decision"]["grad_accum"]
            * flags["gpus"]
            * flags.get("nodes", 1)
            == flags["global_batch"]
        )
    spec = model_spec("DiT-XL/2", 256)
    fast_dit = Assumptions(**runs.FAST_DIT_ASSUMPTIONS)
    for _, decision, _ in runs.MEMORY:  # the memory rows ran one micro-step of their whole batch, and fit
        assert step_memory(spec, decision, runs.FAST_DIT_CLUSTER, fast_dit).fits
    verdicts = [(step_memory(spec, *run[1:4]).fits, run[4]) for run in runs.VERDICTS]
    assert [fit for _, fit in verdicts] == [False, False, True]
    assert all(planned == published for planned, published in verdicts)


def test_the_vavae_encoder_sizes_and_macs_match_diffusers_autoencoder():
    """VA-VAE f16d32 (models.vavae): parameters of the encoder and the whole autoencoder, and the encoder's
    multiply-adds with its attention at the last level, against a meta AutoencoderKL and torch's flop counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from dit_accel.models.vavae import build_vavae

    with torch.device("meta"):
        model = build_vavae()
    count = lambda m: sum(p.numel() for p in m.parameters())
    shape = vae.ENCODERS["va-vae"]
    assert count(model.encoder) + count(model.quant_conv) == shape.encoder_params
    assert count(model) == shape.params == vae.autoencoder_params("va-vae", 1)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.encode(torch.zeros(1, 3, 64, 64))
    assert vae.encoder_macs_per_image(64, "va-vae") == pytest.approx(counter.get_total_flops() / 2, rel=0.02)
