"""The training loop: `accelerate launch --config_file PLAN/accelerate_config.yaml -m dit_accel.train ...`.

Reads top to bottom: read the plan, make the accelerator, build the parts, resume, loop (micro-steps, the
optimizer step, the NaN policy, logging, checkpoints), finish. Each part lives in a module named for its job:

    planner.planfile          plan.json, typed and checked
    distributed.accelerator   the Accelerator the plan describes, the launch checked against it (FSDP2: .fsdp)
    train.data                the dataset of the plan's latent mode, checked, and this rank's DataLoader
    data.order                which samples each rank reads at each step, and each sample's own randomness
    train.resume              where the run starts: the seed, other weights (--init-from) or a checkpoint
    train.step                the components and one training step (what `dit-accel verify` traces)
    run.checkpoint            commit, rotate and load checkpoints
    train.steplog, .trackers  the log line, metrics and measured memory, to the --report-to trackers too
    train.samples             --sample-every: an EMA sample grid (train.evaluation: --eval-every's FID)
    run.faults, .preemption   test-only fault injection; a stop signal noticed at a step boundary
    run.watchdog              each rank's heartbeat, and the end of a rank stuck in a collective

The step counter, lr schedule, EMA and logs count optimizer steps; "step 3" is the third one.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

from dit_accel.cpu_threads import cpu_threads
from dit_accel.errors import (
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_USER,
    USER_ERRORS,
    Preempted,
    TrainingStopped,
    exits_cleanly,
    write_exit_record,
)
from dit_accel.run.lock import release_all as release_run_folder
from dit_accel.run.logs import log, setup_logging
from dit_accel.run.preemption import StopRequest, die_with_parent, preempted_message
from dit_accel.train.config import TrainConfig, parse_signals, save_config
from dit_accel.train.flags import parse_config


def train(config: TrainConfig, stop_request: StopRequest | None = None) -> int:
    from dit_accel.data.order import SampleNoise, SampleOrder
    from dit_accel.distributed.accelerator import (
        check_launch,
        end_process_group,
        make_accelerator,
        tf32_as_planned,
    )
    from dit_accel.distributed.consensus import gathered, main_decides
    from dit_accel.progress import progress_bar
    from dit_accel.run.checkpoint import PLAN, TRAIN_CONFIG, Checkpointer  # here: --help needs none of these
    from dit_accel.run.faults import Faults
    from dit_accel.run.watchdog import Watchdog
    from dit_accel.train.data import build_dataset, check_inputs, data_fingerprint, make_loader
    from dit_accel.train.evaluation import TrainingEval
    from dit_accel.train.resume import choose_start, claim_run_folder, restore
    from dit_accel.train.samples import TrainingSamples
    from dit_accel.train.step import (
        NON_FINITE,
        SCALER_OVERFLOW,
        build_components,
        optimizer_step,
        train_micro_step,
    )
    from dit_accel.train.steplog import StepLog, parameter_checksum, tracker_config, weights_layout
    from dit_accel.train.trackers import chosen_trackers, start_trackers
    from planner.planfile import read_plan
    from planner.units import count

    stop_request = stop_request or StopRequest()
    # The plan, and everything that can be refused before a process group or a model exists.
    plan = read_plan(config.plan)
    spec = plan.spec()
    check_inputs(plan, config)  # the data and encoder given, there, of the plan's kind: before the run folder
    check_launch(plan, int(os.environ.get("WORLD_SIZE", "1")), config.plan)
    trackers = chosen_trackers(config.report_to, config.tensorboard)  # a missing package: one line, now
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    accelerator = make_accelerator(plan, config.plan, run_dir, config.collective_timeout_s)
    check_launch(plan, accelerator.num_processes, config.plan)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    claim_run_folder(accelerator, config, run_dir)  # RUN/run.lock, before anything is written
    log_path = setup_logging(run_dir, rank, is_main)
    faults = Faults.from_environment(rank)
    d = plan.decision
    watchdog = Watchdog(run_dir, rank, world_size, d.grad_accum, config.collective_timeout_s)
    stop_request.closing.append(watchdog.stop)
    evaluation = TrainingEval(config, plan, spec, accelerator, run_dir, watchdog)  # files refused now

    # The parts: data, where the run starts, model/EMA/optimizer, then the state restored into them.
    dataset = build_dataset(plan, config, spec, run_dir / "data_index", partial(main_decides, accelerator))
    config.hflip = dataset.flip  # as resolved (a cache's own setting): recorded in the run, held on resume
    order = SampleOrder(len(dataset), plan.global_batch, d.micro_batch, d.grad_accum, world_size, config.seed)
    start = choose_start(config, run_dir, plan, spec, world_size, accelerator=accelerator)
    tf32_text = tf32_as_planned(config.tf32, plan, accelerator.device)
    shift, latent_norm = start.timestep_freq_shift, getattr(dataset, "latent_norm", None)
    components = build_components(
        plan, config, accelerator, init=start.init, timestep_freq_shift=shift, latent_norm=latent_norm
    )
    state = restore(start, accelerator, components, data_fingerprint(dataset), config.seed)
    faults.install(components.raw_model, state["step"], d.grad_accum)
    watchdog.watch(components.raw_model)  # after the faults' hooks: a sleep injected there is in the forward

    if is_main:
        from dit_accel.atomic import write_json_atomically
        from dit_accel.data.folder import write_classes_json

        save_config(config, run_dir / TRAIN_CONFIG)
        write_json_atomically(run_dir / PLAN, plan.to_json())
        write_classes_json(run_dir, dataset.classes)  # the names sample and export give the class indices
    hparams, first_step = tracker_config(config, plan), state["step"] + 1  # TensorBoard hides later events
    start_trackers(accelerator, trackers, hparams, run_dir.name, run_dir, first_step)
    samples = TrainingSamples(config, plan, spec, accelerator, components, run_dir, dataset.classes)

    latent_shape = (spec.in_channels, spec.latent_size, spec.latent_size)  # what the network sees
    online = latent_shape if d.latents == "online" else None  # the posterior draw's shape
    noise = SampleNoise.for_objective(
        components.objective, config.seed, latent_shape, config.class_dropout, online
    )
    batches = iter(make_loader(dataset, order, noise, config, state["step"], rank, components.device))
    checkpointer = Checkpointer(
        accelerator,
        run_dir,
        ema=components.ema,
        scheduler=components.scheduler,
        plan=plan.to_json(),
        config=config.to_json(),
        keep_last=config.keep_last,
        sidecar=components.sidecar(),  # the timestep shift and the objective travel along
        before_commit=faults.before_commit,
        parent=start.checkpoint,  # the timeline this run continues (None: a new one)
    )
    steplog = StepLog(run_dir, plan, accelerator, components.device, config.max_steps, start.checkpoint)
    last_good = start.checkpoint

    log.info(
        f"{spec.name}: {sum(p.numel() for p in components.raw_model.parameters()):,} parameters, "
        f"{weights_layout(plan, world_size)}; "
        f"TF32 {tf32_text}; world size {world_size} x micro-batch {d.micro_batch} x accumulation "
        f"{d.grad_accum} = global batch {plan.global_batch}; precision {d.precision} on "
        f"{components.device.type}; checkpointed blocks {d.checkpointed_blocks}/{spec.depth}; {len(dataset)} "
        f"samples, {count(order.steps_per_epoch, 'step')} per epoch; lr "
        f"{components.optimizer.param_groups[0]['initial_lr']:.3g}; run folder {run_dir}; log {log_path}"
    )
    if start.checkpoint is not None:
        log.info(f"resumed from {start.checkpoint} at step {state['step']}")
    if start.init is not None:
        log.info(
            f"initialized from {state['init_from']}, timestep shift {start.init.timestep_freq_shift}: step 0 "
            f"with a fresh optimizer, lr schedule and data order; the EMA starts at these weights"
        )
    if state["step"] >= config.max_steps:
        log.info(f"already at step {state['step']} >= --max-steps {config.max_steps}: nothing to do")
        end_process_group(accelerator)
        return 0

    show = is_main and config.progress_bar
    progress = progress_bar(total=config.max_steps, initial=state["step"], unit="step", disable=not show)

    def finish() -> None:  # every way out of the loop: done, stopped or preempted
        progress.close()
        watchdog.stop()
        end_process_group(accelerator)  # not end_training alone, which would free it

    def stop(reason: str) -> TrainingStopped:
        finish()
        where = f"last good checkpoint: {last_good} (resume with --resume auto)" if last_good else None
        return TrainingStopped(f"{reason}; {where or 'no checkpoint was written yet'}")

    # A stop signal during set-up: every rank learns of it here, and none trains a step it must then save.
    if early := next(filter(None, gathered(accelerator, stop_request.signum)), 0):
        finish()
        raise Preempted(preempted_message(early, state["step"], last_good, saved=False))
    stop_request.in_loop = True
    watchdog.start()
    while state["step"] < config.max_steps:
        step = state["step"] + 1  # the optimizer step being taken, 1-based
        loss_sum = 0.0
        for micro_step in range(d.grad_accum):
            watchdog.at(step, micro_step)
            with steplog.waiting_for_data():
                batch = next(batches)
            with accelerator.accumulate(components.model):
                assert accelerator.sync_gradients == (micro_step == d.grad_accum - 1), (
                    "accumulation out of step"
                )
                loss_sum = loss_sum + train_micro_step(components, batch)
        watchdog.at(step, d.grad_accum)
        measure = (  # the gradient norm, on the steps that log or save it
            step % config.log_every == 0 or step % config.checkpoint_every == 0 or step == config.max_steps
        )
        result = optimizer_step(components, loss_sum, stop_request.signum, measure)  # votes on the stop
        state["step"] = step
        state["applied_steps"] += int(result.applied)
        progress.update(1)
        steplog.record(result)
        if config.debug_checksums:
            log.info(f"checksum step {step} {parameter_checksum(components.raw_model)}")

        if result.skipped == SCALER_OVERFLOW:  # fp16's GradScaler lowered its scale: routine, not a NaN
            log.info(f"step {step}: fp16 gradients overflowed; the loss scaler skipped the step")
        # The NaN policy: the step was not applied on any rank; stop, or skip it (boundedly).
        if result.skipped == NON_FINITE:
            state["skipped_steps"] += 1
            if config.nan_policy == "abort":
                raise stop(
                    f"non-finite loss or gradient at step {step} (loss {result.loss}, grad norm "
                    f"{result.grad_norm}); the step was not applied and the run stopped; lower --lr or set "
                    f"--grad-clip, or pass --nan-policy skip"
                )
            log.warning(
                f"non-finite loss or gradient at step {step}: skipped ({state['skipped_steps']} skipped so "
                f"far, at most {config.max_skipped_steps})"
            )
            if state["skipped_steps"] > config.max_skipped_steps:
                raise stop(
                    f"{state['skipped_steps']} steps had a non-finite loss or gradient, more than "
                    f"--max-skipped-steps {config.max_skipped_steps}; stopped at step {step}"
                )

        if step % config.log_every == 0 or step == config.max_steps:
            loss = steplog.write(step, result, state["skipped_steps"])
            progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
        preempted = bool(result.stop_ranks) and step < config.max_steps  # every rank saves this step, exits
        if evaluation.due(step) and not preempted:  # before the checkpoint: its metrics.jsonl holds the line
            result.stop_signum = evaluation.run(step, components, stop_request)  # a stop cuts it short
            preempted = bool(result.stop_signum) and step < config.max_steps
        if preempted or config.saves_checkpoint_at(step):
            last_good = checkpointer.save(step, dict(state, **order.position(step)))
            log.info(f"checkpoint {last_good}")
        if samples.due(step) and not preempted:
            samples.write(step)
        if preempted:
            finish()
            raise Preempted(preempted_message(result.stop_signum, step, last_good))

    log.info(f"done: step {state['step']}, {state['skipped_steps']} skipped; newest checkpoint {last_good}")
    finish()
    return 0


@exits_cleanly("dit_accel.train")
def _main(argv) -> int:
    if "LOCAL_RANK" in os.environ:  # a launcher's rank: end with the launcher, never train on orphaned
        die_with_parent()
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = parse_config(argv)
    except USER_ERRORS as error:
        write_exit_record(EXIT_USER, str(error))
        raise
    stop_request = StopRequest().install(parse_signals(config.preempt_signals))
    try:
        with cpu_threads():
            return train(config, stop_request)
    except USER_ERRORS as error:
        write_exit_record(EXIT_USER, str(error))
        if rank == 0:
            raise
        # Set-up errors are every rank's (rank 0 says it once); one in the loop may be this rank's alone.
        if stop_request.in_loop and not getattr(error, "on_every_rank", False):
            print(f"dit_accel.train: [rank {rank}] error: {error}", file=sys.stderr)
        log.error(str(error), extra={"file_only": True})
        return EXIT_USER
    except TrainingStopped as stopped:
        if rank == 0:  # every rank stops; one says why
            print(f"dit_accel.train: stopped: {stopped}", file=sys.stderr)
        log.error(str(stopped), extra={"file_only": True})
        write_exit_record(EXIT_STOPPED, str(stopped))
        return EXIT_STOPPED
    except Preempted as preempted:
        if rank == 0:
            print(f"dit_accel.train: {preempted}", file=sys.stderr, flush=True)
        log.warning(str(preempted), extra={"file_only": True})
        write_exit_record(EXIT_PREEMPTED, str(preempted))
        return EXIT_PREEMPTED
    except RuntimeError as error:
        from dit_accel.distributed.accelerator import lost_peer_message

        message = lost_peer_message(error, config.output_dir)  # another rank died: its error is the story
        if message is None:
            raise
        print(f"dit_accel.train: [rank {rank}] {message}", file=sys.stderr)
        log.error(message, extra={"file_only": True})
        write_exit_record(1, message)
        return 1
    finally:
        stop_request.close()
        release_run_folder()  # RUN/run.lock; a killed run's is taken over by the next (dit_accel.run.lock)


main = _main  # main(argv=None) -> exit code
