"""The training loop: `accelerate launch --config_file PLAN/accelerate_config.yaml -m dit_accel.train ...`.

Reads top to bottom: the plan and its checks, the data order, the components (model, EMA, optimizer, lr
schedule, objective), one micro-step, one optimizer step, the loop, `main`.

Two rules make runs reproducible and resumable bit for bit:
- Every random choice about a sample (its timestep, noise, class dropout, VAE posterior draw and its
  augmentation) is a function of (seed, sample number) alone, where sample number = step * global_batch +
  position in the step's window. So a run resumed at step k draws exactly what the straight run drew, and
  2 processes x micro 2 x accum 2 see the very same samples, noise and timesteps as 1 process x micro 8.
- The data order is a function of (seed, epoch): a seeded permutation per epoch cut into windows of one
  global batch; the last partial window of an epoch is dropped. The data position is the step counter.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dit_accel import checkpoint as ckpt
from dit_accel.atomic import write_json_atomically
from dit_accel.ema import EMA
from dit_accel.errors import UserError, exits_cleanly
from dit_accel.optim import build_optimizer, build_scheduler, effective_lr
from dit_accel.train_config import DEFAULT_NUM_WORKERS, TrainConfig, parse_config, save_config

KNOWN_PLAN_SCHEMAS = ("dit-plan/1",)
PRECISION_TO_ACCELERATE = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
INJECT_NAN_ENV = "DIT_ACCEL_INJECT_NAN"  # testing only: "STEP" or "STEP:RANK" poisons that step's loss
CRASH_BEFORE_COMMIT_ENV = "DIT_ACCEL_CRASH_BEFORE_COMMIT"  # testing only: "STEP" kills the process mid-checkpoint
EXIT_STOPPED = 3  # the run stopped itself (NaN/Inf); distinct from 2, bad input

log = logging.getLogger("dit_accel.train")
log.addHandler(logging.NullHandler())  # before setup_logging: silent, not Python's stderr fallback


class TrainingStopped(Exception):
    """The run refused to go on (a non-finite step under --nan-policy abort); the message says how to resume."""


# --- the plan ---------------------------------------------------------------------------------------------


def read_plan(path: str | Path) -> dict:
    """plan.json, checked for the keys the trainer relies on (DESIGN.md, "plan.json")."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan {path} not found: make one with `dit-plan --gpus N --vram SIZE --out DIR` and pass DIR/plan.json")
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"plan {path} is not valid JSON ({error.msg} at line {error.lineno}): re-create it with dit-plan")
    schema = plan.get("schema") if isinstance(plan, dict) else None
    if schema not in KNOWN_PLAN_SCHEMAS:
        raise UserError(f"plan {path} has schema {schema!r} but this trainer reads {', '.join(KNOWN_PLAN_SCHEMAS)}: "
                        f"re-plan with the dit-plan of this dit-accel version")
    for section, keys in {"model": ("name", "resolution"), "cluster": ("world_size",),
                          "decision": ("micro_batch", "grad_accum", "checkpointed_blocks", "precision", "latents")}.items():
        missing = [key for key in keys if key not in plan.get(section, {})]
        if missing:
            raise UserError(f"plan {path} lacks {section}.{missing[0]}: re-create it with dit-plan")
    decision = plan["decision"]
    if plan.get("global_batch") != decision["micro_batch"] * decision["grad_accum"] * plan["cluster"]["world_size"]:
        raise UserError(f"plan {path}: global_batch {plan.get('global_batch')} != micro_batch x grad_accum x world_size; "
                        f"re-create it with dit-plan")
    return plan


def spec_from_plan(plan: dict):
    """The DiTSpec the plan was made for: a family member by name, with the plan's overrides (custom sizes)."""
    from planner.spec import custom_spec, model_spec

    model, inputs, latents = plan["model"], plan.get("inputs", {}), plan["decision"]["latents"]
    if all(key in model for key in ("depth", "hidden", "heads", "patch")):
        return custom_spec(depth=model["depth"], hidden=model["hidden"], heads=model["heads"], patch=model["patch"],
                           resolution=model["resolution"], latents=latents,
                           num_classes=model.get("num_classes", inputs.get("num_classes") or 1000),
                           name=model["name"])
    overrides = {key: inputs.get(key) for key in ("depth", "hidden", "heads", "num_classes") if inputs.get(key)}
    name = inputs.get("model") or model["name"].removesuffix("-custom")
    return model_spec(name, model["resolution"], latents, **overrides)


def check_launch(plan: dict, world_size: int, plan_path: str) -> None:
    planned = plan["cluster"]["world_size"]
    if planned != world_size:
        raise UserError(f"{plan_path} is planned for {planned} processes but {world_size} were launched: re-plan with "
                        f"`dit-plan --gpus {world_size}`, or launch {planned} processes")


def check_data_mode(plan: dict, config: TrainConfig) -> None:
    """The data the user passed must be what the plan's latent mode expects."""
    mode = plan["decision"]["latents"]
    if mode == "precomputed" and not config.latents:
        raise UserError("the plan trains on precomputed latents: pass --latents DIR (from `dit-accel extract-latents`), "
                        "or re-plan with `dit-plan --latents online` / `--latents pixel` for an image folder")
    if mode in ("online", "pixel") and not config.data_path:
        raise UserError(f"the plan trains on {'images encoded online' if mode == 'online' else 'pixels'}: pass --data-path "
                        f"DIR, or re-plan with `dit-plan --latents precomputed` to train on --latents")
    if mode == "online" and not config.vae:
        raise UserError("the plan encodes images online with a VAE: pass --vae DIR (a diffusers AutoencoderKL folder), "
                        "or precompute latents with `dit-accel extract-latents` and re-plan with --latents precomputed")
    if mode != "online" and config.vae:
        raise UserError(f"--vae is only used when the plan encodes online, but this plan's latents are {mode!r}: drop --vae")


# --- sharded plans (FSDP2) ---------------------------------------------------------------------------------

RESHARD_AFTER_FORWARD = {"zero2": False, "zero3": True}  # FSDP2's switch between SHARD_GRAD_OP and FULL_SHARD


def fsdp_plugin_for(plan: dict, plan_path: str):
    """The launcher's FSDP settings (accelerate_config.yaml, exported as FSDP_* variables) checked against the
    plan; None for a DDP plan. Auto-wrap is switched off: `shard_blocks` makes the per-block units itself."""
    sharding = plan["decision"].get("sharding", "ddp")
    launched_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    remake = f"launch with the accelerate_config.yaml that dit-plan wrote next to {plan_path}"
    if sharding == "ddp":
        if launched_fsdp:
            raise UserError(f"{plan_path} replicates the model (ddp) but accelerate was launched with FSDP: {remake}")
        return None
    if sharding not in RESHARD_AFTER_FORWARD:
        raise UserError(f"unknown sharding {sharding!r} in {plan_path}: expected ddp, zero2 or zero3; re-plan")
    if not launched_fsdp:
        raise UserError(f"{plan_path} shards the model ({sharding}) but accelerate was launched without FSDP: {remake}")
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":  # checked first: FSDP1's plugin asks for a GPU before anything else on a CPU machine
        raise UserError(f"the launch config does not match {plan_path}: fsdp_version is {version}, this trainer "
                        f"shards with FSDP2 (fsdp_version: 2); {remake}")
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # every field from the launcher's FSDP_* environment
    wanted = RESHARD_AFTER_FORWARD[sharding]
    problems = [
        (plugin.reshard_after_forward != wanted,
         f"fsdp_reshard_after_forward is {plugin.reshard_after_forward}, the plan's {sharding} needs {wanted}"),
        (bool(plugin.activation_checkpointing), "fsdp_activation_checkpointing is on (it checkpoints every block; the "
                                                "trainer checkpoints the plan's blocks itself)"),
        (bool(plugin.cpu_ram_efficient_loading), "fsdp_cpu_ram_efficient_loading is on (every rank builds the same "
                                                 "weights from the seed instead)"),
        (os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true", "fsdp_offload_params is on (the plan keeps "
                                                                            "parameters on the GPU)"),
        (str(plugin.state_dict_type).rsplit(".", 1)[-1] != "SHARDED_STATE_DICT",
         f"fsdp_state_dict_type is {plugin.state_dict_type}, checkpoints are written sharded (SHARDED_STATE_DICT)"),
    ]
    for failed, message in problems:
        if failed:
            raise UserError(f"the launch config does not match {plan_path}: {message}; {remake}")
    plugin.auto_wrap_policy = None
    return plugin


def use_fsdp_on_cpu(accelerator, plugin, mixed_precision: str) -> None:
    """Switch a CPU Accelerator to FSDP, which accelerate 1.15 never does by itself.

    AcceleratorState turns a launch into FSDP only inside its GPU-family branch (MULTI_GPU, MULTI_XPU, ...); a
    `cpu=True` state is MULTI_CPU and would silently wrap the model in DDP instead. (FSDP1 fails earlier still:
    its plugin with sync_module_states asks for a GPU's current_device.) torch's `fully_shard` itself runs on a
    CPU mesh over gloo, so here the state is set to FSDP by hand, and from then on accelerate's own FSDP2 code
    (prepare, gradient clipping, sync, save_state/load_state) runs exactly as on GPUs: that is what the CPU
    tests exercise. Nothing else changes: the device stays the CPU and the process group gloo.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # what AcceleratorState does for GPU launches
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def uses_fsdp(accelerator) -> bool:
    if accelerator is None:
        return False
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def shard_blocks(model: nn.Module, plugin) -> None:
    """One FSDP2 unit per transformer block, holding the block's own layers but NOT its conditioning embedder.

    Every block's `norm1.emb` is the same CombinedTimestepLabelEmbeddings, and a parameter that two FSDP units
    see is an error; `fully_shard` on a list of modules makes them one unit (one all-gather, one
    reduce-scatter per block, as the planner counts), so each block's unit is its layers minus the embedder,
    and the embedder, patch embedding and final layer stay in the root unit that `accelerator.prepare` adds.
    Activation checkpointing (set_checkpointed_blocks) wraps the block's forward, outside these units: the
    recompute in backward runs the units' hooks again and gathers their parameters as the first pass did.
    """
    import warnings

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # torch warns that a unit "returned a view tensor" because nn.Linear on (batch, tokens, width) returns
    # one; only an in-place op on it would skip the unit's backward hook, and diffusers' block uses none
    # (tests/test_train_fsdp.py holds zero2 and zero3 equal to the DDP update).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    kwargs = {"reshard_after_forward": plugin.reshard_after_forward,
              "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
    for block in model.transformer_blocks:
        embedder = block.norm1.emb
        layers = [module for module in _children_without(block, embedder) if any(True for _ in module.parameters())]
        fully_shard(layers, **kwargs)


def _children_without(module: nn.Module, excluded: nn.Module) -> list[nn.Module]:
    """The smallest set of submodules that covers `module` except `excluded` (and its own submodules)."""
    covering = []
    for child in module.children():
        if child is excluded:
            continue
        if any(sub is excluded for sub in child.modules()):
            covering.extend(_children_without(child, excluded))
            if any(True for _ in child.parameters(recurse=False)):
                raise ValueError(f"{type(child).__name__} holds parameters beside the shared embedder")
        else:
            covering.append(child)
    return covering


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective for a DTensor (every rank must call it), the tensor itself otherwise."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def set_tf32(enabled: bool, device: torch.device) -> bool:
    """TF32 matmuls and convolutions on CUDA, as the DiT recipe trains and the planner rates fp32 (TF32 peak).
    Returns whether TF32 is on; always False off CUDA, where the switch means nothing."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


# --- the data order and per-sample randomness --------------------------------------------------------------


def sample_seed(seed: int, sample_number: int) -> int:
    """A 63-bit seed for one sample, well mixed (SeedSequence), from the run seed and the sample number."""
    return int(np.random.SeedSequence([seed, sample_number]).generate_state(1, np.uint64)[0] >> 1)


@dataclass(frozen=True)
class SampleOrder:
    """Which dataset items each rank reads at each micro-step. A pure function of (seed, step), so the
    data position of a run is its step counter and nothing else needs saving to resume exactly."""

    dataset_size: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    world_size: int
    seed: int

    def __post_init__(self):
        if self.micro_batch * self.grad_accum * self.world_size != self.global_batch:
            raise ValueError("global_batch must equal micro_batch * grad_accum * world_size")
        if self.dataset_size < self.global_batch:
            raise UserError(f"the dataset has {self.dataset_size} samples, fewer than one global batch of "
                            f"{self.global_batch}: add data or re-plan with a smaller --global-batch")

    @property
    def steps_per_epoch(self) -> int:
        """Full windows only: the last partial window of an epoch is dropped, never padded."""
        return self.dataset_size // self.global_batch

    def epoch_and_offset(self, step: int) -> tuple[int, int]:
        """(epoch, samples into that epoch) before optimizer step `step` (0-based) is taken."""
        return step // self.steps_per_epoch, (step % self.steps_per_epoch) * self.global_batch

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def micro_batch_items(self, step: int, micro_step: int, rank: int, permutation: np.ndarray | None = None):
        """[(dataset_index, sample_number)] for one rank's micro-batch. Rank-major layout of the window:
        rank r owns positions [r * grad_accum * micro_batch, (r + 1) * grad_accum * micro_batch)."""
        epoch, offset = self.epoch_and_offset(step)
        permutation = self.permutation(epoch) if permutation is None else permutation
        first = (rank * self.grad_accum + micro_step) * self.micro_batch
        return [(int(permutation[offset + position]), step * self.global_batch + position)
                for position in range(first, first + self.micro_batch)]

    def batches(self, start_step: int, rank: int):
        """Every micro-batch of this rank from `start_step` on, forever, in order."""
        step, epoch, permutation = start_step, None, None
        while True:
            if self.epoch_and_offset(step)[0] != epoch:
                epoch = self.epoch_and_offset(step)[0]
                permutation = self.permutation(epoch)
            for micro_step in range(self.grad_accum):
                yield self.micro_batch_items(step, micro_step, rank, permutation)
            step += 1


class OrderedBatches(torch.utils.data.Sampler):
    """SampleOrder as a DataLoader batch_sampler, starting at the resumed step."""

    def __init__(self, order: SampleOrder, start_step: int, rank: int):
        self.order, self.start_step, self.rank = order, start_step, rank

    def __iter__(self):
        return self.order.batches(self.start_step, self.rank)


@contextlib.contextmanager
def seeded_global_rngs(seed: int):
    """Seed python/numpy/torch RNGs for one sample's augmentation, then put the previous states back, so a
    dataset's own `random.random() < 0.5` flip is a function of the sample, in a worker or not."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class KeyedSamples(torch.utils.data.Dataset):
    """Wraps a dataset so item (index, sample_number) is read with that sample's own RNG seed."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, sample_number = key
        with seeded_global_rngs(sample_seed(self.seed, sample_number) ^ 0x5EED):
            item = self.dataset[index]
        return item, sample_number


@dataclass
class SampleNoise:
    """Draws a micro-batch's diffusion randomness from each sample's own generator (see module docstring)."""

    seed: int
    num_timesteps: int
    noise_shape: tuple[int, ...]
    class_dropout: float
    posterior_shape: tuple[int, ...] | None = None  # online VAE: the posterior sample's noise

    def __call__(self, sample_numbers: list[int]) -> dict[str, torch.Tensor]:
        timesteps, noises, drops, posteriors = [], [], [], []
        for number in sample_numbers:
            generator = torch.Generator().manual_seed(sample_seed(self.seed, number))
            timesteps.append(torch.randint(0, self.num_timesteps, (), generator=generator))
            noises.append(torch.randn(self.noise_shape, generator=generator))
            drops.append(torch.rand((), generator=generator) < self.class_dropout)
            if self.posterior_shape is not None:
                posteriors.append(torch.randn(self.posterior_shape, generator=generator))
        out = {"t": torch.stack(timesteps), "noise": torch.stack(noises), "drop": torch.stack(drops)}
        if posteriors:
            out["posterior_noise"] = torch.stack(posteriors)
        return out


class Collate:
    """Stacks (x, label) items and adds each sample's randomness; runs in the DataLoader workers."""

    def __init__(self, noise: SampleNoise):
        self.noise = noise

    def __call__(self, items):
        xs, labels, numbers = [], [], []
        for item, number in items:
            x, label = _unpack_item(item)
            xs.append(torch.as_tensor(x))
            labels.append(int(label))
            numbers.append(number)
        batch = {"x": torch.stack(xs), "y": torch.tensor(labels, dtype=torch.long),
                 "sample_number": torch.tensor(numbers, dtype=torch.long)}
        batch.update(self.noise(numbers))
        return batch


def _unpack_item(item):
    if isinstance(item, dict):
        x = next(item[key] for key in ("latent", "latents", "image", "pixel_values", "x") if key in item)
        label = next(item[key] for key in ("label", "class_label", "y", "labels") if key in item)
        return x, label
    return item[0], item[1]


# --- initial weights of a fine-tuning run (--init-from) -----------------------------------------------------


@dataclass
class InitWeights:
    """Weights a NEW run starts from: the parameters by name and the timestep shift they were trained with
    (0 for weights that began as an original DiT checkpoint; see docs/model.md, "The shift rule")."""

    parameters: dict[str, torch.Tensor]
    timestep_freq_shift: int
    source: str  # where they came from: for the log and train_state.json


def read_init_weights(path: str, spec, use_ema: bool = False) -> InitWeights:
    """--init-from: a dit-accel checkpoint or run folder (raw weights, or EMA with `use_ema`; import-dit writes
    such a run) or a diffusers DiT folder; refused in one line when its network is not the plan's."""
    from dit_accel.model import network_mismatch, timestep_freq_shift

    model, found, info = ckpt.load_weights(path, use_ema=use_ema)
    mismatch = network_mismatch(found, spec)
    if mismatch:
        raise UserError(f"--init-from {path} is another network than the plan's {spec.name}: {mismatch}; plan the network "
                        f"of those weights (dit-plan --depth/--hidden/--heads/--patch/--num-classes/--resolution) or pass "
                        f"matching weights")
    parameters = {name: param.detach() for name, param in model.named_parameters()}
    return InitWeights(parameters, timestep_freq_shift(model), f"{info['checkpoint']} ({info['weights']} weights)")


@torch.no_grad()
def load_init_weights(model: nn.Module, init: InitWeights) -> None:
    """Copy the weights into a freshly built (unsharded, unprepared) model of the same network."""
    names = {name for name, _ in model.named_parameters()}
    if names != set(init.parameters):
        raise ValueError(f"--init-from weights do not fit the model: {sorted(names ^ set(init.parameters))[:3]}")
    for name, param in model.named_parameters():
        param.copy_(init.parameters[name])


# --- the components ----------------------------------------------------------------------------------------


@dataclass
class Components:
    """Everything one training step touches. Built by `build_components`; the loop, the checkpointer and
    `dit-accel verify` (which traces this very step under FakeTensorMode) all use the same object."""

    spec: object  # planner.spec.DiTSpec
    plan: dict
    config: TrainConfig
    model: nn.Module  # as prepared by accelerate (DDP-wrapped when distributed) or plain
    ema: EMA | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objective: object  # dit_accel.diffusion.Diffusion: DiT's linear schedule, mse + vb loss
    vae: nn.Module | None
    device: torch.device
    grad_accum: int
    accelerator: object | None = None  # accelerate.Accelerator, or None for a bare device
    autocast_dtype: torch.dtype | None = None  # bare device only: the dtype the step autocasts to
    latent_shift_scale: tuple[float, float] = (0.0, 1.0)  # online encoding: the VAE's shift and scaling factors

    @property
    def raw_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def forward_context(self):
        """Autocast for a bare device; a prepared model already autocasts inside its forward."""
        if self.accelerator is None and self.autocast_dtype is not None:
            return torch.autocast(self.device.type, dtype=self.autocast_dtype)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)  # divides by grad_accum, scales for fp16
        else:
            (loss / self.grad_accum).backward()


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_precision(plan_precision: str, device_type: str) -> str:
    """The plan's precision on this device. fp16 needs a GradScaler and a GPU: on a CPU, run fp32 and warn
    (bf16 would be a different recipe, and fp32 is what the fp16 run approximates)."""
    if plan_precision not in PRECISION_TO_ACCELERATE:
        raise UserError(f"unknown precision {plan_precision!r} in the plan: expected bf16, fp16 or fp32; re-plan")
    if plan_precision == "fp16" and device_type == "cpu":
        log.warning("the plan says fp16, which needs a GPU; training in fp32 on this CPU instead")
        return "fp32"
    return plan_precision


def build_components(plan: dict, config: TrainConfig, accelerator=None, device: torch.device | str | None = None,
                     spec=None, precision: str | None = None, init: InitWeights | None = None,
                     timestep_freq_shift: int | None = None) -> Components:
    """Model, EMA, optimizer, lr schedule and objective, exactly as the plan says.

    The model is built on its device (`with device:`), seeded: no CPU copy to move over, and the same
    weights on every rank (each device type draws its own seeded stream: a CUDA run starts from other
    weights than a CPU run of the same seed). With an `accelerator`, the model and optimizer are prepared
    (DDP or FSDP2, mixed precision); the scheduler is NOT (see optim.py) and is registered for
    checkpointing instead. Under FSDP the blocks are sharded here (`shard_blocks`) before the optimizer sees
    the parameters, and `prepare` adds the root unit; the EMA is then made of each rank's shards.

    Without one, everything lives on `device` and the step autocasts itself to `precision` (default: the
    plan's, resolved for the device, so fp16 on a CPU runs fp32): that is how `dit-accel verify` traces it,
    asking for the plan's own precision, and `spec` overrides the plan's network (a shallower copy for
    per-block extrapolation).

    `init` (--init-from) replaces the seeded weights before anything else sees them, so the EMA starts equal to
    them and the optimizer state is fresh; the model then uses the init's timestep shift. `timestep_freq_shift`
    (a resumed run's, from its checkpoint) overrides it; the default is diffusers' (1).
    """
    from dit_accel.diffusion import Diffusion
    from dit_accel.model import DIFFUSERS_FREQ_SHIFT, build_model, set_checkpointed_blocks

    spec = spec or spec_from_plan(plan)
    decision = plan["decision"]
    if accelerator is not None and precision is not None:
        raise ValueError("precision is the Accelerator's (mixed_precision); pass it only for a bare device")
    device = torch.device(accelerator.device if accelerator is not None else (device or "cpu"))
    if timestep_freq_shift is None:
        timestep_freq_shift = init.timestep_freq_shift if init is not None else DIFFUSERS_FREQ_SHIFT
    torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    with device:
        model = build_model(spec, timestep_freq_shift=timestep_freq_shift)
    if init is not None:
        load_init_weights(model, init)  # on every rank, before sharding: each rank then keeps its shard
    set_checkpointed_blocks(model, int(decision["checkpointed_blocks"]))
    model.train()
    if uses_fsdp(accelerator):
        shard_blocks(model, accelerator.state.fsdp_plugin)
    lr = effective_lr(config.lr, plan["global_batch"], config.scale_lr)
    optimizer = build_optimizer(model, lr, config.betas, config.weight_decay, device, decision.get("adamw"))
    scheduler = build_scheduler(optimizer, config.warmup_steps)
    autocast_dtype = None
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(scheduler)
    else:
        if precision is None:
            precision = resolve_precision(decision["precision"], device.type)
        elif precision not in AUTOCAST_DTYPES:
            raise ValueError(f"precision must be one of {', '.join(AUTOCAST_DTYPES)}, got {precision!r}")
        autocast_dtype = AUTOCAST_DTYPES[precision]
    raw = accelerator.unwrap_model(model) if accelerator is not None else model
    ema = EMA(raw, config.ema_decay) if decision.get("ema", True) else None
    vae, latent_shift_scale = None, (0.0, 1.0)
    if decision["latents"] == "online":
        vae, latent_shift_scale = load_vae(config.vae, device)
    return Components(spec=spec, plan=plan, config=config, model=model, ema=ema, optimizer=optimizer,
                      scheduler=scheduler, objective=Diffusion.linear(), vae=vae, device=device,
                      grad_accum=int(decision["grad_accum"]), accelerator=accelerator,
                      autocast_dtype=autocast_dtype, latent_shift_scale=latent_shift_scale)


def load_vae(path: str, device: torch.device):
    """A frozen diffusers AutoencoderKL for online encoding, in fp32 as DiT encodes; and its latent
    (shift, scale): latent = (posterior sample - shift) * scale, as the latent cache stores them."""
    from dit_accel.data.latents import load_vae as load_frozen_vae

    vae, _identity = load_frozen_vae(path)
    vae.to(device)
    return vae, (float(getattr(vae.config, "shift_factor", None) or 0.0), float(vae.config.scaling_factor))


# --- one micro-step and one optimizer step -----------------------------------------------------------------


@torch.no_grad()
def encode_online(components: Components, images: torch.Tensor, posterior_noise: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] -> scaled latents, the posterior drawn with each sample's own noise."""
    from dit_accel.data.latents import encode_posterior

    mean, std = encode_posterior(components.vae, images.to(components.device))
    shift, scale = components.latent_shift_scale
    return (mean + std * posterior_noise.to(components.device) - shift) * scale


def train_micro_step(components: Components, batch: dict, loss_multiplier: float = 1.0) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns the (detached, fp32) mean loss of the micro-batch.

    Class dropout is applied here, once per sample, from the batch's per-sample draw (`batch["drop"]`).
    `loss_multiplier` exists for the NaN-injection test hook only.
    """
    from dit_accel.model import as_model_fn, null_class

    device = components.device
    x0 = batch["x"].to(device, non_blocking=True)
    if components.vae is not None:
        x0 = encode_online(components, x0, batch["posterior_noise"])
    labels = batch["y"].to(device, non_blocking=True)
    labels = torch.where(batch["drop"].to(device), torch.full_like(labels, null_class(components.spec)), labels)
    t = batch["t"].to(device, non_blocking=True)
    noise = batch["noise"].to(device, non_blocking=True)
    model_fn = as_model_fn(components.model)
    with components.forward_context():
        terms = components.objective.training_losses(model_fn, x0, labels, t=t, noise=noise)
    loss = terms["loss"].float().mean()
    if loss_multiplier != 1.0:
        loss = loss * loss_multiplier
    components.backward(loss)
    return loss.detach()


@dataclass
class StepResult:
    applied: bool
    loss: float  # mean over every sample of the global batch, all ranks
    grad_norm: float
    lr: float  # the lr this step used


@dataclass
class StepCheck:
    """What every rank knows after its last micro-step, as tensors: nothing here has been read yet."""

    grad_norm: torch.Tensor  # this rank's view of the global gradient norm, before clipping
    loss_mean: torch.Tensor  # this rank's mean loss over its micro-steps
    bad: torch.Tensor  # this rank saw a non-finite loss (or gradient norm)
    stats: torch.Tensor  # over all ranks: [mean loss, number of ranks that saw a non-finite value]

    def all_finite(self) -> bool:
        """The step's one decision made on a value (a device sync); the same on every rank."""
        return bool(self.stats[1].item() == 0)


def _fp16_scaled(components: Components) -> bool:
    return components.accelerator is not None and components.accelerator.scaler is not None


def check_step(components: Components, loss_sum: torch.Tensor) -> StepCheck:
    """Clip the gradients and agree across ranks on whether the step is finite, without reading a value.

    `loss_sum` is this rank's sum of micro-step mean losses. The gradient norm is measured always and the
    gradients clipped to --grad-clip when given; one all-reduce carries the loss and the non-finite flag.
    """
    accelerator, model = components.accelerator, components.model
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = components.config.grad_clip if components.config.grad_clip is not None else math.inf
    if accelerator is not None:
        grad_norm = accelerator.clip_grad_norm_(params, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = torch.as_tensor(full_tensor(grad_norm), device=components.device, dtype=torch.float32)
    loss_mean = loss_sum.float() / components.grad_accum
    # Under fp16 the grad scaler owns overflowing gradients (it skips and lowers its scale); a NaN loss is ours.
    bad = ~torch.isfinite(loss_mean) if _fp16_scaled(components) else ~(torch.isfinite(loss_mean) & torch.isfinite(grad_norm))
    stats = torch.stack([loss_mean, bad.float()])
    if accelerator is not None and accelerator.num_processes > 1:
        stats = accelerator.reduce(stats, reduction="sum")
        stats[0] /= accelerator.num_processes
    return StepCheck(grad_norm=grad_norm, loss_mean=loss_mean, bad=bad, stats=stats)


def apply_step(components: Components) -> bool:
    """AdamW step, then the lr schedule and the EMA; then the gradients go. Reads no tensor value itself.

    Returns whether the step was applied: always, except under fp16 with Accelerate, whose GradScaler
    (reading its overflow flag) skips a step with overflowing gradients, and then so do the schedule and EMA.
    """
    components.optimizer.step()
    applied = not (_fp16_scaled(components) and components.accelerator.optimizer_step_was_skipped)
    if applied:
        components.scheduler.step()
        if components.ema is not None:
            components.ema.update(components.raw_model)
    components.optimizer.zero_grad(set_to_none=True)
    return applied


def optimizer_step(components: Components, loss_sum: torch.Tensor) -> StepResult:
    """After the last micro-step: clip and vote (`check_step`), then apply the step (`apply_step`) or not.

    Every rank takes the same decision; a skipped step changes no weight, optimizer moment, EMA or
    lr-schedule position. The tensor work is in the two functions, which `dit-accel verify` traces on
    value-less fake tensors; the decision and the logged numbers are the only values read here.
    """
    check = check_step(components, loss_sum)
    lr = components.scheduler.get_last_lr()[0]
    if check.all_finite():
        applied = apply_step(components)
    else:
        applied = False
        components.optimizer.zero_grad(set_to_none=True)
    return StepResult(applied=applied, loss=float(check.stats[0].item()), grad_norm=float(check.grad_norm.item()),
                      lr=lr)


# --- logging -----------------------------------------------------------------------------------------------


def setup_logging(run_dir: Path, rank: int, is_main: bool) -> Path:
    """One plain log per rank in RUN/logs/; the main process also prints to the terminal."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank{rank}.log"
    for handler in list(log.handlers):  # a second run in the same process (tests) starts clean
        handler.close()
        log.removeHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    log.addHandler(file_handler)
    if is_main:
        log.addHandler(_TqdmHandler())
    return path


class _TqdmHandler(logging.Handler):
    """Terminal lines that do not tear the progress bar."""

    def emit(self, record):
        from tqdm import tqdm

        if getattr(record, "file_only", False):
            return
        tqdm.write(("WARNING: " if record.levelno >= logging.WARNING else "") + record.getMessage(), file=sys.stdout)


def measured_peak_bytes(device: torch.device) -> tuple[int, int] | None:
    """(max allocated, max reserved) bytes on this rank's GPU since the start, or None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def parameter_checksum(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in name order: equal on all ranks iff the weights are. Sharded
    parameters are gathered first (a collective: every rank calls this)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(full_tensor(param.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


# --- the loop ----------------------------------------------------------------------------------------------


def make_accelerator(plan: dict, config: TrainConfig, run_dir: Path):
    """The Accelerator the plan describes; on a machine without CUDA the same config runs on the CPU.

    Sharded plans run FSDP2 with the launcher's FSDP settings (checked against the plan), reduce-scattering
    the gradients every micro-step (`sync_each_batch`): accumulating under `no_sync` would keep a full
    unsharded gradient per rank, which the plan does not count.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, ProjectConfiguration

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    precision = resolve_precision(plan["decision"]["precision"], device_type)
    fsdp_plugin = fsdp_plugin_for(plan, config.plan)
    log_with = None
    if config.tensorboard:
        try:
            import tensorboard  # noqa: F401
            log_with = "tensorboard"
        except ImportError:
            print("dit_accel.train: tensorboard is not installed; logging to the text logs only "
                  "(pip install tensorboard)", file=sys.stderr)
    accelerator = Accelerator(
        cpu=device_type == "cpu",
        mixed_precision=PRECISION_TO_ACCELERATE[precision],
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=int(plan["decision"]["grad_accum"]), sync_each_batch=fsdp_plugin is not None),
        fsdp_plugin=fsdp_plugin,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
        # As planned: with gradient_as_bucket_view DDP's buckets ARE the .grad tensors (4 bytes/param less).
        kwargs_handlers=[DistributedDataParallelKwargs(
            gradient_as_bucket_view=bool(plan["decision"].get("gradient_as_bucket_view", False)))],
    )
    if fsdp_plugin is not None and not uses_fsdp(accelerator):
        if accelerator.device.type != "cpu":
            raise UserError(f"{config.plan} shards the model but accelerate set up {accelerator.distributed_type}: "
                            f"launch with the plan's accelerate_config.yaml")
        use_fsdp_on_cpu(accelerator, fsdp_plugin, PRECISION_TO_ACCELERATE[precision])
    return accelerator


def build_dataset(plan: dict, config: TrainConfig, spec):
    """The dataset the plan's latent mode reads, checked against the plan (resolution, VAE, classes)."""
    mode = plan["decision"]["latents"]
    if mode == "precomputed":
        from dit_accel.data.latents import LatentCache

        dataset = LatentCache(config.latents, flip=True, seed=None)  # unseeded: KeyedSamples seeds per sample
        check_latent_cache(dataset, spec, config.latents)
    else:
        from dit_accel.data.folder import ImageFolderData

        # Unseeded flips draw from torch's RNG, which KeyedSamples seeds per sample: exact on resume.
        dataset = ImageFolderData(config.data_path, spec.resolution, flip=True, seed=None)
        classes = len(dataset.classes)
        if classes > spec.num_classes:
            raise UserError(f"{config.data_path} has {classes} classes but the plan's model has {spec.num_classes}: "
                            f"re-plan with `dit-plan --num-classes {classes}`")
    return dataset


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, as the DataLoader's own worker warning counts them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def loader_workers(requested: int | None, ranks_per_node: int, cpus: int) -> int:
    """DataLoader workers per rank: --num-workers as given; without it the default, but no more than the node's
    CPUs leave each rank beside its own process (cpus // ranks - 1, at least 0), so that workers do not
    starve the ranks (and the DataLoader does not warn about it)."""
    if requested is not None:
        return requested
    return max(0, min(DEFAULT_NUM_WORKERS, cpus // max(ranks_per_node, 1) - 1))


def check_latent_cache(cache, spec, path: str) -> None:
    """The cache must hold what the plan's model takes: resolution, latent shape, classes."""
    from dit_accel.data.latents import check_cache_matches

    check_cache_matches(cache.manifest, spec.resolution)  # resolution; its message says how to fix it
    expected = (spec.in_channels, spec.latent_size, spec.latent_size)
    if tuple(cache.latent_shape) != expected:
        raise UserError(f"latent cache {path} holds latents of shape {tuple(cache.latent_shape)} but the plan's model "
                        f"takes {expected}: re-plan for this cache, or extract latents with a matching VAE")
    if len(cache.classes) > spec.num_classes:
        raise UserError(f"latent cache {path} has {len(cache.classes)} classes but the plan's model has "
                        f"{spec.num_classes}: re-plan with `dit-plan --num-classes {len(cache.classes)}`")


def check_resume(state: dict, plan: dict, spec, world_size: int, checkpoint: Path) -> None:
    """Resuming must continue the same run: the same model, world size and global batch."""
    if state.get("world_size") != world_size:
        raise UserError(f"{checkpoint} was written by {state.get('world_size')} processes but {world_size} were launched: "
                        f"launch {state.get('world_size')} processes with the run's plan to resume it exactly")
    if state.get("global_batch") != plan["global_batch"]:
        raise UserError(f"{checkpoint} trained with global batch {state.get('global_batch')} but the plan has "
                        f"{plan['global_batch']}: resume with the run's own plan ({checkpoint / ckpt.PLAN})")
    saved = spec_from_plan(json.loads((checkpoint / ckpt.PLAN).read_text()))
    if saved != spec:
        raise UserError(f"{checkpoint} holds a {saved.name} ({saved.depth} blocks x {saved.hidden}, {saved.resolution} px, "
                        f"{saved.latents}) but the plan is for {spec.name} ({spec.depth} x {spec.hidden}, "
                        f"{spec.resolution} px, {spec.latents}): use the run's own plan or a new --output-dir")


def injected_nan_step(rank: int) -> int | None:
    """Testing hook: DIT_ACCEL_INJECT_NAN="STEP" (every rank) or "STEP:RANK" poisons that step's loss."""
    value = os.environ.get(INJECT_NAN_ENV)
    if not value:
        return None
    step, _, only_rank = value.partition(":")
    return int(step) if not only_rank or int(only_rank) == rank else None


def train(config: TrainConfig) -> int:
    plan = read_plan(config.plan)
    spec = spec_from_plan(plan)
    check_data_mode(plan, config)
    check_launch(plan, int(os.environ.get("WORLD_SIZE", "1")), config.plan)
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    accelerator = make_accelerator(plan, config, run_dir)
    check_launch(plan, accelerator.num_processes, config.plan)
    rank, world_size, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    log_path = setup_logging(run_dir, rank, is_main)
    decision = plan["decision"]
    micro_batch, grad_accum, global_batch = int(decision["micro_batch"]), int(decision["grad_accum"]), int(plan["global_batch"])

    dataset = build_dataset(plan, config, spec)
    order = SampleOrder(len(dataset), global_batch, micro_batch, grad_accum, world_size, config.seed)
    resume_from = ckpt.resolve_resume(config.resume, run_dir)
    init = None
    if config.init_from:
        existing = ckpt.latest_checkpoint(run_dir)
        if existing is not None:  # a restarted job: continue this run, never start it over from the init weights
            resume_from = resume_from or existing
            log.info(f"--init-from {config.init_from} ignored: {run_dir} already holds {existing.name}, so the run "
                     f"resumes from it")
        else:
            init = read_init_weights(config.init_from, spec, use_ema=config.init_from_ema)
    resume_shift = None
    if resume_from is not None:
        from dit_accel.model import read_sidecar

        check_resume(ckpt.read_train_state(resume_from), plan, spec, world_size, resume_from)
        resume_shift = read_sidecar(resume_from).get("timestep_freq_shift")  # None: diffusers' shift

    tf32 = set_tf32(config.tf32, accelerator.device)
    components = build_components(plan, config, accelerator, init=init, timestep_freq_shift=resume_shift)
    state = {"step": 0, "applied_steps": 0, "skipped_steps": 0}
    if init is not None:
        init.parameters.clear()  # the host copy (4 bytes per parameter on every rank) is on the device now
        state["init_from"] = init.source  # kept in every checkpoint's train_state.json
    if resume_from is not None:
        state.update(ckpt.load_checkpoint(accelerator, resume_from, ema=components.ema))
        if state.get("dataset_size") != len(dataset):
            log.warning(f"the dataset has {len(dataset)} samples, the checkpoint's had {state.get('dataset_size')}: "
                        f"the data order after resuming differs from the original run's")
    # Each rank's own global RNG stream (anything not keyed per sample); restored RNG states win on resume.
    if resume_from is None:
        from accelerate.utils import set_seed

        set_seed(config.seed + rank)
    last_good = resume_from

    if is_main:
        from dit_accel.data.folder import write_classes_json

        save_config(config, run_dir / ckpt.TRAIN_CONFIG)
        write_json_atomically(run_dir / ckpt.PLAN, plan)
        write_classes_json(run_dir, dataset.classes)  # the names sample and export give the class indices
    if config.tensorboard and accelerator.log_with:
        accelerator.init_trackers("train", config=_tracker_config(config, plan))

    ranks_per_node, cpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), usable_cpus()
    workers = loader_workers(config.num_workers, ranks_per_node, cpus)
    if config.num_workers is None and workers < DEFAULT_NUM_WORKERS:
        log.info(f"{workers} DataLoader worker(s) per rank instead of {DEFAULT_NUM_WORKERS}: {cpus} CPU(s) for "
                 f"{ranks_per_node} rank(s) on this node (--num-workers N to choose)")
    latent_shape = (spec.in_channels, spec.latent_size, spec.latent_size)  # what the network sees
    noise = SampleNoise(config.seed, components.objective.num_timesteps, latent_shape, config.class_dropout,
                        posterior_shape=latent_shape if decision["latents"] == "online" else None)
    loader = torch.utils.data.DataLoader(
        KeyedSamples(dataset, config.seed), batch_sampler=OrderedBatches(order, state["step"], rank),
        collate_fn=Collate(noise), num_workers=workers, pin_memory=components.device.type == "cuda",
        persistent_workers=workers > 0)
    batches = iter(loader)

    # torch.cuda.max_memory_allocated sees tensors only, so it is held to the plan's peak less the overheads the
    # plan adds for the CUDA context, cuBLAS, NCCL and fragmentation (which max_memory_reserved partly shows).
    plan_memory = plan.get("memory", {})
    plan_peak = plan_memory.get("peak_bytes")
    plan_tensors = plan_peak - plan_memory.get("overhead", 0) if plan_peak else None
    sharding = decision.get("sharding", "ddp")
    layout = ("replicated (DDP)" if sharding == "ddp" else
              f"sharded {sharding} (FSDP2, reshard after forward: {RESHARD_AFTER_FORWARD[sharding]})")
    log.info(f"{spec.name}: {sum(p.numel() for p in components.raw_model.parameters()):,} parameters, "
             f"{layout}; TF32 {'on' if tf32 else ('off (--no-tf32)' if components.device.type == 'cuda' else 'n/a on CPU')}; world size "
             f"{world_size} x micro-batch {micro_batch} x accumulation {grad_accum} = global batch {global_batch}; "
             f"precision {decision['precision']} on {components.device.type}; checkpointed blocks "
             f"{decision['checkpointed_blocks']}/{spec.depth}; {len(dataset)} samples, {order.steps_per_epoch} steps "
             f"per epoch; lr {components.optimizer.param_groups[0]['initial_lr']:.3g}; run folder {run_dir}; "
             f"log {log_path}")
    if resume_from is not None:
        log.info(f"resumed from {resume_from} at step {state['step']}")
    if init is not None:
        log.info(f"initialized from {init.source}, timestep shift {init.timestep_freq_shift}: step 0 with a fresh "
                 f"optimizer, lr schedule and data order; the EMA starts at these weights")
    from dit_accel.model import sidecar

    weights_sidecar = sidecar(components.raw_model)  # the timestep shift, carried into every checkpoint
    if state["step"] >= config.max_steps:
        log.info(f"already at step {state['step']} >= --max-steps {config.max_steps}: nothing to do")
        accelerator.end_training()
        return 0

    from tqdm import tqdm

    progress = tqdm(total=config.max_steps, initial=state["step"], disable=not (is_main and config.progress_bar),
                    unit="step", dynamic_ncols=True, file=sys.stderr)
    nan_step = injected_nan_step(rank)
    crash_step = int(os.environ.get(CRASH_BEFORE_COMMIT_ENV, "0") or 0)
    warned_memory = False
    window_start, window_steps, window_losses = time.perf_counter(), 0, []
    metrics_path = run_dir / "metrics.jsonl"

    while state["step"] < config.max_steps:
        step = state["step"] + 1  # the optimizer step being taken, 1-based
        loss_sum = torch.zeros((), device=components.device)
        for micro_step in range(grad_accum):
            batch = next(batches)
            with accelerator.accumulate(components.model):
                assert accelerator.sync_gradients == (micro_step == grad_accum - 1), "accumulation out of step"
                multiplier = math.nan if (nan_step == step and micro_step == 0) else 1.0
                loss_sum += train_micro_step(components, batch, loss_multiplier=multiplier)
        result = optimizer_step(components, loss_sum)
        state["step"] = step
        state["applied_steps"] += int(result.applied)
        progress.update(1)
        window_steps += 1
        if result.applied:
            window_losses.append(result.loss)
        if config.debug_checksums:
            log.info(f"checksum step {step} {parameter_checksum(components.raw_model)}")

        if not result.applied:
            state["skipped_steps"] += 1
            where = f"last good checkpoint: {last_good} (resume with --resume auto)" if last_good else \
                "no checkpoint was written yet"
            if config.nan_policy == "abort":
                progress.close()
                accelerator.end_training()
                raise TrainingStopped(f"non-finite loss or gradient at step {step} (loss {result.loss}, grad norm "
                                      f"{result.grad_norm}); the step was not applied and the run stopped; {where}; "
                                      f"lower --lr or set --grad-clip, or pass --nan-policy skip")
            log.warning(f"non-finite loss or gradient at step {step}: skipped ({state['skipped_steps']} skipped so far, "
                        f"at most {config.max_skipped_steps})")
            if state["skipped_steps"] > config.max_skipped_steps:
                progress.close()
                accelerator.end_training()
                raise TrainingStopped(f"{state['skipped_steps']} steps had a non-finite loss or gradient, more than "
                                      f"--max-skipped-steps {config.max_skipped_steps}; stopped at step {step}; {where}")

        if step % config.log_every == 0 or step == config.max_steps:
            elapsed = time.perf_counter() - window_start
            peak = measured_peak_bytes(components.device)
            # Every applied step's loss since the last line, each the mean over all ranks' samples.
            loss = sum(window_losses) / len(window_losses) if window_losses else math.nan
            metrics = {"step": step, "loss": loss, "lr": result.lr, "grad_norm": result.grad_norm,
                       "images_per_s": global_batch * window_steps / elapsed, "step_time_s": elapsed / window_steps,
                       "skipped_steps": state["skipped_steps"]}
            memory_text = "peak GPU memory n/a on CPU"
            if peak is not None:
                peak_tensor = accelerator.reduce(torch.tensor(peak, device=components.device, dtype=torch.float64),
                                                 reduction="max") if world_size > 1 else torch.tensor(peak)
                allocated, reserved = (int(v) for v in peak_tensor.tolist())
                metrics.update(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved)
                memory_text = f"peak GPU memory {gib(allocated)} allocated, {gib(reserved)} reserved"
                if plan_tensors and allocated > plan_tensors and not warned_memory:
                    warned_memory = True
                    log.warning(f"measured peak {gib(allocated)} allocated exceeds the plan's {gib(plan_tensors)} of "
                                f"tensors (its {gib(plan_peak)} peak less overheads): "
                                f"report it with `dit-accel verify`; the run goes on")
            if plan_peak:
                memory_text += (f" (plan: {gib(plan_peak)})" if peak is None else
                                f" (plan: {gib(plan_tensors)} of tensors, {gib(plan_peak)} with overheads)")
            log.info(f"step {step}/{config.max_steps} | loss {loss:.4f} | lr {result.lr:.3g} | grad norm "
                     f"{result.grad_norm:.3g} | {metrics['images_per_s']:.1f} img/s | {metrics['step_time_s']:.3f} s/step | "
                     f"{memory_text}")
            progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if accelerator.log_with:
                accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            if is_main:
                with metrics_path.open("a") as handle:
                    handle.write(json.dumps(metrics) + "\n")
            window_start, window_steps, window_losses = time.perf_counter(), 0, []

        if step % config.checkpoint_every == 0 or step == config.max_steps:
            epoch, offset = order.epoch_and_offset(step)
            train_state = dict(state, epoch=epoch, samples_into_epoch=offset, world_size=world_size,
                               global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum,
                               dataset_size=len(dataset), seed=config.seed, samples_seen=step * global_batch)
            before_commit = _crash_now if crash_step == step else None
            last_good = ckpt.save_checkpoint(accelerator, run_dir, step, ema=components.ema, train_state=train_state,
                                             plan=plan, config=config.to_json(), keep_last=config.keep_last,
                                             sidecar=weights_sidecar, before_commit=before_commit)
            log.info(f"checkpoint {last_good}")
    progress.close()
    log.info(f"done: step {state['step']}, {state['skipped_steps']} skipped; newest checkpoint {last_good}")
    accelerator.end_training()
    return 0


def _crash_now(tmp_dir: Path) -> None:
    """Testing hook (DIT_ACCEL_CRASH_BEFORE_COMMIT): die like a killed process, mid-checkpoint."""
    log.warning(f"{CRASH_BEFORE_COMMIT_ENV}: killing the process before committing {tmp_dir}")
    for handler in log.handlers:
        handler.flush()
    os._exit(137)


def _tracker_config(config: TrainConfig, plan: dict) -> dict:
    """TensorBoard hparams take scalars only."""
    values = {k: v for k, v in config.to_json().items() if isinstance(v, (int, float, str, bool))}
    values.update({f"plan_{k}": v for k, v in plan["decision"].items() if isinstance(v, (int, float, str, bool))})
    values["global_batch"] = plan["global_batch"]
    return values


@exits_cleanly("dit_accel.train")
def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_config(argv)
    try:
        return train(config)
    except UserError as error:
        if int(os.environ.get("RANK", "0")) != 0:  # every rank finds the same problem; rank 0 says it once
            log.error(str(error), extra={"file_only": True})
            return 2
        raise
    except TrainingStopped as stopped:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank stops; one says why
            print(f"dit_accel.train: stopped: {stopped}", file=sys.stderr)
        log.error(str(stopped), extra={"file_only": True})
        return EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
