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
from dit_accel.train.config import most_workers_per_rank

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
    """`count` entries spread evenly over `length` (all of them when there are fewer), each the middle of its
    share."""
    return (
        [(2 * i + 1) * length // (2 * count) for i in range(count)] if length > count else list(range(length))
    )


@dataclass(frozen=True)
class DecodeTiming:
    seconds: float  # mean per image, on one core
    timed: int
    unreadable: list[str]  # UserError problems of sampled entries that did not read or decode


def seconds_per_image(pixels: Callable[[int, bool], object], length: int) -> DecodeTiming | None:
    """Mean seconds of `pixels(index, mirrored)` (the workers' read, decode, crop and float of one entry) on one
    core (a worker's torch runs one thread too), over entries spread across `length`, the first that decodes
    untimed (it warms the decoder's libraries up); None when fewer than two decode."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        elapsed_s, decoded, unreadable = 0.0, 0, []
        for position, index in enumerate(spread(length)):
            started = time.perf_counter()
            try:
                pixels(index, bool(position % 2))
            except UserError as error:
                unreadable.append(error.problem)
                continue
            if decoded:
                elapsed_s += time.perf_counter() - started
            decoded += 1
        timed = decoded - 1
        return DecodeTiming(elapsed_s / timed, timed, unreadable) if timed > 0 else None
    finally:
        torch.set_num_threads(threads)


def listing_pixels(listing, resolution: int) -> Callable[[int, bool], object]:
    """An image folder's or dataset's entries as the trainer's workers hand them over."""
    from dit_accel.data.folder import training_pixels

    return lambda index, mirrored: training_pixels(listing.load(index), resolution, mirrored)


PRECOMPUTE = "precompute latents (`dit-accel extract-latents`, then a plan made with --latents precomputed)"


def check_decode_rate(
    pixels: Callable[[int, bool], object], length: int, budget: DecodeBudget
) -> Check | None:
    """The decode timed here (`seconds_per_image`), then judged (`judge_decode_rate`): apart, so that the
    judgment is tested on given timings, never on how busy the machine running the tests is."""
    timing = seconds_per_image(pixels, length)
    return judge_decode_rate(timing, budget) if timing is not None else None


def judge_decode_rate(timing: DecodeTiming, budget: DecodeBudget) -> Check:
    """The row for a measured decode time against what the plan asks of the node."""
    need = budget.images_per_s * timing.seconds  # cores busy decoding, for the node's ranks together
    ranks, workers = budget.ranks, budget.ranks * budget.workers_per_rank
    spare = budget.cpus - ranks  # each rank's own process keeps a core busy driving its GPU
    figures = (
        f"{timing.seconds * 1e3:.1f} ms per image on one core here (read, decode, crop; {timing.timed} "
        f"sampled): the plan's {budget.images_per_s:.0f} img/s per node needs {need:.1f} cores"
    )
    if timing.unreadable:
        return warned(
            GROUP,
            NAME,
            f"{figures}; {len(timing.unreadable)} more of the sample do not decode: {timing.unreadable[0]}",
            "replace or delete them (`--full` finds every one), or train with --skip-bad-images",
        )
    most = most_workers_per_rank(ranks, budget.cpus)  # the `host / CPUs` row's rule, and the trainer's
    wanted = math.ceil(need / ranks)
    more_workers = (
        f"use --num-workers {min(wanted, most)} (per rank), or " if most > budget.workers_per_rank else ""
    )
    if workers == 0:
        share = need / ranks
        if share <= MAIN_PROCESS_SHARE:
            return passed(GROUP, NAME, f"{figures}; each rank decodes its own (--num-workers 0)")
        return warned(
            GROUP,
            NAME,
            f"{figures}; with --num-workers 0 each rank decodes between its steps, adding about "
            f"{share:.0%} to each",
            more_workers + PRECOMPUTE,
        )
    if need > spare:
        return warned(
            GROUP,
            NAME,
            f"{figures}, more than the {max(spare, 0)} CPUs beside its {ranks} ranks: the GPUs will wait "
            "for images",
            f"{PRECOMPUTE}, or more CPUs for the job (Slurm: --cpus-per-task)",
        )
    if need > workers:
        return warned(
            GROUP,
            NAME,
            f"{figures}, more than its {workers} workers ({ranks} ranks x {budget.workers_per_rank})",
            more_workers + PRECOMPUTE,
        )
    return passed(GROUP, NAME, f"{figures} of its {workers} workers")
