"""What the planner assumes about the machine: GPU presets (from vendor datasheets) and every other constant.

Nothing here is measured by the planner. Each constant is named, has a source or a reason, and can be
overridden (`dit-plan --assume NAME=VALUE`, or a calibration file measured on the real GPU via
`Assumptions.calibrated`), so a plan can be tightened with measurements without touching the code.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass
from importlib import resources

import yaml

from planner.errors import PlanError

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class GPUPreset:
    """One GPU model. Peaks are dense tensor-core FLOP/s; None where the GPU lacks the format."""

    name: str
    description: str
    memory_bytes: int
    bf16: bool
    peak_flops: dict  # precision ("bf16", "fp16", "tf32", "fp32") -> FLOP/s or None
    intra_node_busbw_bytes_per_s: float
    source: str
    aliases: tuple = ()
    family: str = "other"  # ampere | ada | hopper | other: whose measured MFU applies (presets/mfu.yaml)
    memory_bandwidth_bytes_per_s: float = 0.0  # HBM/GDDR bandwidth (datasheet): the per-step fixed cost

    def matmul_peak_flops(self, precision: str) -> float:
        """The rate the training matmuls run at: bf16/fp16 tensor cores; "tf32" the TF32 rate; "fp32" (the
        storage precision, as plan.json names it) TF32 where the GPU has it, else plain fp32; "ieee-fp32"
        plain fp32."""
        if precision == "ieee-fp32":
            return self.peak_flops["fp32"]
        if precision in ("fp32", "tf32"):
            return self.peak_flops.get("tf32") or self.peak_flops["fp32"]
        rate = self.peak_flops.get(precision)
        if not rate:
            raise PlanError(
                f"--gpu {self.name} has no {precision} tensor cores: use --precision fp16 or fp32"
            )
        return rate


@functools.lru_cache(maxsize=1)
def gpu_presets() -> dict[str, GPUPreset]:
    """The shipped presets (planner/presets/gpus.yaml), keyed by canonical name."""
    text = resources.files("planner").joinpath("presets/gpus.yaml").read_text()
    presets = {}
    for name, entry in yaml.safe_load(text).items():
        presets[name] = GPUPreset(
            name=name,
            description=entry["description"],
            memory_bytes=int(entry["memory_mib"]) * MiB,
            bf16=bool(entry["bf16"]),
            peak_flops={
                k: (float(v) * 1e12 if v is not None else None) for k, v in entry["peak_tflops"].items()
            },
            intra_node_busbw_bytes_per_s=float(entry["intra_node_busbw_gbps"]) * 1e9,
            source=entry["source"],
            aliases=tuple(str(alias) for alias in entry.get("aliases", ())),
            family=str(entry.get("family", "other")),
            memory_bandwidth_bytes_per_s=float(entry.get("memory_gbps", 0)) * 1e9,
        )
    return presets


# --- measured MFU by GPU family and matmul precision (presets/mfu.yaml) -----------------------------

MATMUL_MODES = ("mixed", "tf32", "fp32")  # bf16/fp16 tensor cores | TF32 tensor cores | IEEE fp32
# the table's modes: the DiT's matmuls in each matmul mode, and the VAE encoder's fp32 convolutions (cuDNN),
# rated apart because they run at neither the DiT's rate nor its efficiency
TABLE_MODES = (*MATMUL_MODES, "vae")


@dataclass(frozen=True)
class MFUEntry:
    """The MFU a family reaches in one matmul mode: a point value and a low-high range, and where from."""

    family: str  # the family (or the GPU, e.g. h200) the figures were measured on, after any fallback
    mode: str
    low: float
    point: float
    high: float
    source: str
    fallback: str | None = None  # why another family's or mode's figures stand in, if they do
    # how much faster the step runs with its blocks compiled (torch.compile, dit_accel.models.compile) than eager,
    # which every figure is: measured on this family in this mode, else 1 (no credit without a measurement)
    compiled_speedup: float = 1.0


@functools.lru_cache(maxsize=1)
def mfu_table() -> dict:
    """presets/mfu.yaml: {family: {mode: entry dict}} (entries may say `fallback: FAMILY/MODE`)."""
    text = resources.files("planner").joinpath("presets/mfu.yaml").read_text()
    return yaml.safe_load(text)


def matmul_mode(precision: str) -> str:
    """The MFU table's mode of a matmul precision: bf16/fp16 -> mixed; tf32; ieee-fp32 -> fp32."""
    if precision in ("bf16", "fp16"):
        return "mixed"
    if precision in ("tf32", "fp32"):
        return "tf32"
    if precision == "ieee-fp32":
        return "fp32"
    raise PlanError(f"unknown matmul precision {precision!r}: expected bf16, fp16, tf32 or ieee-fp32")


def mfu_entry(family: str | None, mode: str, gpu: str | None = None) -> MFUEntry:
    """The measured MFU of `family` in `mode`, following the table's fallbacks (unknown family: ampere); a
    GPU the table lists by its own preset name (`gpu`) takes its own entry for the mode first."""
    if mode not in TABLE_MODES:
        raise PlanError(f"unknown matmul mode {mode!r}: expected {', '.join(TABLE_MODES)}")
    table = mfu_table()
    if gpu in table and mode in table[gpu]:
        asked, reasons = gpu, []
    else:
        asked = family if family in table else "ampere"
        reasons = [] if family in table else [f"no figures for {family or 'an unnamed GPU'}: ampere's"]
    key = (asked, mode)
    for _ in range(len(table) * len(TABLE_MODES)):
        entry = table[key[0]][key[1]]
        if "fallback" not in entry:
            return MFUEntry(
                family=key[0],
                mode=key[1],
                low=float(entry["low"]),
                point=float(entry["point"]),
                high=float(entry["high"]),
                source=str(entry["source"]),
                fallback="; ".join(reasons) or None,
                compiled_speedup=float(entry.get("compiled_speedup", 1.0)),
            )
        reasons.append(f"{key[0]} {key[1]}: no public figure, {entry['fallback']}'s")
        target_family, target_mode = entry["fallback"].split("/")
        key = (target_family, target_mode)
    raise PlanError(f"presets/mfu.yaml: the fallbacks of {family}/{mode} go round in a circle")


# A name that is more than one card: the memory differs, so the planner will not pick one silently.
AMBIGUOUS_GPUS = {"a100": ("a100-40g", "a100-80g"), "v100": ("v100-16g", "v100-32g")}
# Accelerators dit-plan has no presets for: say so rather than suggest a near-miss NVIDIA name.
UNSUPPORTED_GPUS = (
    "mi100",
    "mi210",
    "mi250",
    "mi250x",
    "mi300",
    "mi300a",
    "mi300x",
    "mi325x",
    "gaudi",
    "tpu",
)


def gpu_preset(name: str) -> GPUPreset:
    """A preset by name or alias, case-insensitively; unknown names suggest the closest known one."""
    key = name.strip().lower()
    if key in AMBIGUOUS_GPUS:
        raise PlanError(
            f"--gpu {name} is ambiguous: the {' and '.join(AMBIGUOUS_GPUS[key])} differ in memory",
            f"pass --gpu {' or --gpu '.join(AMBIGUOUS_GPUS[key])}",
        )
    if key.removeprefix("amd-").removeprefix("instinct-") in UNSUPPORTED_GPUS:
        raise PlanError(
            f"--gpu {name} has no preset: dit-plan's presets and MFU table are NVIDIA GPUs only",
            "plan by memory alone with --vram SIZE (and --assume mfu_mixed=... for the throughput)",
        )
    presets = gpu_presets()
    for preset in presets.values():
        if key == preset.name or key in preset.aliases:
            return preset
    known = list(presets)
    close = difflib.get_close_matches(
        key, known + [a for p in presets.values() for a in p.aliases], n=1, cutoff=0.4
    )
    hint = ""
    if close:
        match = next(p.name for p in presets.values() if close[0] == p.name or close[0] in p.aliases)
        hint = f"did you mean {match}? "
    raise PlanError(
        f"unknown --gpu {name!r}: {hint}known GPUs are {', '.join(known)} (or give --vram instead)"
    )


@dataclass(frozen=True)
class Assumptions:
    """Every constant the estimate rests on that the architecture does not determine.

    Bytes are per GPU unless the name says per rank or per node. `docs/planner.md` lists each with its source.
    """

    # --- fixed device memory outside PyTorch's caching allocator --------------------------------------
    cuda_context_bytes: int = (
        512 * MiB
    )  # CUDA context + kernels, lazy module loading: 0.3-1 GB by GPU and CUDA version
    # held inside the caching allocator: PyTorch allocates cuBLAS/cuBLASLt workspaces through it
    cublas_workspace_bytes: int = (
        64 * MiB
    )  # PyTorch's default CUBLAS_WORKSPACE_CONFIG :4096:8 (32 MiB) + cuBLASLt
    nccl_buffer_bytes: int = 512 * MiB  # per rank when world_size > 1: NCCL_BUFFSIZE 4 MiB x channels x peers
    # --- PyTorch's caching allocator: reserved beyond allocated (planner/allocator.py) -----------------
    # "expandable": PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which the trainer sets on CUDA unless the
    # user set that variable; "fixed": PyTorch's default segments (a run launched with its own allocator config)
    allocator_segments: str = "expandable"
    fragmentation: float = (
        0.0  # 0 = the allocator model; > 0: measured reserved / allocated - 1 (calibration)
    )
    # "eager": AdamW's state made before the first step (dit-accel's trainer, and any resumed run); "lazy":
    # made inside the first optimizer step, torch's default (other codebases: DiT, fast-DiT), which with
    # online latents costs a re-map at the second encode (planner/allocator.py `online_reserved_bytes`)
    adamw_state: str = "eager"
    # parameter-sized fp32 intermediates torch's foreach AdamW holds at its update: 1 since torch 2.1
    # (pytorch/pytorch#104780 divides and shifts sqrt(v) in place); 2 in torch 2.0 and before, whose
    # denominator was a second list beside sqrt(v) (pytorch/pytorch#97712): the 2023 codebases fast-DiT ran on
    foreach_adamw_lists: int = 1
    # what zero_grad leaves between steps: "none" (set_to_none=True, the default since torch 2.0, and this
    # trainer's: a gradient exists from its backward to the optimizer step) or "zeros" (set_to_none=False,
    # torch 1.13's default, which fast-DiT's May 2023 runs had: every gradient lives through the whole step)
    zero_grad: str = "none"
    # --- how the trainer runs the step (the plan records these, the trainer follows them) ------------
    autocast_device: str = "cuda"  # "cuda" | "cpu": whose autocast op lists decide the saved dtypes
    attention: str = (
        "fused"  # "fused" (SDPA flash/efficient kernels) | "math" (keeps the softmax: e*heads*s^2*b)
    )
    loss_tensors: float = (
        15.25  # output-sized fp32 tensors alive while the learned-sigma loss is computed (traced:
    )
    #                               30 latent-sized ones and the two edge-bin masks of the discretised Gaussian)
    mse_loss_tensors: float = 4.0  # without a learned sigma (LightningDiT's flow loss): the velocity in fp32,
    #                               the target, their difference and its square (traced; the cosine term adds two)
    vae_params: int = 83_653_863  # the whole SD AutoencoderKL as pipelines load it (encoder 34,163,664)
    vae_bytes_per_param: int = (
        4  # the VAE stays fp32: latents are encoded once, precision matters more than speed
    )
    vae_activation_maps: float = (
        5.0  # encoder peak, in full-resolution 128-channel maps per image (traced; planner/vae.py)
    )
    # --- throughput ----------------------------------------------------------------------------------
    mfu_mixed: float = 0.0  # bf16/fp16 MFU; 0 = the measured table (presets/mfu.yaml) for the GPU's family
    mfu_fp32: float = 0.0  # fp32-storage plans (tf32 and fp32 matmuls); 0 = the table
    # bytes each step moves per parameter beside the matmuls: fused AdamW reads p, g, m, v and writes p, m, v
    # (28 B), the fp32 EMA reads two and writes one (12 B)
    step_fixed_bytes_per_param: float = 40.0
    step_fixed_overhead_s: float = 0.003  # per optimizer step: kernel launches, zero_grad, the host loop
    default_memory_bandwidth_bytes_per_s: float = 1.555e12  # when only --vram is known: A100 40GB
    half_efficiency_tokens: int = (
        512  # micro-batch x tokens at which matmuls run at half their saturated rate
    )
    comm_exposed_fraction: float = 0.3  # share of gradient/parameter traffic not hidden behind compute
    fsdp_efficiency: float = 0.95  # FSDP's per-unit gather/launch latency beyond bandwidth (zero2/zero3)
    inter_node_busbw_bytes_per_s: float = 25e9  # one 200 Gb/s NIC per GPU (InfiniBand HDR / RoCE)
    intra_node_busbw_bytes_per_s: float = 0.0  # 0 = the GPU preset's figure (or 100 GB/s with --vram alone)
    default_peak_flops: float = 312e12  # used for ranking when only --vram is known: A100 dense bf16
    # --- host memory per rank (the exitcode -9 estimate) ---------------------------------------------
    host_process_bytes: int = 3 * GiB  # python + torch + CUDA libraries resident per rank
    loader_workers: int = 4  # DataLoader workers per rank: the trainer's --num-workers default
    loader_worker_bytes: int = 512 * MiB  # resident set of one worker process beyond shared pages
    prefetch_factor: int = 2  # batches each worker keeps ready (PyTorch's default)
    pinned_batches: int = 2  # pin_memory copies in flight
    # an image folder (online or pixel latents) of ImageNet's size, 1.28M files (benchmarks/folder_listing_scale.py):
    folder_index_bytes: int = (
        64 * MiB
    )  # its listing as each rank maps it (RUN/data_index, 50 MB, shared pages)
    folder_listing_bytes: int = 400 * MiB  # the main process's peak while it lists the folder, once per job
    dataset_row_bytes: int = 16  # a Hugging Face dataset's row and label indices (int64 each) a rank holds

    def replace(self, **changes) -> Assumptions:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise PlanError(
                f"unknown assumption(s) {sorted(unknown)}: known are {', '.join(assumption_names())}"
            )
        updated = dataclasses.replace(self, **changes)
        updated.validate()
        return updated

    def calibrated(self, measured: dict) -> Assumptions:
        """The hook for measured figures (a calibration file): only the CALIBRATABLE constants may change."""
        unknown = set(measured) - set(CALIBRATABLE)
        if unknown:
            raise PlanError(
                f"calibration sets {sorted(unknown)}, which are not measurable: use {', '.join(CALIBRATABLE)}"
            )
        return self.replace(**measured)

    def mfu(self, precision: str) -> float:
        """The overriding MFU (--assume or a calibration) for a precision; 0 = use the measured table."""
        return self.mfu_mixed if precision in ("bf16", "fp16") else self.mfu_fp32

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise PlanError(f"--assume {f.name}={value} must not be negative")
        for name in ("fragmentation", "comm_exposed_fraction"):
            if not 0 <= getattr(self, name) < 1:
                raise PlanError(f"--assume {name} must be a fraction in [0, 1), got {getattr(self, name)}")
        for name in ("mfu_mixed", "mfu_fp32"):
            if not 0 <= getattr(self, name) <= 1:
                raise PlanError(
                    f"--assume {name} must be in (0, 1] (0 = the measured table), got {getattr(self, name)}"
                )
        if not 0 < self.fsdp_efficiency <= 1:
            raise PlanError(f"--assume fsdp_efficiency must be in (0, 1], got {self.fsdp_efficiency}")
        if self.autocast_device not in ("cuda", "cpu"):
            raise PlanError(f"--assume autocast_device must be cuda or cpu, got {self.autocast_device!r}")
        if self.allocator_segments not in ("expandable", "fixed"):
            raise PlanError(
                f"--assume allocator_segments must be expandable or fixed, got {self.allocator_segments!r}"
            )
        if self.adamw_state not in ("eager", "lazy"):
            raise PlanError(f"--assume adamw_state must be eager or lazy, got {self.adamw_state!r}")
        if self.foreach_adamw_lists not in (1, 2):
            raise PlanError(
                "--assume foreach_adamw_lists must be 1 (torch >= 2.1) or 2 (torch 2.0), "
                f"got {self.foreach_adamw_lists!r}"
            )
        if self.attention not in ("fused", "math"):
            raise PlanError(f"--assume attention must be fused or math, got {self.attention!r}")
        if self.zero_grad not in ("none", "zeros"):
            raise PlanError(
                f"--assume zero_grad must be none (set_to_none=True) or zeros (torch <= 1.13), got {self.zero_grad!r}"
            )


# What a calibration run on the real GPU can measure and replace.
CALIBRATABLE = (
    "cuda_context_bytes",
    "cublas_workspace_bytes",
    "nccl_buffer_bytes",
    "fragmentation",
    "mfu_mixed",
    "mfu_fp32",
    "half_efficiency_tokens",
    "intra_node_busbw_bytes_per_s",
    "inter_node_busbw_bytes_per_s",
)


def assumption_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Assumptions)]


def assumption_types() -> dict[str, type]:
    return {f.name: type(f.default) for f in dataclasses.fields(Assumptions)}
