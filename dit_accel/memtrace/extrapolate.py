"""Extrapolation per block: the step's peaks at the plan's depth from traces of a few blocks.

Every block of one kind (stored or checkpointed) adds the same live storages, so each structural moment of
the step (first, second or last block of a run, the head, the optimizer step) grows linearly with the block
counts: three shallow traces give it exactly, not as a fit.
"""

from __future__ import annotations

from collections.abc import Hashable

from dit_accel.memtrace.tracker import COMPONENTS, StorageTracker


def _segments(checkpointed: list) -> list[tuple[int, int, bool]]:
    """Runs of blocks of one kind, in forward order: (start, end, checkpointed)."""
    runs = []
    for index, kind in enumerate(checkpointed):
        if runs and runs[-1][2] == bool(kind):
            runs[-1] = (runs[-1][0], index + 1, bool(kind))
        else:
            runs.append((index, index + 1, bool(kind)))
    return runs


def _roles(window: Hashable, checkpointed: list) -> list[Hashable]:
    """The structural roles a window plays, independent of how many blocks each run holds.

    Within a run of same-kind blocks, every block after the first adds the same live storages, so the
    local peaks along the run are a line: its maximum is at the first, second or last block (the first
    may differ: it shares its input with whatever precedes the run). Other blocks need no role.
    """
    if window[0] not in ("fwd", "bwd"):
        return [window]
    phase, step, micro, index = window
    for run, (start, end, kind) in enumerate(_segments(checkpointed)):
        if start <= index < end:
            order = list(range(start, end)) if phase == "fwd" else list(range(end - 1, start - 1, -1))
            position = order.index(index)
            roles = []
            if position == 0:
                roles.append("first")
            if position == 1:
                roles.append("second")
            if position == len(order) - 1:
                roles.append("last")
            return [(phase, step, micro, run, kind, role) for role in roles]
    raise AssertionError(f"block {index} is outside the model")


def role_peaks(tracker: StorageTracker, checkpointed: list) -> dict[Hashable, tuple[int, dict[str, int]]]:
    peaks = {}
    for window, value in tracker.window_peaks.items():
        for role in _roles(window, checkpointed):
            peaks[role] = value
    return peaks


Counts = tuple  # (plain blocks, checkpointed blocks)


def _vector(value: tuple[int, dict[str, int]]) -> list[int]:
    return [value[0]] + [value[1][name] for name in COMPONENTS]


def extrapolate(
    samples: dict[Counts, dict[Hashable, tuple[int, dict[str, int]]]], target: Counts, base: Counts
) -> dict[Hashable, tuple[int, dict[str, int]]]:
    """Role peaks at `target` block counts from traces at `base` and at base plus one block of each kind.

    Every role's live storages are a sum over blocks, so each role's bytes (total and each component) are
    exactly linear in (plain blocks, checkpointed blocks): value(target) = value(base) + sum over kinds of
    (target - base) x (value(base + 1 of that kind) - value(base)).
    """
    result = {}
    for role, value in samples[base].items():
        vector = _vector(value)
        for kind in (0, 1):
            extra = target[kind] - base[kind]
            if extra == 0:
                continue
            bumped = list(base)
            bumped[kind] += 1
            other = samples[tuple(bumped)].get(role)
            if other is None:
                raise AssertionError(f"role {role} missing from the trace with {tuple(bumped)} blocks")
            vector = [v + extra * (o - b) for v, o, b in zip(vector, _vector(other), _vector(value))]
        result[role] = (vector[0], dict(zip(COMPONENTS, vector[1:])))
    return result


def trace_plan_counts(target: Counts) -> tuple[Counts, list[Counts]]:
    """The shallow block counts to trace for a target: a base of up to two blocks of each kind present,
    and the base plus one block of each kind that the target has more of."""
    base = tuple(min(n, 2) for n in target)
    extra = []
    for kind in (0, 1):
        if target[kind] > base[kind]:
            bumped = list(base)
            bumped[kind] += 1
            extra.append(tuple(bumped))
    return base, [base] + extra


def _block_of_role(role: Hashable, checkpointed: list) -> Hashable:
    """The block window (phase, step, micro, block index) that plays `role` in a network whose blocks,
    in forward order, are `checkpointed`; other windows are returned as they are."""
    if role[0] not in ("fwd", "bwd") or len(role) == 4:
        return role
    phase, step, micro, run, _, position = role
    start, end, _ = _segments(checkpointed)[run]
    order = list(range(start, end)) if phase == "fwd" else list(range(end - 1, start - 1, -1))
    return (phase, step, micro, order[{"first": 0, "second": 1, "last": -1}[position]])


def planner_moment(window: Hashable, components: dict[str, int], depth: int) -> str:
    """The planner's moment (planner.components.PHASES) that a traced peak in `window` is, or "" if none.

    The final layer's window runs the loss and then starts backward: before backward nothing is a temporary.
    """
    kind = window[0]
    if kind == "head":
        return "start_of_backward" if components.get("temporaries") else "end_of_forward"
    if kind == "fwd" and window[3] == depth - 1:
        return "last_block_forward"
    if kind == "bwd":
        return {depth - 1: "start_of_backward", 0: "end_of_backward"}.get(window[3], "")
    if kind == "opt":
        return "optimizer_step"
    if kind == "pre" and components.get("vae"):
        return "vae_encode"
    return ""


def _describe(window: Hashable) -> str:
    kind = window[0]
    if kind == "setup":
        return "before the first step"
    if kind == "end":
        return "after the last step"
    if kind == "opt":
        return f"optimizer step {window[1] + 1}"
    step, micro = window[1] + 1, window[2] + 1
    where = f"(step {step}, micro-step {micro})"
    if kind == "pre":
        return f"input and embedding {where}"
    if kind == "head":
        return f"final layer, loss and start of backward {where}"
    return f"{'forward' if kind == 'fwd' else 'backward'} of block {window[3]} {where}"
