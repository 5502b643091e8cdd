"""`--eval-every N`: FID and Inception Score of the EMA while training, to metrics.jsonl and the trackers.

At every step that is a multiple of N (never step 0), every rank samples its share of `--eval-samples`
images from the EMA (the raw weights when the plan has no EMA) with the sampler `dit-accel sample` uses by
default (ddpm: DDPM on DiT's evenly respaced chain; flow: the probability-flow ODE, Heun), labels balanced
over the classes and sample i seeded from (seed, i), exactly as `sample --evaluate` makes them: the same
checkpoint scored by `dit-accel sample --evaluate` with the same settings gives the same numbers. The
images go straight to each rank's Inception features (dit_accel.evaluate.Scorer); the features are gathered
and FID and IS computed on the main process against `--eval-reference`, whose statistics are read (or
computed and cached) once, when the run starts. The line `{"step": N, "eval/fid": ..., "eval/is": ...}`
goes to metrics.jsonl before that step's checkpoint is written, so the checkpoint's copy holds it.

Under FSDP2 every rank gathers the full EMA (a collective, as train_samples does for its grid) and samples
from an unsharded copy: about 8 bytes per parameter more on every rank while the evaluation runs, memory the
plan does not count. dit-plan --eval-every adds the sampling time to the time to train.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

log = logging.getLogger("dit_accel.train")


def eval_settings(config, plan):
    """The sampler of the run's evaluations: `dit-accel sample`'s default for the run's objective (--objective,
    else the plan's: made before build_components resolves it into the config)."""
    from dit_accel.sample.generate import SampleSettings
    from dit_accel.train.step import run_objective

    return SampleSettings(
        cfg_scale=config.eval_cfg_scale,
        steps=config.eval_steps,
        seed=config.seed,
        sampler="ode" if run_objective(plan, config) == "flow" else "ddpm",
        flow_path=config.flow_path,
    )


class TrainingEval:
    """Made before any training step: the Inception weights, the reference and the VAE are loaded then, so
    a missing file is refused in one line before the run trains (on every rank alike)."""

    def __init__(self, config, plan, spec, accelerator, run_dir: Path, watchdog=None):
        self.every, self.accelerator, self.spec = config.eval_every, accelerator, spec
        self.watchdog, self.grad_accum = watchdog, plan.decision.grad_accum
        self.metrics_path = run_dir / "metrics.jsonl"
        if not self.every:
            return
        from dit_accel.evaluate.evaluator import Scorer
        from dit_accel.evaluate.features import shard
        from dit_accel.sample.generate import balanced_labels, load_decoder
        from dit_accel.train.samples import run_latent_norm, run_vae_path

        self.settings = eval_settings(config, plan)
        self.batch_size = plan.decision.micro_batch
        self.scorer = Scorer(
            accelerator,
            config.eval_reference,
            config.inception_weights,
            cache_dir=None,
            input_px=config.eval_input_px,
            num_samples=config.eval_samples,
            image_px=spec.resolution,
            reference_flag="--eval-reference",
        )
        self.labels = balanced_labels(config.eval_samples, spec.num_classes, config.seed)
        self.mine = shard(config.eval_samples, accelerator.process_index, accelerator.num_processes)
        norm = run_latent_norm(config, plan)
        self.decoder = load_decoder(
            spec, run_vae_path(config, plan), accelerator.device, norm, config.latent_stats
        )

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def weights(self, components) -> dict[str, torch.Tensor]:
        """Full fp32 tensors by name; every rank calls this (a collective under FSDP2)."""
        from dit_accel.distributed.fsdp import full_tensor

        if components.ema is not None:
            return components.ema.state_dict()
        return {name: full_tensor(p.detach()).float() for name, p in components.raw_model.named_parameters()}

    def network(self, components, weights: dict) -> torch.nn.Module:
        """An unsharded inference copy of the DiT with `weights` (the EMA is of the DiT alone, no projector)."""
        from dit_accel.models.dit import build_model, set_timestep_freq_shift, timestep_freq_shift

        model = build_model(self.spec, init="torch").to(components.device).eval()
        set_timestep_freq_shift(model, timestep_freq_shift(components.raw_model))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor.to(params[name].device))
        return model

    def run(self, step: int, components, stop_request=None) -> int:
        """Every rank calls this at the same step; the metrics go to metrics.jsonl and the trackers. Returns
        the stop signal that cut it short, 0 when it ran to its end.

        A stop signal must reach the checkpoint within a cluster's grace period whatever the loop is doing,
        and 10,000 samples at 250 steps take longer than that: before each batch every rank votes on a stop
        (`stop_vote`, as the training step does), for as many rounds as the largest share has batches, and
        a stop ends the evaluation there, unscored, for the loop to save and exit."""
        from dit_accel.distributed.consensus import stop_vote
        from dit_accel.sample.generate import sample_images

        started = time.perf_counter()
        model = self.network(components, self.weights(components))
        rounds = math.ceil(math.ceil(len(self.labels) / self.accelerator.num_processes) / self.batch_size)
        log.info(f"eval step {step}: sampling {len(self.labels):,} images, {rounds} batches per rank")
        for round_index in range(rounds):
            signum = stop_vote(self.accelerator, stop_request.signum if stop_request else 0)
            if signum:
                self.scorer.collector = self.scorer.evaluator.collector()  # what was added is dropped
                log.info(f"eval step {step}: stopped by a signal after {round_index} of {rounds} batches")
                return signum
            start = self.mine.start + round_index * self.batch_size
            indices = range(start, min(start + self.batch_size, self.mine.stop))
            if len(indices):  # a smaller share has run out: it still votes
                labels = self.labels[indices.start : indices.stop]
                images = sample_images(
                    model, self.spec, self.decoder, labels, indices, self.settings, device=components.device
                )
                self.scorer.add(images, indices)
            if self.watchdog is not None:  # progress: a long evaluation is no stuck rank
                self.watchdog.at(step, self.grad_accum)
        del model
        scores = self.scorer.scores()  # gathered on every rank, computed on the main process
        metrics = None
        if scores is not None:
            metrics = {"step": step, "eval/fid": scores["fid"], "eval/is": scores["inception_score"]}
            log.info(
                f"eval step {step}: FID {scores['fid']:.4f} ({scores['num_samples']:,} samples vs "
                f"{self.scorer.reference.describe()}), IS {scores['inception_score']:.4f}; "
                f"{self.settings.sampler} {self.settings.steps} steps, cfg {self.settings.cfg_scale:g}, "
                f"{time.perf_counter() - started:.1f} s"
            )
            if not all(math.isfinite(metrics[key]) for key in ("eval/fid", "eval/is")):
                log.warning(f"eval step {step}: a non-finite score (the EMA's samples may be NaN)")
            if self.accelerator.log_with:
                self.accelerator.log({key: metrics[key] for key in ("eval/fid", "eval/is")}, step=step)
            metrics["eval/num_samples"] = scores["num_samples"]
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
        self.accelerator.wait_for_everyone()
        return 0
