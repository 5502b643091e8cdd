"""Where a run starts: step 0 from the seed, step 0 from other weights (--init-from), or a checkpoint of this
run (--resume), and the state restored from it once the components exist."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dit_accel import checkpoint as ckpt
from dit_accel.errors import UserError
from dit_accel.train_config import TrainConfig
from planner.planfile import Plan, read_plan

log = logging.getLogger("dit_accel.train")


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
        raise UserError(
            f"--init-from {path} is another network than the plan's {spec.name}: {mismatch}",
            "plan the network of those weights (dit-plan --depth/--hidden/--heads/--patch/--num-classes/"
            "--resolution) or pass matching weights",
        )
    parameters = {name: param.detach() for name, param in model.named_parameters()}
    return InitWeights(
        parameters, timestep_freq_shift(model), f"{info['checkpoint']} ({info['weights']} weights)"
    )


@torch.no_grad()
def load_init_weights(model: nn.Module, init: InitWeights) -> None:
    """Copy the weights into a freshly built (unsharded, unprepared) model of the same network."""
    names = {name for name, _ in model.named_parameters()}
    if names != set(init.parameters):
        raise ValueError(
            f"--init-from weights do not fit the model: {sorted(names ^ set(init.parameters))[:3]}"
        )
    for name, param in model.named_parameters():
        param.copy_(init.parameters[name])


def check_resume(state: dict, plan: Plan, spec, world_size: int, checkpoint: Path) -> None:
    """Resuming must continue the same run: the same model, world size and global batch."""
    if state.get("world_size") != world_size:
        raise UserError(
            f"{checkpoint} was written by {state.get('world_size')} processes but {world_size} were launched",
            f"launch {state.get('world_size')} processes with the run's plan to resume it exactly",
        )
    if state.get("global_batch") != plan.global_batch:
        raise UserError(
            f"{checkpoint} trained with global batch {state.get('global_batch')} but the plan has "
            f"{plan.global_batch}",
            f"resume with the run's own plan ({checkpoint / ckpt.PLAN})",
        )
    saved = read_plan(checkpoint / ckpt.PLAN).spec()
    if saved != spec:
        raise UserError(
            f"{checkpoint} holds a {saved.name} ({saved.depth} blocks x {saved.hidden}, "
            f"{saved.resolution} px, {saved.latents}) but the plan is for {spec.name} ({spec.depth} x "
            f"{spec.hidden}, {spec.resolution} px, {spec.latents})",
            "use the run's own plan or a new --output-dir",
        )


@dataclass
class Start:
    """How this run begins: from `checkpoint` (resume), from `init` weights (a new run), or from the seed."""

    checkpoint: Path | None = None
    init: InitWeights | None = None
    timestep_freq_shift: int | None = None  # the resumed checkpoint's (None: diffusers', or the init's)
    state: dict = field(default_factory=lambda: {"step": 0, "applied_steps": 0, "skipped_steps": 0})


def choose_start(config: TrainConfig, run_dir: Path, plan: Plan, spec, world_size: int) -> Start:
    """--resume and --init-from resolved against the run folder, checked before any model is built."""
    start = Start(checkpoint=ckpt.resolve_resume(config.resume, run_dir))
    if config.init_from:
        existing = ckpt.latest_checkpoint(run_dir)
        if (
            existing is not None
        ):  # a restarted job: continue this run, never start it over from the init weights
            start.checkpoint = start.checkpoint or existing
            log.info(
                f"--init-from {config.init_from} ignored: {run_dir} already holds {existing.name}, so the run "
                f"resumes from it"
            )
        else:
            start.init = read_init_weights(config.init_from, spec, use_ema=config.init_from_ema)
    if start.checkpoint is not None:
        from dit_accel.model import read_sidecar

        check_resume(ckpt.read_train_state(start.checkpoint), plan, spec, world_size, start.checkpoint)
        start.timestep_freq_shift = read_sidecar(start.checkpoint).get(
            "timestep_freq_shift"
        )  # None: diffusers'
    return start


def restore(start: Start, accelerator, components, dataset_size: int, seed: int) -> dict:
    """The run's state counters after the components exist: a checkpoint's (weights, AdamW, EMA, scheduler, RNG
    streams restored with them), or step 0 with each rank's global RNG seeded (seed + rank)."""
    state = dict(start.state)
    if start.init is not None:
        start.init.parameters.clear()  # the host copy (4 bytes per parameter on every rank) is on the device now
        state["init_from"] = start.init.source  # kept in every checkpoint's train_state.json
    if start.checkpoint is None:
        from accelerate.utils import set_seed

        set_seed(seed + accelerator.process_index)  # anything not keyed per sample
        return state
    state.update(ckpt.load_checkpoint(accelerator, start.checkpoint, ema=components.ema))
    if state.get("dataset_size") != dataset_size:
        log.warning(
            f"the dataset has {dataset_size} samples, the checkpoint's had {state.get('dataset_size')}: "
            f"the data order after resuming differs from the original run's"
        )
    return state
