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

    def matmul_peak_flops(self, precision: str) -> float:
        """The rate the training matmuls run at: bf16/fp16 tensor cores, or TF32 (else plain fp32) for fp32."""
        if precision == "fp32":
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
        )
    return presets


def gpu_preset(name: str) -> GPUPreset:
    """A preset by name or alias, case-insensitively; unknown names suggest the closest known one."""
    key = name.strip().lower()
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
    cublas_workspace_bytes: int = (
        64 * MiB
    )  # PyTorch's default CUBLAS_WORKSPACE_CONFIG :4096:8 (32 MiB) + cuBLASLt
    nccl_buffer_bytes: int = 512 * MiB  # per rank when world_size > 1: NCCL_BUFFSIZE 4 MiB x channels x peers
    fragmentation: float = (
        0.05  # caching allocator: reserved beyond allocated, as a fraction of allocated at the peak
    )
    # --- how the trainer runs the step (the plan records these, the trainer follows them) ------------
    autocast_device: str = "cuda"  # "cuda" | "cpu": whose autocast op lists decide the saved dtypes
    attention: str = (
        "fused"  # "fused" (SDPA flash/efficient kernels) | "math" (keeps the softmax: e*heads*s^2*b)
    )
    loss_tensors: float = (
        15.25  # output-sized fp32 tensors alive while the learned-sigma loss is computed (traced:
    )
    #                               30 latent-sized ones and the two edge-bin masks of the discretised Gaussian)
    vae_params: int = 83_653_863  # the whole SD AutoencoderKL as pipelines load it (encoder 34,163,664)
    vae_bytes_per_param: int = (
        4  # the VAE stays fp32: latents are encoded once, precision matters more than speed
    )
    vae_activation_maps: float = (
        5.0  # encoder peak, in full-resolution 128-channel maps per image (traced; planner/vae.py)
    )
    # --- throughput ----------------------------------------------------------------------------------
    mfu_mixed: float = 0.33  # bf16/fp16: fast-DiT's README, 107 img/s on one A100 at batch 128, checkpointed
    mfu_fp32: float = 0.125  # TF32: the DiT repository's train.py, 26 img/s per A100 at micro-batch 32
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
        return self.mfu_fp32 if precision == "fp32" else self.mfu_mixed

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise PlanError(f"--assume {f.name}={value} must not be negative")
        for name in ("fragmentation", "comm_exposed_fraction"):
            if not 0 <= getattr(self, name) < 1:
                raise PlanError(f"--assume {name} must be a fraction in [0, 1), got {getattr(self, name)}")
        for name in ("mfu_mixed", "mfu_fp32", "fsdp_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise PlanError(f"--assume {name} must be in (0, 1], got {getattr(self, name)}")
        if self.autocast_device not in ("cuda", "cpu"):
            raise PlanError(f"--assume autocast_device must be cuda or cpu, got {self.autocast_device!r}")
        if self.attention not in ("fused", "math"):
            raise PlanError(f"--assume attention must be fused or math, got {self.attention!r}")


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
