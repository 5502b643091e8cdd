"""The planner against every published DiT training run docs/planner-accuracy.md lists ("Public
measurements"): each run's conditions as dit-plan flags, the planner's estimate, the published figure and
the error (plan / published - 1), and the runs told only as a verdict (ran, out of memory) against the planner's. Pure
planner arithmetic, no GPU; prints the three Markdown tables.

    python benchmarks/public_runs.py
"""

from __future__ import annotations

from planner.decision import Cluster, Decision
from planner.hardware import Assumptions, gpu_preset
from planner.memory import step_memory
from planner.plan import make_plan
from planner.search import estimate_throughput
from planner.spec import model_spec

MiB = 1 << 20
# what those codebases ran on, PyTorch's defaults: fixed segments, AdamW's state made in its first step
TORCH_DEFAULTS = {"allocator_segments": "fixed", "adamw_state": "lazy"}
# fast-DiT README, "Improved Training Performance": one A100-80G, DiT-XL/2 @256, batch 128, every block
# checkpointed, PyTorch's default (fixed-segment) allocator. Its performance/*.out logs (May 2023) show torch
# 1.13 (the tracebacks' module.py and distributed.py lines; environment.yml: pytorch >= 1.13, CUDA 11.7), whose
# AdamW defaults to the per-tensor loop, whose zero_grad only zeroes (set_to_none=False), and timm's math
# attention (no SDPA before torch 2.0)
FAST_DIT_ASSUMPTIONS = {**TORCH_DEFAULTS, "zero_grad": "zeros", "attention": "math"}
FAST_DIT = dict(
    gpu="a100-80g", gpus=1, global_batch=128, checkpointing="all", assumptions=FAST_DIT_ASSUMPTIONS
)
# facebookresearch/DiT issue #22: 8 x A100-80G, global batch 256, the original train.py (no checkpointing,
# the VAE encoding every batch, DDP in fp32)
REFERENCE = dict(
    gpu="a100-80g",
    gpus=8,
    global_batch=256,
    checkpointing="none",
    latents="online",
    assumptions=TORCH_DEFAULTS,
)

REFERENCE_IEEE_IMAGES_PER_S = 130.56  # issue #22's IEEE run, 0.51 steps/s x 256
# (run, flags, published images/s)
THROUGHPUT = [
    ("fast-DiT, fp16, precomputed latents (0.84 steps/s)", dict(FAST_DIT, precision="fp16"), 107.52),
    ("fast-DiT, fp16, online VAE (0.56 steps/s)", dict(FAST_DIT, precision="fp16", latents="online"), 71.68),
    ("fast-DiT, TF32, online VAE (0.43 steps/s)", dict(FAST_DIT, precision="tf32", latents="online"), 55.04),
    # fast-DiT's performance/A100 and performance/2A100 logs (May 2023), steps/s at step 300 on: its train.py
    # (fp16, precomputed), train_options' train_amp (fp16, online), train_features (TF32, precomputed) and
    # train_baseline (TF32, online); the logs do not state the batch: the README's 128, on 1 or 2 GPUs
    *[
        (
            f"fast-DiT log, {gpus} x A100, {label} ({rate} steps/s)",
            dict(FAST_DIT, gpus=gpus, **flags),
            rate * 128,
        )
        for gpus, rates in ((1, (0.75, 0.52, 0.56, 0.42)), (2, (1.33, 0.85, 1.03, 0.77)))
        for (label, flags), rate in zip(
            (
                ("fp16, precomputed", dict(precision="fp16")),
                ("fp16, online VAE", dict(precision="fp16", latents="online")),
                ("TF32, precomputed", dict(precision="tf32")),
                ("TF32, online VAE", dict(precision="tf32", latents="online")),
            ),
            rates,
        )
    ],
    ("DiT issue #22, TF32 (0.81 steps/s)", dict(REFERENCE, precision="tf32"), 207.36),
    (
        "DiT issue #22, IEEE fp32 matmuls (0.51 steps/s)",
        dict(REFERENCE, precision="fp32"),
        REFERENCE_IEEE_IMAGES_PER_S,
    ),
    # hpcaitech/Open-Sora docs/speed.md (2024-03-14): DiT-XL/2 on 8 x H800 (H100 SXM's compute), local batch
    # 128, 1.3 it/s; its ImageNet config: fp16, gradient checkpointing, ZeRO-2, the VAE encoding online
    (
        "Open-Sora, 8 x H800, fp16, all checkpointed, zero2, online VAE (1.3 it/s)",
        dict(
            gpu="h100-80g",
            gpus=8,
            global_batch=1024,
            precision="fp16",
            checkpointing="all",
            sharding="zero2",
            latents="online",
        ),
        1.3 * 1024,
    ),
    # hustvl/LightningDiT docs/log.txt (2024-12-29): 675M parameters, 32 per GPU at global batch 1024 (32
    # GPUs; the type is not logged, the paper's are H800), bf16, precomputed latents, about 5.2 steps/s
    (
        "LightningDiT log, 32 GPUs (4 x 8 H800 assumed), bf16, precomputed (5.2 steps/s)",
        dict(
            gpu="h100-80g",
            gpus=8,
            nodes=4,
            global_batch=1024,
            precision="bf16",
            checkpointing="none",
            sharding="ddp",
        ),
        5.2 * 1024,
    ),
]
# (run, the step it ran, published MiB as printed): fast-DiT's rows on its one A100, torch 1.13's AdamW loop
A100_80G = gpu_preset("a100-80g")
FAST_DIT_CLUSTER = Cluster(1, 1, A100_80G.memory_bytes, gpu=A100_80G)
MEMORY = [
    (
        "fast-DiT, fp16, precomputed latents",
        Decision(128, 1, 28, "fp16", "ddp", "precomputed", adamw="single"),
        27_485,
    ),
    ("fast-DiT, fp16, online VAE", Decision(128, 1, 28, "fp16", "ddp", "online", adamw="single"), 40_461),
    ("fast-DiT, TF32, online VAE", Decision(128, 1, 28, "fp32", "ddp", "online", adamw="single"), 44_045),
]


# (run, the step it ran, its GPUs, the assumptions, whether it fit): published runs whose memory is told only
# as a verdict, at the micro-batch they ran (the search might pick another); the planner must agree
VERDICTS = [
    (
        "fast-DiT README, first row: 1 x A100-80G, batch 128, fp32, no checkpointing, online VAE",
        Decision(128, 1, 0, "fp32", "ddp", "online", adamw="single"),
        FAST_DIT_CLUSTER,
        Assumptions(**FAST_DIT_ASSUMPTIONS),
        False,
    ),
    (
        "DiT issue #22: 8 x RTX 3090 (24 GB), 32 per GPU, fp32, no checkpointing, online VAE, DDP",
        Decision(32, 1, 0, "fp32", "ddp", "online", adamw="foreach", gradient_as_bucket_view=False),
        Cluster(1, 8, 24 * 10**9),
        Assumptions(**TORCH_DEFAULTS),
        False,
    ),
    # NUS-HPC-AI-Lab/OpenDiT README ("DiT Reproduction Result"): DiT-XL/2 trained 80k steps on 8 GPUs at 180
    # per GPU, fp16, its default ZeRO-2 plugin (the EMA sharded too), no checkpointing, flash attention, the
    # VAE encoding online; the GPU is not named (planned as an 80 GB A100)
    (
        "OpenDiT README: 8 x 80 GB, 180 per GPU, fp16, ZeRO-2, no checkpointing, online VAE (trained 80k steps)",
        Decision(180, 1, 0, "fp16", "zero2", "online"),
        Cluster(1, 8, A100_80G.memory_bytes, gpu=A100_80G),
        Assumptions(**TORCH_DEFAULTS),
        True,
    ),
]


def verdict_rows() -> None:
    print(
        "\n| run | planner allocated MiB | reserved | least it runs in + overhead | budget | published | planner |"
        "\n|---|---|---|---|---|---|---|"
    )
    spec = model_spec("DiT-XL/2", 256)
    for name, decision, cluster, assumptions, fit in VERDICTS:
        estimate = step_memory(spec, decision, cluster, assumptions)
        print(
            f"| {name} | {estimate.allocated_peak_bytes / MiB:,.0f} | {estimate.reserved_peak_bytes / MiB:,.0f} | "
            f"{estimate.needed_bytes / MiB:,.0f} | {estimate.budget_bytes / MiB:,.0f} | "
            f"{'ran' if fit else 'out of memory'} | {'fits' if estimate.fits else 'does not fit'} |"
        )


def reference_ieee_with_tf32_convolutions() -> float:
    """The IEEE row as that run had it: matmuls in IEEE fp32 but cuDNN TF32 on for the VAE's convolutions
    (PyTorch's default then); the trainer's --no-tf32 turns both off, which is what dit-plan plans. The
    library takes the VAE's mode where the CLI does not: 32 per GPU, no checkpointing, DDP, online VAE."""
    a100 = gpu_preset("a100-80g")
    decision = Decision(32, 1, 0, "fp32", "ddp", "online")
    cluster = Cluster(1, 8, a100.memory_bytes, gpu=a100)
    spec = model_spec("DiT-XL/2", 256)
    return estimate_throughput(
        spec, decision, cluster, Assumptions(**TORCH_DEFAULTS), "ieee-fp32", "tf32"
    ).images_per_s


def main() -> None:
    print("| run | planner img/s | published | error |\n|---|---|---|---|")
    for name, flags, published in THROUGHPUT:
        # eager, as those trainers ran (their steps are not torch.compile'd; the MFU table's figures are eager)
        rate = make_plan(**flags, compile=False)["throughput"]["est_images_per_s"]
        print(f"| {name} | {rate:.1f} | {published} | {rate / published - 1:+.0%} |")
    rate, published = reference_ieee_with_tf32_convolutions(), REFERENCE_IEEE_IMAGES_PER_S
    print(
        f"| DiT issue #22, IEEE fp32, the VAE on cuDNN TF32 as run | {rate:.1f} | {published} | {rate / published - 1:+.0%} |"
    )
    print(
        "\n| run | micro-batch | planner allocated MiB | reserved | reserved + overhead | published MiB | error |"
        "\n|---|---|---|---|---|---|---|"
    )
    spec = model_spec("DiT-XL/2", 256)
    for name, decision, published in MEMORY:
        estimate = step_memory(spec, decision, FAST_DIT_CLUSTER, Assumptions(**FAST_DIT_ASSUMPTIONS))
        allocated, reserved = estimate.allocated_peak_bytes / MiB, estimate.reserved_peak_bytes / MiB
        total = estimate.peak_bytes / MiB
        print(
            f"| {name} | {decision.micro_batch} | {allocated:,.0f} | {reserved:,.0f} | {total:,.0f} | "
            f"{published:,} | {total / published - 1:+.0%} |"
        )
    verdict_rows()


if __name__ == "__main__":
    main()
