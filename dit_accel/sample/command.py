"""`dit-accel sample`: class-conditional samples from a trained (or imported) DiT.

Two outputs, one code path:
  --out grid.png            a PNG grid plus every image alone in grid_images/ (for looking at)
  --num-samples N --npz F   the evaluation batch for the ADM/DiT FID evaluator: F.npz with `arr_0`
                            (N, H, W, 3) uint8 and `arr_1` (N,) int64 labels, made by every process of
                            `accelerate launch`, resumable shard by shard.
  --evaluate REF.npz        the same batch scored as it is made (dit_accel.evaluate: each rank's images go
                            straight to its Inception features), with or without --npz.

Reproducibility rule: sample i (its global index) starts from noise drawn with its own generator, seeded
from (seed, i), and every later noise draw of the sampler for that sample comes from the same generator.
So a sample does not depend on which process made it, on the batch it was in, or on how many processes
ran; only on (checkpoint, seed, i, label, sampler settings). The labels of an evaluation batch are
balanced (N spread evenly over the classes) and shuffled by a permutation fixed by the seed.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from dit_accel.cpu_threads import cpu_threads
from dit_accel.distributed.accelerator import set_tf32
from dit_accel.errors import UserError, exits_cleanly
from dit_accel.evaluate import PAPER_SAMPLES
from dit_accel.sample.args import (
    apply_protocol,
    build_parser,
    check_sampler_flags,
)
from dit_accel.sample.eval_batch import EvalBatch
from dit_accel.sample.generate import (
    SampleSettings,
    Source,
    default_spacing,
    default_vae_path,
    grid_class_names,
    grid_labels,
    label_rows,
    load_decoder,
    load_source,
    sample_images,
    sampler_for,
    warn_about_the_ema,
)


def parse_classes(text: str, num_classes: int) -> list[int]:
    try:
        classes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(
            f"--classes must be comma-separated class indices like 207,360,387, got {text!r}"
        ) from None
    if not classes:
        raise UserError("--classes is empty: give class indices like 207,360,387")
    bad = [label for label in classes if not 0 <= label < num_classes]
    if bad:
        raise UserError(f"--classes {bad} out of range: this model has classes 0..{num_classes - 1}")
    return classes


# --- the command --------------------------------------------------------------------------------------------
# The classes the DiT paper shows (sample.py of the reference): used when an ImageNet-1k model gets no --classes.
IMAGENET_SHOWCASE = (207, 360, 387, 974, 88, 979, 417, 279)


def _check_args(args) -> None:
    batch = args.npz is not None or args.evaluate is not None  # the evaluation batch, kept and/or scored
    if (args.out is None) != batch:
        raise UserError(
            "pass exactly one of --out grid.png (a grid to look at) or --npz samples.npz and/or --evaluate "
            "REF.npz (the FID evaluation batch, kept and/or scored)"
        )
    if args.num_samples is not None and not batch:
        raise UserError(
            "--num-samples is for the evaluation batch: add --npz samples.npz or --evaluate REF.npz"
        )
    if batch and args.num_samples is None:
        args.num_samples = PAPER_SAMPLES
    for flag in ("per_class", "batch_size", "num_samples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.out is not None and not args.out.lower().endswith(".png"):
        raise UserError(f"--out {args.out} must name a .png file (the grid)", "singles go next to it")
    if args.out is not None and Path(args.out).exists() and not args.overwrite:  # as --npz refuses one
        raise UserError(
            f"{args.out} already exists", "delete it, choose another --out, or pass --overwrite to replace it"
        )
    if args.plumbing_check and not args.evaluate:
        raise UserError(
            "--plumbing-check is --evaluate's", "add --evaluate REF.npz, or drop --plumbing-check"
        )
    if args.labels is not None and not batch:
        raise UserError("--labels is for the evaluation batch: a grid has one row per --classes entry")
    args.overrides = apply_protocol(args)


def _settings(args, default_cfg: float, source: Source) -> SampleSettings:
    from dit_accel.run.weights import recorded_objective

    objective = recorded_objective(source.info["checkpoint"])
    sampler = sampler_for(objective, args.sampler)
    check_sampler_flags(args, sampler)
    return SampleSettings(
        cfg_scale=default_cfg if args.cfg_scale is None else args.cfg_scale,
        steps=args.steps,
        sampler=sampler,
        guidance=args.guidance,
        seed=args.seed,
        ode_solver=args.ode_solver,
        diffusion_form=args.diffusion_form,
        diffusion_norm=args.diffusion_norm,
        cfg_low=args.cfg_interval[0],
        cfg_high=args.cfg_interval[1],
        flow_path=objective.get("path", "linear"),
        time_shift=args.time_shift,
        labels=args.labels,
        tf32=args.tf32,
    )


def _classes(args, spec, for_grid: bool) -> list[int]:
    if args.classes is not None:
        return parse_classes(args.classes, spec.num_classes)
    if not for_grid:
        return list(range(spec.num_classes))
    return list(IMAGENET_SHOWCASE) if spec.num_classes == 1000 else list(range(min(8, spec.num_classes)))


def sample_grid(args) -> int:
    from dit_accel.images import grid_columns, make_grid, save_grid_and_singles, save_png
    from dit_accel.progress import progress_bar

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    source = load_source(args.checkpoint, use_ema=args.ema, device=device)
    decoder = load_decoder(
        source.spec, args.vae or default_vae_path(source), device, source.latent_norm, args.latent_stats
    )
    settings = _settings(args, default_cfg=4.0, source=source)
    set_tf32(settings.tf32, device)
    classes = _classes(args, source.spec, for_grid=True)
    labels = grid_labels(classes, args.per_class)
    names = grid_class_names(source) if args.row_labels else None
    warn_about_the_ema(source)

    batches = []
    starts = range(0, len(labels), args.batch_size)
    # a grid on a CPU takes minutes: the batches and each one's denoising steps show on stderr
    for start in progress_bar(starts, desc=f"grid of {len(labels)}", unit="batch"):
        indices = range(start, min(start + args.batch_size, len(labels)))
        batches.append(
            sample_images(
                source.model,
                source.spec,
                decoder,
                labels[start : indices.stop],
                indices,
                settings,
                args.spacing,
                device,
                progress=True,
            )
        )
    images = np.concatenate(batches)
    columns = args.per_class if names else grid_columns(len(labels), args.per_class)
    grid_path, singles = save_grid_and_singles(images, labels, args.out, columns)
    if names:  # rows named by class: the grid written again, with its margin
        row_names = [names[c] if c < len(names) else str(c) for c in classes]
        save_png(label_rows(make_grid(images, columns), row_names, images.shape[1]), grid_path)
    print(
        f"wrote {grid_path} ({len(labels)} samples, {settings.sampler} {settings.steps} steps, cfg {settings.cfg_scale}, "
        f"{source.info['weights']} weights) and {len(labels)} single images in {singles}/"
    )
    return 0


def sample_eval_batch(args) -> int:
    from accelerate import Accelerator

    from dit_accel.evaluate.evaluator import Scorer
    from dit_accel.progress import progress_bar

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    npz_path = Path(args.npz) if args.npz else None
    if npz_path and npz_path.exists():
        raise UserError(f"{npz_path} already exists: delete it, or choose another --npz")
    for flag, path in (("--npz", npz_path), ("--results", args.evaluate and Path(args.results))):
        if path and not path.parent.is_dir():
            raise UserError(f"the folder of {flag} {path} does not exist: create {path.parent} first")
    source = load_source(args.checkpoint, use_ema=args.ema, device=accelerator.device)
    # the reference checked whole (its side against the model's, its statistics) before any sample is made
    scorer = Scorer.from_flags(accelerator, args, source.spec.resolution) if args.evaluate else None
    vae_path = args.vae or default_vae_path(source)
    decoder = load_decoder(source.spec, vae_path, accelerator.device, source.latent_norm, args.latent_stats)
    settings = _settings(args, default_cfg=1.5, source=source)
    set_tf32(settings.tf32, accelerator.device)
    job = EvalBatch(
        npz_path,
        args.num_samples,
        args.batch_size,
        tuple(_classes(args, source.spec, for_grid=False)),
        settings.seed,
        settings.labels,
    )
    fingerprint = {
        **asdict(settings),
        "spacing": args.spacing or default_spacing(settings.sampler),
        "checkpoint": source.info["checkpoint"],
        "weights": source.info["weights"],
        "step": source.info.get("step"),
        "vae": decoder.source,
        "num_samples": job.num_samples,
        "batch_size": job.batch_size,
        "classes": list(job.classes),
        **({"protocol": args.protocol, "overrides": args.overrides} if args.protocol else {}),
    }
    if npz_path:  # every rank refuses foreign shards before any work
        job.check_or_write_settings(fingerprint, write=False)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if npz_path:
            job.check_or_write_settings(fingerprint, write=True)
        warn_about_the_ema(source)
    accelerator.wait_for_everyone()

    mine = job.batches_for_rank(accelerator.process_index, accelerator.num_processes)
    where = (args.spacing, accelerator.device)
    done = {batch for batch in mine if npz_path and job.shard_is_done(batch)}
    for batch in progress_bar(  # a resumed --evaluate reads the batches already made back for their features
        mine if scorer else [batch for batch in mine if batch not in done],
        desc="batches",
        unit="batch",
        disable=not accelerator.is_local_main_process,
    ):
        indices = job.indices(batch)
        labels = job.labels[indices.start : indices.stop]
        if batch in done:
            images = job.read_shard(batch)
        else:
            images = sample_images(source.model, source.spec, decoder, labels, indices, settings, *where)
        if npz_path and batch not in done:
            job.save_shard(batch, images, labels)
        if scorer:
            scorer.add(images, indices)
    print(
        f"rank {accelerator.process_index}: {len(mine) - len(done)} batches made, {len(done)} already done",
        flush=True,
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and npz_path:
        job.assemble()
        counts = np.bincount(job.labels, minlength=max(job.classes) + 1)[list(job.classes)]
        print(
            f"wrote {npz_path}: arr_0 {job.num_samples} images, arr_1 labels ({len(job.classes)} classes, "
            f"{counts.min()}-{counts.max()} each), {settings.sampler} {settings.steps} steps, cfg {settings.cfg_scale}"
        )
    if scorer:
        kept = str(npz_path) if npz_path else f"sampled from {source.info['checkpoint']}, not kept"
        scorer.finish(args.results, {"samples": kept, "sampling": fingerprint})
    accelerator.wait_for_everyone()
    return 0


@exits_cleanly("dit-accel sample")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    with cpu_threads():
        return sample_eval_batch(args) if args.out is None else sample_grid(args)
