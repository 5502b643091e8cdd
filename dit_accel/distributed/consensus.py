"""Decisions one process takes and every rank follows, without a hang.

A check that reads or writes the shared run folder (the run lock, which checkpoint is intact) is made once,
by the main process; every rank then reaches the same single broadcast whatever the main process found, so
a refusal ends every rank with the same one-line error instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

from dit_accel.errors import UserError


def main_decides(accelerator, decide):
    """`decide()` on the main process only; its result (or its UserError, raised on every rank) for all.
    Without an accelerator (tests, one process) `decide()` simply runs here."""
    if accelerator is None or accelerator.num_processes == 1:
        return decide()
    outcome = [None]
    failure = None
    if accelerator.is_main_process:
        try:
            outcome = [("ok", decide())]
        except UserError as error:
            outcome = [("user", error.problem, error.fix)]
        except Exception as error:  # a bug: the main process re-raises it, the others stop too
            outcome, failure = [("bug", repr(error))], error
    from accelerate.utils import broadcast_object_list

    broadcast_object_list(outcome, from_process=0)
    kind, *rest = outcome[0]
    if kind == "ok":
        return rest[0]
    if kind == "user":
        raise agreed(UserError(*rest))
    if failure is not None:
        raise failure
    raise RuntimeError(f"the main process failed: {rest[0]} (see its log)")


def gathered(accelerator, value) -> list:
    """Every rank's `value`, in rank order, on every rank (one collective; all ranks must call it)."""
    if accelerator is None or accelerator.num_processes == 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def stop_vote(accelerator, signum: int) -> int:
    """The stop signal some rank was sent (the highest number when several), 0 when none: one collective,
    which every rank must reach at the same point (a loop outside the training step votes as the step does)."""
    if accelerator is None or accelerator.num_processes == 1:
        return signum
    import torch
    import torch.distributed as dist

    vote = torch.tensor([signum], dtype=torch.int64, device=accelerator.device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return int(vote.item())


def agreed(error: BaseException) -> BaseException:
    """`error`, which every rank is about to raise alike, after this rank has left the process group: no
    collective follows, and a rank that exits while a peer's gloo threads still expect it would otherwise
    die in their teardown (SIGABRT, "terminate called without an active exception") instead of exiting 2.
    Marked `on_every_rank`: rank 0 says it once, also when it happens in the training loop (a full disk),
    where a rank's own error (a bad image only it reads) is printed by that rank."""
    from dit_accel.distributed.accelerator import end_process_group

    end_process_group()
    error.on_every_rank = True
    return error
