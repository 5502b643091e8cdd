"""The choice: micro-batch x accumulation x checkpointed blocks x sharding, and the throughput that ranks them.

The rule (docs/planner.md, "The search rule"):

1. `micro_batch * grad_accum * world_size == global_batch`, exactly: micro-batches are the divisors of the
   per-rank batch (at most --max-micro-batch), and `grad_accum` is what is left.
2. A fixed path is walked from the leanest configuration (the most sharding allowed, the smallest
   micro-batch, every block checkpointed). Each step takes the one move, among
       the next larger micro-batch | one checkpointed block fewer | one level less sharding,
   that buys the most estimated images/s per extra byte of peak memory (ties: micro-batch first, then
   checkpointing, then sharding). A move the estimate says is slower is never taken (one level less
   sharding: more than REPLICA_TOLERANCE, 5%, slower: FSDP costs more than its modelled 5%)); the path ends
   where every remaining move is, so its furthest point is its fastest (within that tolerance).
3. The decision is the furthest point of that path that fits the budget (VRAM minus headroom).

The path does not depend on the budget, so more memory can only move the decision further along it: a
larger budget never gives a smaller micro-batch, more checkpointed blocks or more sharding. Moves toward
less sharding are taken last when they do not pay (shard only when replicas don't fit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner import repa, vae
from planner.activations import element_bytes
from planner.decision import SHARDINGS, Cluster, Decision
from planner.errors import PlanError
from planner.hardware import Assumptions, matmul_mode, mfu_entry
from planner.memory import MemoryEstimate, step_memory
from planner.repa import DEFAULT_PROJECTOR_DIM
from planner.rules import default_matmul
from planner.spec import DiTSpec

FALLBACK_BUSBW_BYTES_PER_S = 100e9  # intra-node bandwidth when only --vram is known
REPLICA_TOLERANCE = 0.05  # a move to less sharding is taken unless the estimate says it is this much slower


# --- throughput --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    step_flops: float  # FLOPs of one optimizer step on the whole cluster (recompute and VAE encode included)
    images_per_s: float
    step_time_s: float
    compute_time_s: float  # the DiT's forward, backward and recompute
    exposed_comm_time_s: float
    efficiency: float  # small-micro-batch efficiency, 1 = saturated matmuls
    peak_flops_per_gpu: float
    assumed_mfu: float
    images_per_s_low: float = 0.0  # at the low end of the MFU range
    images_per_s_high: float = 0.0
    mfu_low: float = 0.0
    mfu_high: float = 0.0
    fixed_time_s: float = 0.0  # per optimizer step: AdamW + EMA bytes / memory bandwidth + launch overhead
    vae_time_s: float = 0.0  # the VAE encoder (online latents), at its own fp32 / TF32 rate
    matmul: str = ""  # bf16 | fp16 | tf32 | ieee-fp32: the rate the DiT's matmuls were estimated at
    mfu_source: str = ""  # where the MFU comes from (the table entry, its fallback, or the override)


def dit_image_flops(spec: DiTSpec, decision: Decision) -> float:
    """The DiT's training FLOPs per image: forward + backward (3 x forward) and each checkpointed block's
    recompute (one more forward); with REPA its encoder's forward and the projector's forward + backward,
    which run at the DiT's rate (the same autocast)."""
    dit = 3 * spec.fwd_flops_per_image + decision.checkpointed_blocks * 2 * spec.block_fwd_macs_per_image()
    return dit + repa_image_flops(spec, decision)


def repa_image_flops(spec: DiTSpec, decision: Decision) -> float:
    """REPA per image: the frozen encoder's forward (2 x its multiply-adds) and the projector's forward and
    backward (3 x 2 x its multiply-adds); 0 without REPA."""
    if not decision.repa:
        return 0.0
    encoder = repa.encoder_spec(decision.repa)
    grid = spec.latent_size // spec.patch
    projector = repa.projector_fwd_macs_per_image(
        spec.tokens, spec.hidden, encoder.dim, decision.repa_projector_dim
    )
    return 2 * encoder.fwd_macs_per_image(grid) + 6 * projector


def vae_image_flops(spec: DiTSpec, decision: Decision) -> float:
    """The VAE encoder's forward per image when latents are encoded online, else 0."""
    return (
        2 * vae.encoder_macs_per_image(spec.resolution, spec.tokenizer)
        if decision.latents == "online"
        else 0.0
    )


def image_step_flops(spec: DiTSpec, decision: Decision) -> float:
    """Training FLOPs per image: forward + backward (3 x forward), one more forward of each checkpointed
    block, and the VAE encoder's forward when latents are encoded online."""
    return dit_image_flops(spec, decision) + vae_image_flops(spec, decision)


def small_batch_efficiency(spec: DiTSpec, micro_batch: int, assumptions: Assumptions) -> float:
    """Matmuls of micro_batch x tokens rows run at rows / (rows + half_efficiency_tokens) of their saturated rate."""
    rows = micro_batch * spec.tokens
    return rows / (rows + assumptions.half_efficiency_tokens)


def comm_bytes_per_gpu(spec: DiTSpec, decision: Decision, cluster: Cluster) -> float:
    """Bytes each GPU sends per optimizer step (ring collectives).

    ddp:   one all-reduce of the fp32 gradients per optimizer step (no_sync during accumulation).
    zero2: every micro-step an all-gather of the parameters and a reduce-scatter of the gradients, both in
           the compute dtype (Accelerate's FSDP mixed-precision policy).
    zero3: the same with a second all-gather in backward.
    hsdp:  zero3's collectives inside the node, plus an all-reduce of the gradient shard across the nodes
           (`hsdp_comm_bytes_per_gpu`).
    """
    if decision.sharding == "hsdp":
        return sum(hsdp_comm_bytes_per_gpu(spec, decision, cluster))
    n = cluster.world_size
    if n == 1:
        return 0.0
    params = spec.params_trainable
    share = (n - 1) / n
    if decision.sharding == "ddp":
        return 2 * share * 4 * params
    width = element_bytes(decision.precision).compute
    collectives = 2 if decision.sharding == "zero2" else 3
    return decision.grad_accum * collectives * share * width * params


def hsdp_comm_bytes_per_gpu(spec: DiTSpec, decision: Decision, cluster: Cluster) -> tuple[float, float]:
    """(inside the node, across nodes) bytes each GPU sends per optimizer step under hsdp, every micro-step
    (sync_each_batch): two all-gathers and a reduce-scatter over the node's g GPUs, then an all-reduce of
    the 1/g gradient shard among the N GPUs that hold the same shard, one per node, all in the compute dtype."""
    g, nodes = cluster.gpus_per_node, cluster.nodes
    width = element_bytes(decision.precision).compute
    params = spec.params_trainable
    inside = 3 * (g - 1) / g * width * params
    across = 2 * (nodes - 1) / nodes * width * params / g
    return decision.grad_accum * inside, decision.grad_accum * across


def comm_time_s(spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions) -> float:
    """Seconds of communication per optimizer step, before overlap: each collective's bytes at the bus
    bandwidth of the links it crosses (a ring over several nodes runs at the inter-node rate)."""
    if decision.sharding == "hsdp":
        inside, across = hsdp_comm_bytes_per_gpu(spec, decision, cluster)
        return inside / intra_node_bandwidth(cluster, assumptions) + across / bus_bandwidth(
            cluster, assumptions
        )
    return comm_bytes_per_gpu(spec, decision, cluster) / bus_bandwidth(cluster, assumptions)


def peak_flops(cluster: Cluster, precision: str, assumptions: Assumptions) -> float:
    """The matmul peak of `precision` (bf16, fp16, tf32, ieee-fp32, or fp32 = TF32 where there is TF32)."""
    if cluster.gpu is not None:
        return cluster.gpu.matmul_peak_flops(precision)
    if precision == "ieee-fp32":
        return assumptions.default_peak_flops / 16  # A100: 19.5 of 312 TFLOP/s
    return assumptions.default_peak_flops / (2 if precision in ("fp32", "tf32") else 1)  # TF32: half


def bus_bandwidth(cluster: Cluster, assumptions: Assumptions) -> float:
    """The bus bandwidth of a collective over every GPU: the inter-node rate as soon as it crosses nodes."""
    if cluster.nodes > 1:
        return assumptions.inter_node_busbw_bytes_per_s
    return intra_node_bandwidth(cluster, assumptions)


def intra_node_bandwidth(cluster: Cluster, assumptions: Assumptions) -> float:
    """The bus bandwidth of a collective among one node's GPUs (NVLink / PCIe)."""
    if assumptions.intra_node_busbw_bytes_per_s:
        return assumptions.intra_node_busbw_bytes_per_s
    return cluster.gpu.intra_node_busbw_bytes_per_s if cluster.gpu else FALLBACK_BUSBW_BYTES_PER_S


def memory_bandwidth(cluster: Cluster, assumptions: Assumptions) -> float:
    if cluster.gpu is not None and cluster.gpu.memory_bandwidth_bytes_per_s:
        return cluster.gpu.memory_bandwidth_bytes_per_s
    return assumptions.default_memory_bandwidth_bytes_per_s


def fixed_step_time(spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions) -> float:
    """Per optimizer step, beside the matmuls: the fused AdamW and the EMA update read and write every
    parameter's states (bytes-bound: bytes / memory bandwidth; each rank its shard when sharded), plus a
    constant for kernel launches, zero_grad and the host loop. It dominates at small micro-batches."""
    params = spec.params_trainable / (cluster.world_size if decision.sharded else 1)
    per_param = assumptions.step_fixed_bytes_per_param - (0 if decision.ema else 12)
    return assumptions.step_fixed_overhead_s + max(per_param, 0) * params / memory_bandwidth(
        cluster, assumptions
    )


def table_entry(cluster: Cluster, mode: str):
    """The MFU table's entry for this cluster's GPU (its own, else its family's) in a table mode."""
    return mfu_entry(cluster.gpu.family, mode, cluster.gpu.name) if cluster.gpu else mfu_entry(None, mode)


def mfu_range(
    cluster: Cluster, precision: str, matmul: str, assumptions: Assumptions, compiled: bool = False
):
    """(low, point, high, source) of the MFU for `matmul` on this GPU: an --assume or calibration override is
    one value (calibrate times the eager step); otherwise the measured table's entry for the GPU's family
    (presets/mfu.yaml), times its measured speed-up when the blocks are compiled."""
    override = assumptions.mfu(precision)
    if override:
        return override, override, override, "--assume / --calibration"
    entry = table_entry(cluster, matmul_mode(matmul))
    source = entry.source + (f" (fallback: {entry.fallback})" if entry.fallback else "")
    speedup = entry.compiled_speedup if compiled else 1.0
    if compiled:
        source += (
            f"; compiled blocks x{speedup:.2f} (measured)"
            if speedup != 1.0
            else "; compiled blocks: no measured speed-up here, rated as eager"
        )
    low, point, high = (min(1.0, mfu * speedup) for mfu in (entry.low, entry.point, entry.high))
    return low, point, high, source


def vae_matmul(matmul: str) -> str:
    """The VAE encodes in fp32: on TF32 tensor cores (the trainer's default, cuDNN TF32 on) unless the plan
    asks for IEEE fp32 everywhere."""
    return "ieee-fp32" if matmul == "ieee-fp32" else "tf32"


def vae_mfu_range(cluster: Cluster) -> tuple[float, float, float]:
    """(low, point, high) of the VAE encoder's MFU on this GPU: its fp32 convolutions have their own entry
    (presets/mfu.yaml `vae`, measured as the time online latents add to a step), whatever the DiT's mode."""
    entry = table_entry(cluster, "vae")
    return entry.low, entry.point, entry.high


def vae_time_s(
    spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions, vae_mode: str, mfu: float
) -> float:
    """Seconds the VAE encoder takes per optimizer step on one GPU (0 without online latents): its FLOPs at
    the peak of its mode (TF32, or IEEE fp32 when TF32 is off) x its own MFU."""
    images = decision.micro_batch * decision.grad_accum
    flops = vae_image_flops(spec, decision)
    return images * flops / (peak_flops(cluster, vae_mode, assumptions) * mfu) if flops else 0.0


def estimate_throughput(
    spec: DiTSpec,
    decision: Decision,
    cluster: Cluster,
    assumptions: Assumptions,
    matmul: str | None = None,
    vae_mode: str | None = None,
    compiled: bool = False,
) -> Throughput:
    """Images per second: per-GPU compute at peak x MFU x small-batch efficiency, the VAE encoder at its own
    rate (`vae_mode`: its convolutions on tf32 or ieee-fp32; by default as the trainer runs them), a fixed
    per-step cost, and exposed communication; low and high at the ends of the MFU ranges. `compiled`: the
    blocks run torch.compile'd (plan.json's decision.compile), at the table's measured speed-up."""
    matmul = matmul or default_matmul(decision.precision)
    vae_mode = vae_mode or vae_matmul(matmul)
    global_batch = decision.micro_batch * decision.grad_accum * cluster.world_size
    images = decision.micro_batch * decision.grad_accum  # per GPU per optimizer step
    efficiency = small_batch_efficiency(spec, decision.micro_batch, assumptions)
    peak = peak_flops(cluster, matmul, assumptions)
    low, point, high, source = mfu_range(cluster, decision.precision, matmul, assumptions, compiled)
    sharded = assumptions.fsdp_efficiency if decision.sharded else 1.0
    vae_mfus = vae_mfu_range(cluster)
    fixed_s = fixed_step_time(spec, decision, cluster, assumptions)
    comm_s = assumptions.comm_exposed_fraction * comm_time_s(spec, decision, cluster, assumptions)

    def times(mfu, vae_mfu):
        compute = images * dit_image_flops(spec, decision) / (peak * mfu * efficiency * sharded)
        return compute, vae_time_s(spec, decision, cluster, assumptions, vae_mode, vae_mfu)

    compute_s, vae_s = times(point, vae_mfus[1])
    step_s = compute_s + vae_s + fixed_s + comm_s
    slow = sum(times(low, vae_mfus[0])) + fixed_s + comm_s
    fast = sum(times(high, vae_mfus[2])) + fixed_s + comm_s
    return Throughput(
        step_flops=image_step_flops(spec, decision) * global_batch,
        images_per_s=global_batch / step_s,
        step_time_s=step_s,
        compute_time_s=compute_s,
        exposed_comm_time_s=comm_s,
        efficiency=efficiency,
        peak_flops_per_gpu=peak,
        assumed_mfu=point,
        images_per_s_low=global_batch / slow,
        images_per_s_high=global_batch / fast,
        mfu_low=low,
        mfu_high=high,
        fixed_time_s=fixed_s,
        vae_time_s=vae_s,
        matmul=matmul,
        mfu_source=source,
    )


def implied_mfu(
    spec: DiTSpec,
    decision: Decision,
    cluster: Cluster,
    assumptions: Assumptions,
    images_per_s: float,
    matmul: str | None = None,
    vae_mode: str | None = None,
) -> float:
    """The MFU a measured images/s (whole cluster) implies under this model: the step time less the fixed
    cost, the exposed communication and the VAE encoder (online latents, at its own entry; `vae_mode` says
    whether its convolutions ran on TF32, by default as the trainer runs them), over the DiT's FLOPs at the
    peak x small-batch efficiency. How presets/mfu.yaml was derived."""
    matmul = matmul or default_matmul(decision.precision)
    global_batch = decision.micro_batch * decision.grad_accum * cluster.world_size
    images = decision.micro_batch * decision.grad_accum
    rest = (
        global_batch / images_per_s
        - fixed_step_time(spec, decision, cluster, assumptions)
        - assumptions.comm_exposed_fraction * comm_time_s(spec, decision, cluster, assumptions)
        - vae_time_s(
            spec, decision, cluster, assumptions, vae_mode or vae_matmul(matmul), vae_mfu_range(cluster)[1]
        )
    )
    sharded = assumptions.fsdp_efficiency if decision.sharded else 1.0
    efficiency = small_batch_efficiency(spec, decision.micro_batch, assumptions)
    work = (
        images
        * dit_image_flops(spec, decision)
        / (peak_flops(cluster, matmul, assumptions) * efficiency * sharded)
    )
    if rest <= 0:
        raise PlanError(f"{images_per_s} images/s is faster than the fixed per-step cost alone allows")
    return work / rest


def implied_vae_mfu(
    spec: DiTSpec,
    decision: Decision,
    cluster: Cluster,
    assumptions: Assumptions,
    online_images_per_s: float,
    precomputed_images_per_s: float,
) -> float:
    """The VAE encoder's MFU (at the TF32 peak) implied by one run measured twice, online and with
    precomputed latents: everything else being equal, the difference in step time is the encoder's."""
    global_batch = decision.micro_batch * decision.grad_accum * cluster.world_size
    added_s = global_batch / online_images_per_s - global_batch / precomputed_images_per_s
    if added_s <= 0:
        raise PlanError("online latents measured no slower than precomputed ones: no VAE rate follows")
    online = dataclasses.replace(decision, latents="online")
    return vae_time_s(spec, online, cluster, assumptions, "tf32", 1.0) / added_s


COMM_WARNING_SHARE = 0.25  # exposed communication above this share of the step time gets a plan warning


def communication_warning(
    spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions, throughput: Throughput
) -> str | None:
    """Why a plan estimates few images/s when its step is communication-bound (typically across nodes with a
    small per-GPU batch): the share, the bytes and the bandwidth behind `estimate_throughput`, and the fixes."""
    share = throughput.exposed_comm_time_s / throughput.step_time_s if throughput.step_time_s else 0.0
    if share <= COMM_WARNING_SHARE:
        return None
    busbw = bus_bandwidth(cluster, assumptions)
    if cluster.nodes > 1:
        source, key, example = (
            "inter-node",
            "inter_node_busbw_bytes_per_s",
            " (e.g. 50e9 for 400 Gb/s NDR per GPU)",
        )
    else:
        source, key, example = "intra-node", "intra_node_busbw_bytes_per_s", ""
    if decision.sharding == "ddp":
        collectives = "the fp32 gradient all-reduce, once per optimizer step"
        amortise = (
            "a larger --global-batch (gradient accumulation reaches it where memory is short) spreads the "
            "same bytes over more images"
        )
    else:
        collectives = f"{decision.sharding}'s gathers and reduce-scatters, every micro-step"
        amortise = (
            "a larger micro-batch (fewer accumulation micro-steps) or --sharding ddp where it fits "
            "sends fewer bytes per image"
        )
    return (
        f"exposed communication is {share:.0%} of the estimated step time ({throughput.exposed_comm_time_s * 1e3:.0f} "
        f"of {throughput.step_time_s * 1e3:.0f} ms): each GPU sends {comm_bytes_per_gpu(spec, decision, cluster) / 1e9:.2f} GB "
        f"per step ({collectives}) at an assumed {busbw / 1e9:.0f} GB/s {source} bus bandwidth, "
        f"{assumptions.comm_exposed_fraction:.0%} of it not hidden behind backward; {amortise}, and "
        f"--assume {key}=BYTES_PER_S{example} states the real fabric"
    )


# --- the search --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchSpace:
    """What the user left open. `checkpointing` is "auto", "none", "all" or a block count."""

    global_batch: int
    precision: str  # resolved: bf16 | fp16 | fp32
    latents: str
    ema: bool
    sharding: str = "auto"  # auto | ddp | zero2 | zero3
    checkpointing: str | int = "auto"
    max_micro_batch: int | None = None
    adamw: str = "fused"
    gradient_as_bucket_view: bool = True
    matmul: str | None = None  # bf16 | fp16 | tf32 | ieee-fp32; None: the precision's default (fp32 -> tf32)
    repa: str = ""  # REPA's encoder (planner.repa.ENCODERS); "" without REPA
    repa_projector_dim: int = DEFAULT_PROJECTOR_DIM
    compile: bool = False  # the blocks torch.compile'd: rated at the MFU table's measured speed-up


@dataclass(frozen=True)
class Candidate:
    decision: Decision
    memory: MemoryEstimate
    throughput: Throughput

    @property
    def fits(self) -> bool:
        return self.memory.fits


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_valid_global_batches(global_batch: int, world_size: int) -> tuple[int | None, int]:
    below = (global_batch // world_size) * world_size
    return (below or None), below + world_size


def check_global_batch(global_batch: int, world_size: int) -> None:
    if global_batch % world_size:
        below, above = nearest_valid_global_batches(global_batch, world_size)
        options = f"{below} or {above}" if below else f"{above}"
        raise PlanError(
            f"--global-batch {global_batch} does not divide by the {world_size} GPUs (world size): "
            f"use {options}, or pass --round-global-batch"
        )


def sharding_levels(space: SearchSpace, cluster: Cluster) -> list[str]:
    """Allowed sharding, most sharded first. One GPU has nothing to shard over; hsdp (zero3 inside each node,
    replicated across nodes) is a level only with several nodes of several GPUs. It comes right after zero3:
    the same collectives, the gathers inside the node, so never slower; then zero2 and ddp, each taken only
    where the estimate says it is not slower (across slow links it rarely is)."""
    hsdp_fits = cluster.nodes > 1 and cluster.gpus_per_node > 1
    if space.sharding != "auto":
        if space.sharding not in SHARDINGS:
            raise PlanError(f"--sharding must be auto, {', '.join(SHARDINGS)}, got {space.sharding!r}")
        if space.sharding != "ddp" and cluster.world_size == 1:
            raise PlanError(
                f"--sharding {space.sharding} needs more than one GPU: use --sharding ddp or add --gpus"
            )
        if space.sharding == "hsdp" and not hsdp_fits:
            raise PlanError(
                f"--sharding hsdp shards inside a node and replicates across nodes, but the plan has "
                f"{cluster.nodes} node(s) of {cluster.gpus_per_node} GPU(s): use --sharding zero3 (or zero2), "
                f"or plan several nodes of several GPUs (--nodes N --gpus-per-node G)"
            )
        return [space.sharding]
    if cluster.world_size == 1:
        return ["ddp"]
    return ["zero3", "hsdp", "zero2", "ddp"] if hsdp_fits else ["zero3", "zero2", "ddp"]


def checkpoint_range(space: SearchSpace, spec: DiTSpec) -> tuple[int, int]:
    """(first, last) checkpointed-block counts along the path; first >= last."""
    mode = space.checkpointing
    if mode == "auto":
        return spec.depth, 0
    if mode == "none":
        return 0, 0
    if mode == "all":
        return spec.depth, spec.depth
    if isinstance(mode, int) and 0 <= mode <= spec.depth:
        return mode, mode
    if isinstance(mode, int):
        raise PlanError(
            f"--checkpointing {mode} is outside 0..{spec.depth} (the model's depth): use auto, none, all "
            f"or a block count 0..{spec.depth}"
        )
    raise PlanError(f"--checkpointing must be auto, none, all or a block count 0..{spec.depth}, got {mode!r}")


def micro_batches(space: SearchSpace, cluster: Cluster) -> list[int]:
    check_global_batch(space.global_batch, cluster.world_size)
    per_rank = space.global_batch // cluster.world_size
    options = [b for b in divisors(per_rank) if space.max_micro_batch is None or b <= space.max_micro_batch]
    if not options:
        raise PlanError(f"--max-micro-batch {space.max_micro_batch} is below 1: pass a positive number")
    return options


def evaluate(
    spec, space, cluster, assumptions, budget_bytes, micro_batch, checkpointed, sharding
) -> Candidate:
    per_rank = space.global_batch // cluster.world_size
    decision = Decision(
        micro_batch=micro_batch,
        grad_accum=per_rank // micro_batch,
        checkpointed_blocks=checkpointed,
        precision=space.precision,
        sharding=sharding,
        latents=space.latents,
        ema=space.ema,
        adamw=space.adamw,
        gradient_as_bucket_view=space.gradient_as_bucket_view,
        repa=space.repa,
        repa_projector_dim=space.repa_projector_dim,
    )
    memory = step_memory(spec, decision, cluster, assumptions, budget_bytes)
    return Candidate(
        decision,
        memory,
        estimate_throughput(spec, decision, cluster, assumptions, space.matmul, compiled=space.compile),
    )


def search_path(
    spec: DiTSpec, space: SearchSpace, cluster: Cluster, assumptions: Assumptions, budget_bytes: int
) -> list[Candidate]:
    """The fixed path from the leanest configuration to the richest (see the module docstring)."""
    batches = micro_batches(space, cluster)
    levels = sharding_levels(space, cluster)
    first_ckpt, last_ckpt = checkpoint_range(space, spec)
    state = (0, first_ckpt, 0)  # (micro-batch index, checkpointed blocks, sharding index)

    def at(s):
        return evaluate(spec, space, cluster, assumptions, budget_bytes, batches[s[0]], s[1], levels[s[2]])

    path = [at(state)]
    while True:
        moves = []
        if state[0] + 1 < len(batches):
            moves.append((state[0] + 1, state[1], state[2]))
        if state[1] > last_ckpt:
            moves.append((state[0], state[1] - 1, state[2]))
        if state[2] + 1 < len(levels):
            moves.append((state[0], state[1], state[2] + 1))
        if not moves:
            return path
        current = path[-1]
        best, best_ratio = None, None
        for move in moves:
            candidate = at(move)
            cost = candidate.memory.peak_bytes - current.memory.peak_bytes
            gain = candidate.throughput.images_per_s - current.throughput.images_per_s
            tolerance = REPLICA_TOLERANCE if move[2] != state[2] else 0.0
            if candidate.throughput.images_per_s < current.throughput.images_per_s * (1 - tolerance):
                continue  # never a move the estimate says is slower (replicas: by more than 5%)
            ratio = float("inf") if cost <= 0 else gain / cost
            if best is None or ratio > best_ratio:
                best, best_ratio, state_next = candidate, ratio, move
        if best is None:
            return path  # every remaining move is slower: the furthest point is the fastest
        state = state_next
        path.append(best)


def choose(
    spec: DiTSpec, space: SearchSpace, cluster: Cluster, assumptions: Assumptions, budget_bytes: int
) -> tuple[Candidate, list[Candidate]]:
    """The decision (furthest fitting point of the path) and the path. Raises PlanError if nothing fits."""
    path = search_path(spec, space, cluster, assumptions, budget_bytes)
    fitting = [c for c in path if c.fits]
    if not fitting:
        raise PlanError(nothing_fits_message(spec, space, cluster, assumptions, budget_bytes, path[0]))
    return fitting[-1], path


def alternatives(
    spec: DiTSpec,
    space: SearchSpace,
    cluster: Cluster,
    assumptions: Assumptions,
    budget_bytes: int,
    decision: Decision,
    limit: int = 5,
) -> list[Candidate]:
    """Other fitting configurations worth a look, fastest first: for each sharding level and micro-batch,
    the fewest checkpointed blocks that fit."""
    first_ckpt, last_ckpt = checkpoint_range(space, spec)
    found = []
    for sharding in sharding_levels(space, cluster):
        for micro_batch in micro_batches(space, cluster):
            for checkpointed in range(last_ckpt, first_ckpt + 1):
                candidate = evaluate(
                    spec, space, cluster, assumptions, budget_bytes, micro_batch, checkpointed, sharding
                )
                if candidate.fits:
                    if candidate.decision != decision:
                        found.append(candidate)
                    break
    found.sort(key=lambda c: -c.throughput.images_per_s)
    return found[:limit]


# --- when nothing fits -------------------------------------------------------------------------------


def leanest(
    spec: DiTSpec, space: SearchSpace, cluster: Cluster, assumptions: Assumptions, budget_bytes: int
) -> Candidate:
    """The least memory any configuration needs: zero3 (if several GPUs), micro-batch 1, every block checkpointed."""
    relaxed = dataclasses.replace(space, sharding="auto", checkpointing="all", max_micro_batch=1)
    return search_path(spec, relaxed, cluster, assumptions, budget_bytes)[0]


def nothing_fits_message(spec, space, cluster, assumptions, budget_bytes, lean: Candidate) -> str:
    """One line: the least memory needed, and what would fit (a flag, more GPUs, a larger GPU, a smaller model)."""
    from planner.hardware import gpu_presets
    from planner.spec import PREFIX, SIZES, model_spec
    from planner.units import format_bytes

    def fits(spec_=spec, space_=space, cluster_=cluster, assumptions_=assumptions):
        return leanest(spec_, space_, cluster_, assumptions_, budget_bytes).fits

    need = lean.memory.needed_bytes  # what must fit: the cache released under pressure
    d = lean.decision
    how = f"{d.sharding}, micro-batch {d.micro_batch}, {d.checkpointed_blocks} of {spec.depth} blocks checkpointed"
    message = (
        f"{spec.name} at {spec.resolution} px needs at least {format_bytes(need)} per GPU ({how}) "
        f"but the budget is {format_bytes(budget_bytes)}"
    )
    absolute = leanest(spec, space, cluster, assumptions, budget_bytes)
    if absolute.fits:
        return message + (
            f"; without your --sharding/--checkpointing/--max-micro-batch limits it needs "
            f"{format_bytes(absolute.memory.needed_bytes)}: relax them"
        )
    need = min(need, absolute.memory.needed_bytes)
    ideas = []
    if space.adamw == "foreach" and fits(space_=dataclasses.replace(space, adamw="fused")):
        ideas.append("--adamw fused")
    if (
        not space.gradient_as_bucket_view
        and cluster.world_size > 1
        and fits(space_=dataclasses.replace(space, gradient_as_bucket_view=True))
    ):
        ideas.append("--gradient-as-bucket-view")
    if space.ema and fits(space_=dataclasses.replace(space, ema=False)):
        ideas.append("--no-ema (keep the EMA elsewhere)")
    more = [dataclasses.replace(cluster, gpus_per_node=g) for g in range(cluster.gpus_per_node + 1, 9)]
    more += [dataclasses.replace(cluster, nodes=n) for n in range(cluster.nodes + 1, cluster.nodes * 64 + 1)]
    for bigger in more:
        if space.global_batch % bigger.world_size == 0 and fits(cluster_=bigger):
            # --gpus is the total (planner/cli.py); other node shapes are --nodes N --gpus-per-node G.
            flag = (
                f"--gpus {bigger.world_size}"
                if bigger.nodes == 1 or bigger.gpus_per_node == 8
                else f"--nodes {bigger.nodes} --gpus-per-node {bigger.gpus_per_node}"
            )
            ideas.append(f"{bigger.world_size} GPUs ({flag})")
            break
    headroom_fraction = 1 - budget_bytes / cluster.vram_bytes
    larger = sorted(
        (p for p in gpu_presets().values() if p.memory_bytes * (1 - headroom_fraction) >= need),
        key=lambda p: p.memory_bytes,
    )
    if larger:
        ideas.append(f"a larger GPU (--gpu {larger[0].name}, {format_bytes(larger[0].memory_bytes)})")
    prefix = PREFIX[spec.family] + "-"
    sizes = list(SIZES[spec.family])
    size = spec.name.removeprefix(prefix).split("/")[0] if "custom" not in spec.name else None
    for smaller in reversed(sizes[: sizes.index(size)] if size in sizes else []):
        name = f"{prefix}{smaller}/{spec.patch}"
        if fits(spec_=model_spec(name, spec.resolution, spec.latents)):
            ideas.append(f"a smaller model (--model {name})")
            break
    return (
        message
        + ": use "
        + (", or ".join(ideas) if ideas else "more or larger GPUs, or a smaller model or resolution")
    )
