"""Can this node's CPUs decode images as fast as the plan trains?

An online or pixel plan reads every image at every step, and so does REPA from a latent cache (its encoder
sees each latent's source image): the DataLoader workers read, decode and crop them, and a node whose CPUs
cannot keep up leaves the GPUs waiting, a slowdown no GPU-side figure shows.
The check times that work on a sample of the run's own images, on one core of this node, and sets it
against the plan's images/s per node and the cores the run's workers and ranks leave for it. (fast-DiT's
published two-GPU runs, docs/planner-accuracy.md, ran on two usable CPUs per rank.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dit_accel.doctor.checks import Check, passed, warned
from dit_accel.doctor.plan import PlanFacts
from dit_accel.errors import UserError

GROUP = "data"
NAME = "decode rate"
SAMPLE_IMAGES = 16  # spread over the listing: a few seconds at most, even for large photographs
MAIN_PROCESS_SHARE = 0.05  # with 0 workers, decoding up to this share of each step is not worth a warning


@dataclass(frozen=True)
class DecodeBudget:
    """What the plan asks of one node's CPUs, and what the run gives them."""

    images_per_s: float  # the plan's estimate for the node's ranks together
    ranks: int
    workers_per_rank: int
    cpus: int  # usable by this process (its affinity), as the trainer counts them


def decode_budget(plan: PlanFacts, cpus: int, workers_per_rank: int) -> DecodeBudget | None:
    """None for a plan whose workers decode no images (latents, without REPA), or one without a throughput
    estimate."""
    throughput = plan.plan.throughput if plan.plan else None
    reads_images = plan.latents != "precomputed" or bool(plan.plan and plan.plan.decision.repa)
    if not reads_images or throughput is None or not throughput.est_images_per_s:
        return None
    return DecodeBudget(
        images_per_s=throughput.est_images_per_s / max(plan.nodes, 1),
        ranks=plan.gpus_per_node,
        workers_per_rank=workers_per_rank,
        cpus=cpus,
    )


def spread(length: int, count: int = SAMPLE_IMAGES) -> list[int]:
    """`count` entries spread over `length` (all of them when there are fewer)."""
    step = max(1, length // count)
    return list(range(step // 2, length, step))[:count]


def seconds_per_image(pixels: Callable[[int, bool], object], length: int) -> tuple[float, int] | None:
    """Mean seconds of `pixels(index, mirrored)` (the workers' read, decode, crop and float of one entry) on one
    core (a worker's torch runs one thread too), over entries spread across `length`; None when none reads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        elapsed_s, timed = 0.0, 0
        for position, index in enumerate(spread(length)):
            started = time.perf_counter()
            try:
                pixels(index, bool(position % 2))
            except UserError:
                continue  # the decoding rows report unreadable images
            if position:  # the first warms the decoder's libraries up
                elapsed_s += time.perf_counter() - started
                timed += 1
        return (elapsed_s / timed, timed) if timed else None
    finally:
        torch.set_num_threads(threads)


def listing_pixels(listing, resolution: int) -> Callable[[int, bool], object]:
    """An image folder's or dataset's entries as the trainer's workers hand them over."""
    from dit_accel.data.folder import training_pixels

    return lambda index, mirrored: training_pixels(listing.load(index), resolution, mirrored)


def check_decode_rate(
    pixels: Callable[[int, bool], object], length: int, budget: DecodeBudget
) -> Check | None:
    measured = seconds_per_image(pixels, length)
    if measured is None:
        return None
    seconds, timed = measured
    need = budget.images_per_s * seconds  # cores busy decoding, for the node's ranks together
    workers = budget.ranks * budget.workers_per_rank
    spare = budget.cpus - budget.ranks  # each rank's own process keeps a core busy driving its GPU
    figures = (
        f"{seconds * 1e3:.1f} ms per image on one core here (read, decode, crop; {timed} sampled): the plan's "
        f"{budget.images_per_s:.0f} img/s per node needs {need:.1f} cores"
    )
    precompute = (
        "precompute latents (`dit-accel extract-latents`, then a plan made with --latents precomputed)"
    )
    if need > spare:
        return warned(
            GROUP,
            NAME,
            f"{figures}, more than the {max(spare, 0)} CPUs beside its {budget.ranks} ranks: the GPUs will "
            "wait for images",
            f"{precompute}, or more CPUs for the job (Slurm: --cpus-per-task)",
        )
    per_rank = math.ceil(need / budget.ranks)
    if workers == 0:
        share = need / budget.ranks
        if share <= MAIN_PROCESS_SHARE:
            return passed(GROUP, NAME, f"{figures}; each rank decodes its own (--num-workers 0)")
        return warned(
            GROUP,
            NAME,
            f"{figures}; with --num-workers 0 each rank decodes between its steps, adding about "
            f"{share:.0%} to each",
            f"use --num-workers {per_rank} (per rank), or {precompute}",
        )
    if need > workers:
        return warned(
            GROUP,
            NAME,
            f"{figures}, more than its {workers} workers ({budget.ranks} ranks x {budget.workers_per_rank})",
            f"use --num-workers {per_rank} (per rank), or {precompute}",
        )
    return passed(GROUP, NAME, f"{figures} of its {workers} workers")
