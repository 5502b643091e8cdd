"""Where a run starts: step 0 from the seed, step 0 from other weights (--init-from), or a checkpoint of this
run (--resume), and the state restored from it once the components exist; first of all, the run folder held
(its lock) and refused when it holds checkpoints that no --resume continues."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dit_accel.distributed.consensus import main_decides
from dit_accel.errors import UserError
from dit_accel.run import checkpoint as ckpt
from dit_accel.run import lock as runlock
from dit_accel.run.weights import load_weights
from dit_accel.train.config import TrainConfig
from dit_accel.train.flags import inherited_notes
from dit_accel.train.optim import effective_lr
from dit_accel.train.steplog import plan_notes
from planner.planfile import Plan, read_plan
from planner.units import count

log = logging.getLogger("dit_accel.train")


@dataclass
class InitWeights:
    """Weights a NEW run starts from: the parameters by name and the timestep shift they were trained with
    (0 for weights that began as an original DiT checkpoint; see docs/model.md, "The shift rule")."""

    parameters: dict[str, torch.Tensor]
    timestep_freq_shift: int
    source: str  # where they came from: for the log and train_state.json
    objective: str = "ddpm"  # what they were trained under (their dit_accel.json): the run must train it too


def read_init_weights(path: str, spec, use_ema: bool = False) -> InitWeights:
    """--init-from: a dit-accel checkpoint or run folder (raw weights, or EMA with `use_ema`; import-dit writes
    such a run) or a diffusers DiT folder; refused in one line when its network is not the plan's."""
    from dit_accel.models.dit import network_mismatch, timestep_freq_shift

    model, found, info = load_weights(path, use_ema=use_ema)
    parameters = {name: param.detach() for name, param in model.named_parameters()}
    mismatch = network_mismatch(found, spec)
    if mismatch and info["weights"] == "diffusers" and found.num_classes != spec.num_classes:
        parameters, mismatch = _unpadded_export(path, parameters, found, spec, mismatch)
    if mismatch:
        raise UserError(
            f"--init-from {path} is another network than the plan's {spec.name}: {mismatch}",
            "plan the network of those weights (dit-plan --depth/--hidden/--heads/--patch/--num-classes/"
            "--resolution) or pass matching weights",
        )
    from dit_accel.run.weights import recorded_objective

    return InitWeights(
        parameters,
        timestep_freq_shift(model),
        f"{info['checkpoint']} ({info['weights']} weights)",
        recorded_objective(info["checkpoint"])["name"],
    )


def _unpadded_export(path: str, parameters: dict, found, spec, mismatch: str) -> tuple[dict, str | None]:
    """A pipeline `dit-accel export` wrote holds a class table padded to 1,000 classes for DiTPipeline; for a
    plan with the model's own class count the padding comes off again (checked row by row)."""
    import dataclasses

    from dit_accel.models.diffusers_format import PIPELINE_NULL_CLASS, exported_num_classes, unpad_class_table
    from dit_accel.models.dit import network_mismatch

    recorded = exported_num_classes(path)
    if found.num_classes != PIPELINE_NULL_CLASS or network_mismatch(
        dataclasses.replace(found, num_classes=spec.num_classes), spec
    ):
        return parameters, mismatch
    if recorded is not None and recorded != spec.num_classes:
        return parameters, f"num_classes {recorded} as exported (wanted {spec.num_classes})"
    try:
        return unpad_class_table(parameters, spec.num_classes), None
    except ValueError as why:
        return parameters, f"{mismatch}; {why}"


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


_claim_notes: list[str] = []  # what claim_run_folder found, logged by choose_start once logging is set up


def _refuse_a_shared_timeline(run_dir: Path) -> None:
    """RUN/checkpoints may link to a bigger disk, but not into another run's folder: the lock is the run
    folder's, so two runs would then write, rotate and resume one timeline, each holding its own lock."""
    link = ckpt.checkpoints_dir(run_dir)
    if not link.is_symlink():
        return
    target = link.resolve()
    owner = target.parent
    if owner != Path(run_dir).resolve() and any(
        (owner / name).exists() for name in (runlock.LOCK_NAME, ckpt.PLAN, ckpt.METRICS)
    ):
        raise UserError(
            f"{link} links to {target}, the checkpoints of another run ({owner}): both runs would write one "
            "timeline under two locks",
            "point --output-dir at that run to continue it, or give this run a checkpoints folder of its own",
        )


def claim_run_folder(accelerator, config: TrainConfig, run_dir: Path) -> list[str]:
    """Before anything is written: the main process takes RUN/run.lock (`runlock`) and refuses a folder that
    already holds checkpoints when no --resume says to continue them (a rerun would start over at step 0
    and mix its checkpoints with theirs, or, for another network, rotate them away). Every rank gets the same
    answer. Returns notes for the log (a stale lock taken over), which `choose_start` also logs; released
    by `runlock.release_all`."""

    def claim() -> list[str]:
        _refuse_a_shared_timeline(run_dir)
        _lock, note = runlock.acquire(run_dir)
        found = ckpt.complete_checkpoints(run_dir)
        if found and config.resume is None and not config.init_from:
            runlock.release_all()
            raise UserError(
                f"{run_dir} already holds checkpoints (up to {found[-1][1].name}) and --resume was not given",
                "pass --resume auto to continue that run, or another --output-dir for a new one",
            )
        return [note] if note else []

    _claim_notes[:] = main_decides(accelerator, claim)
    return list(_claim_notes)


# What a resumed run cannot change: the plan's shape. (The model, world size and global batch are checked
# on their own, with their own fixes.)
_FIXED_DECISION = ("micro_batch", "grad_accum", "precision", "sharding", "ema")


def check_resume(state: dict, plan: Plan, spec, world_size: int, checkpoint: Path) -> None:
    """Resuming must continue the same run: the same model, world size, global batch, micro-batch,
    accumulation, precision, sharding and EMA."""
    if state.get("world_size") != world_size:
        raise UserError(
            f"{checkpoint} was written by {count(state.get('world_size'), 'process')} but {world_size} "
            f"{'was' if world_size == 1 else 'were'} launched",
            f"launch {count(state.get('world_size'), 'process')} with the run's plan to resume it exactly",
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
    saved_decision = read_plan(checkpoint / ckpt.PLAN).decision
    for name in _FIXED_DECISION:
        before, now = getattr(saved_decision, name), getattr(plan.decision, name)
        if before != now:
            raise UserError(
                f"{checkpoint} trained with {name} {before} but the plan has {now}: a resumed run cannot "
                f"change the plan's shape",
                f"resume with the run's own plan ({checkpoint / ckpt.PLAN}), or start a new --output-dir",
            )


def check_same_hflip(saved: dict, config: TrainConfig, checkpoint: Path) -> None:
    """A resumed run keeps its augmentation: the flips it trained with (`hflip` as resolved at its start)."""
    before = saved.get("hflip")
    if before is not None and config.hflip is not None and bool(before) != bool(config.hflip):
        flag = "--hflip" if before else "--no-hflip"
        raise UserError(
            f"{checkpoint} trained with {flag} but this launch says {'--hflip' if config.hflip else '--no-hflip'}",
            f"resume with {flag} (or neither), or start a new --output-dir",
        )


@dataclass
class Start:
    """How this run begins: from `checkpoint` (resume), from `init` weights (a new run), or from the seed."""

    checkpoint: Path | None = None
    init: InitWeights | None = None
    timestep_freq_shift: int | None = None  # the resumed checkpoint's (None: diffusers', or the init's)
    state: dict = field(default_factory=lambda: {"step": 0, "applied_steps": 0, "skipped_steps": 0})


def choose_start(
    config: TrainConfig, run_dir: Path, plan: Plan, spec, world_size: int, accelerator=None
) -> Start:
    """--resume and --init-from resolved against the run folder, checked before any model is built. The
    main process picks (and verifies) the checkpoint; every rank resumes the same one."""
    while _claim_notes:
        log.warning(_claim_notes.pop(0))
    for note in inherited_notes():  # the settings --resume took from the run's record
        log.info(note)
    start = Start(checkpoint=main_decides(accelerator, lambda: ckpt.resolve_resume(config.resume, run_dir)))
    if config.init_from:
        existing = start.checkpoint or main_decides(accelerator, lambda: ckpt.resolve_resume("auto", run_dir))
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
        from dit_accel.models.diffusers_format import read_sidecar

        check_resume(ckpt.read_train_state(start.checkpoint), plan, spec, world_size, start.checkpoint)
        check_same_hflip(ckpt.read_train_config(start.checkpoint), config, start.checkpoint)
        start.timestep_freq_shift = read_sidecar(start.checkpoint).get(
            "timestep_freq_shift"
        )  # None: diffusers'
    return start


def restore(start: Start, accelerator, components, data: dict, seed: int) -> dict:
    """The run's state counters after the components exist: a checkpoint's (weights, AdamW, EMA, scheduler, RNG
    streams restored with them), or step 0 with each rank's global RNG seeded (seed + rank). `data`: what the
    run reads (`train.data.data_fingerprint`), kept in every checkpoint and held to the checkpoint's."""
    from dit_accel.train.data import data_change

    for note in plan_notes(components.plan):  # AdamW's state is in place before step 1 on either path
        log.info(note)
    if components.fp8 is not None:
        f = components.fp8
        log.info(
            f"fp8: {f['linears']} linear layers of the blocks in FP8 ({f['library']}, {f['recipe']}"
            f"{'; emulated on this CPU' if f['emulated'] else ''}), {f['linears_kept']} kept in bf16; the plan's "
            "memory and img/s are bf16's, FP8's are unmeasured"
        )
    state = dict(start.state)
    if start.init is not None:
        start.init.parameters.clear()  # the host copy (4 bytes per parameter on every rank) is on the device now
        state["init_from"] = start.init.source  # kept in every checkpoint's train_state.json
    if start.checkpoint is None:
        from accelerate.utils import set_seed

        from dit_accel.train.optim import create_states

        set_seed(seed + accelerator.process_index)  # anything not keyed per sample
        create_states(components.optimizer)  # now, as a resumed run loads it: the same memory layout
        return dict(state, data=data)
    state.update(
        ckpt.load_checkpoint(
            accelerator, start.checkpoint, ema=components.ema, scheduler=components.scheduler
        )
    )
    if components.ema is not None:
        components.ema.updates = state.get("applied_steps", state["step"])  # one EMA update per applied step
    for change in apply_recipe_changes(components, start.checkpoint, state["step"] + 1):
        log.info(change)
    recorded, state["data"] = state.get("data"), data
    change = data_change(recorded, data)
    if change:
        log.warning(f"{change}: the samples after step {state['step']} are not the original run's")
    elif recorded is None and state.get("dataset_size") != data["entries"]:  # a checkpoint from before `data`
        log.warning(
            f"the dataset has {data['entries']} samples, the checkpoint's had {state.get('dataset_size')}: "
            f"the data order after resuming differs from the original run's"
        )
    return state


def apply_recipe_changes(components, checkpoint: Path, first_step: int) -> list[str]:
    """This launch's AdamW settings and lr schedule, applied over whatever the checkpoint's optimizer state
    carried: its param groups come back from a file (accelerate's load_state), and no number in a file
    steers the training. The lr is the launch's lr at the applied step (`scheduler.last_epoch`, set from
    train_state.json). Returns one log line per value that differs from the checkpoint's, nothing when none
    did; the values written are then the ones the checkpoint held, so a plain resume stays bit-exact."""
    config, optimizer, scheduler = components.config, components.optimizer, components.scheduler
    defaults = getattr(optimizer, "optimizer", optimizer).defaults  # this launch's, never loaded from a file
    group = optimizer.param_groups[0]
    warmup = scheduler.lr_lambdas[0]
    saved = ckpt.read_train_config(checkpoint)
    wanted = {
        "lr": effective_lr(config.lr, components.plan.global_batch, config.scale_lr),
        "betas": tuple(float(b) for b in config.betas),
        "weight_decay": float(config.weight_decay),
        "warmup_steps": int(config.warmup_steps),
    }
    found = {
        "lr": group.get("initial_lr"),
        "betas": tuple(group.get("betas", ())),
        "weight_decay": group.get("weight_decay"),
        "warmup_steps": saved.get("warmup_steps", wanted["warmup_steps"]),
    }
    changes = [
        f"--{name.replace('_', '-')} changed on resume: {_shown(found[name])} -> {_shown(wanted[name])}, "
        f"applied from step {first_step}"
        for name in wanted
        if found[name] != wanted[name]
    ]
    changes += [
        f"AdamW's {name} in {checkpoint} is {_shown(group.get(name))}, this trainer's {_shown(value)}: "
        f"{_shown(value)} applies from step {first_step}"
        for name, value in defaults.items()
        if name not in ("lr", "betas", "weight_decay") and name in group and group[name] != value
    ]
    for name in (
        "grad_clip",
        "ema_decay",
        "ema_warmup",
        "class_dropout",
        "nan_policy",
        "max_skipped_steps",
        "seed",
    ):
        if name in saved and saved[name] != getattr(config, name):  # read live from the config
            changes.append(
                f"--{name.replace('_', '-')} changed on resume: {_shown(saved[name])} -> "
                f"{_shown(getattr(config, name))}, applied from step {first_step}"
                + (" (the data order and noise now differ from the original run's)" if name == "seed" else "")
            )
    if hasattr(warmup, "warmup_steps"):
        warmup.warmup_steps = wanted["warmup_steps"]
    scheduler.base_lrs = [wanted["lr"] for _ in optimizer.param_groups]
    factor = warmup(scheduler.last_epoch)
    for param_group in optimizer.param_groups:
        param_group.update(defaults)
        param_group.update(
            initial_lr=wanted["lr"],
            lr=wanted["lr"] * factor,
            betas=wanted["betas"],
            weight_decay=wanted["weight_decay"],
        )
    scheduler._last_lr = [param_group["lr"] for param_group in optimizer.param_groups]
    return changes


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return " ".join(_shown(v) for v in value)
    return str(value)
