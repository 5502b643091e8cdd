"""Charts of a plan: plan/memory.png (memory per component against the budget, and the step's moments) and
`dit-plan --plot FILE` (peak memory and images/s across a sweep or across the candidates of one plan).

matplotlib (and so numpy) is imported inside the functions, with the Agg backend, so that planning and the
tables never pay for it. Charts are rendered to bytes: planner/outputs.py writes them with the other files.
"""

from __future__ import annotations

import dataclasses
import io
import textwrap

from planner.errors import PlanError
from planner.memory import COMPONENTS
from planner.report.tables import PHASE_NAMES

CHART_FORMATS = ("png", "svg", "pdf")
_GIB = 2**30


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlanError("charts need matplotlib", "pip install matplotlib (a dit-accel dependency)") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure


def _save(fig, fmt: str = "png") -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=100, metadata={"Software": None} if fmt == "png" else None)
    return buffer.getvalue()


def alternative_components(plan: dict, alternative: dict) -> dict[str, int] | None:
    """Every component of an alternative at its peak, recomputed from the plan's own inputs with the
    planner's memory model; None when the recomputation does not give the plan's recorded peak."""
    from planner.hardware import Assumptions, gpu_preset
    from planner.memory import Cluster, Decision, step_memory
    from planner.planfile import spec_from_plan

    try:
        c = plan["cluster"]
        cluster = Cluster(
            c["nodes"], c["gpus_per_node"], c["vram_bytes"], gpu_preset(c["gpu"]) if c["gpu"] else None
        )
        names = {f.name for f in dataclasses.fields(Decision)}
        decision = Decision(**{k: v for k, v in alternative.items() if k in names})
        estimate = step_memory(spec_from_plan(plan), decision, cluster, Assumptions(**plan["assumptions"]))
    except (PlanError, KeyError, TypeError, ValueError):
        return None
    if estimate.peak_bytes != alternative["peak_bytes"]:
        return None
    return estimate.phases[estimate.peak_phase]


def _label(choice: dict) -> str:
    return f"{choice['sharding']}\nmb {choice['micro_batch']}\nckpt {choice['checkpointed_blocks']}"


def _stack(ax, labels: list[str], parts: list[dict], colors: dict) -> None:
    bottoms = [0.0] * len(labels)
    for name in COMPONENTS + ("peak",):
        heights = [p.get(name, 0) / _GIB for p in parts]
        if not any(heights):
            continue
        ax.bar(
            labels, heights, bottom=bottoms, label=name, color=colors[name], edgecolor="white", linewidth=0.5
        )
        bottoms = [b + h for b, h in zip(bottoms, heights)]


def memory_chart(plan: dict) -> bytes:
    """PNG: left, stacked components of the decision and each alternative at its peak against the budget and
    the VRAM; right, the decision's components at each moment of the step."""
    Figure = _pyplot()
    from matplotlib import colormaps

    m = plan["memory"]
    palette = colormaps["tab10"]
    colors = {name: palette(i) for i, name in enumerate(COMPONENTS)}
    colors["peak"] = "0.6"  # an alternative whose components could not be recomputed: its peak alone
    decision = {name: m[name] for name in COMPONENTS}
    labels, parts = ["decision\n" + _label(plan["decision"])], [decision]
    for alt in plan["alternatives"]:
        labels.append(_label(alt))
        parts.append(alternative_components(plan, alt) or {"peak": alt["peak_bytes"]})
    phases = m["phases"]
    fig = Figure(figsize=(13, 5.5))  # laid out by hand: constrained layout costs more than the drawing
    left, right = fig.subplots(1, 2, width_ratios=[max(3, len(labels)), max(3, len(phases))])
    _stack(left, labels, parts, colors)
    moments = [textwrap.fill(PHASE_NAMES.get(p, p.replace("_", " ")), 12) for p in phases]
    _stack(right, moments, [phases[p] for p in phases], colors)
    for ax in (left, right):
        ax.axhline(m["budget_bytes"] / _GIB, color="red", linestyle="--", linewidth=1.2, label="budget")
        ax.axhline(m["vram_bytes"] / _GIB, color="black", linewidth=1, label="VRAM")
        ax.set_ylabel("GiB per GPU")
        ax.tick_params(axis="x", labelsize=8)
    left.set_title("At the peak: the decision and the alternatives")
    right.set_title("The decision at each moment of the step")
    handles, names = [], []
    for ax in (left, right):
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if name not in names:
                handles.append(handle)
                names.append(name)
    fig.subplots_adjust(left=0.05, right=0.87, bottom=0.2, top=0.88, wspace=0.18)
    fig.legend(handles, names, loc="center right", fontsize=8)
    fig.suptitle(
        f"{plan['model']['name']} @ {plan['model']['resolution']} px, global batch {plan['global_batch']}"
    )
    return _save(fig)


def chart_format(path: str) -> str:
    """The format of a --plot FILE from its suffix."""
    suffix = str(path).rsplit(".", 1)[-1].lower() if "." in str(path) else ""
    if suffix not in CHART_FORMATS:
        raise PlanError(f"--plot {path}: the name must end in .png, .svg or .pdf")
    return suffix


def _two_axes(Figure):
    fig = Figure(figsize=(9, 5))
    peak_ax = fig.subplots()
    rate_ax = peak_ax.twinx()
    peak_ax.set_ylabel("peak GiB per GPU")
    rate_ax.set_ylabel("est. images/s")
    return fig, peak_ax, rate_ax


def sweep_chart(rows: list[dict], fmt: str = "png") -> bytes:
    """Peak memory (bars, left axis) and estimated images/s (dots, right axis) of each sweep row; the x axis
    is the total GPUs when the sweep varies them, else the rows in order."""
    Figure = _pyplot()
    planned = [r for r in rows if "micro_batch" in r]
    if not planned:
        raise PlanError("--plot: no combination of the sweep can be planned, nothing to draw")
    fig, peak_ax, rate_ax = _two_axes(Figure)
    labels = [
        f"{r['nodes'] * r['gpus']} x {r['gpu_or_vram']}\n{r['model']} {r['resolution']}px\nmb {r['micro_batch']}"
        for r in planned
    ]
    peak_ax.bar(
        labels, [r["peak_bytes"] / _GIB for r in planned], color="tab:blue", alpha=0.6, label="peak GiB"
    )
    peak_ax.plot(labels, [r["vram_bytes"] / _GIB for r in planned], "k_", markersize=20, label="VRAM")
    rate_ax.plot(labels, [r["est_images_per_s"] for r in planned], "o-", color="tab:orange", label="img/s")
    peak_ax.set_xlabel("GPUs x GPU, model, resolution, chosen micro-batch")
    peak_ax.tick_params(axis="x", labelsize=7)
    fig.subplots_adjust(left=0.09, right=0.9, bottom=0.24, top=0.9)
    fig.legend(loc="upper center", ncols=3, fontsize=8)
    return _save(fig, fmt)


def _cluster(plan: dict):
    from planner.hardware import gpu_preset
    from planner.memory import Cluster

    c = plan["cluster"]
    return Cluster(
        c["nodes"], c["gpus_per_node"], c["vram_bytes"], gpu_preset(c["gpu"]) if c["gpu"] else None
    )


def micro_batch_curves(plan: dict) -> dict[str, list[tuple[int, int, float]]]:
    """For each sharding the planner could use: (micro-batch, peak bytes, est. images/s) at every micro-batch
    that divides the per-GPU batch, the decision's checkpointed blocks and precision held, computed with the
    planner's own memory and throughput models."""
    from planner.hardware import Assumptions
    from planner.planfile import spec_from_plan
    from planner.search import SearchSpace, evaluate, micro_batches, sharding_levels

    d = plan["decision"]
    space = SearchSpace(
        global_batch=plan["global_batch"],
        precision=d["precision"],
        latents=d["latents"],
        ema=d["ema"],
        adamw=d["adamw"],
        gradient_as_bucket_view=d["gradient_as_bucket_view"],
        matmul=d.get("matmul"),
    )
    spec, cluster, assumed = spec_from_plan(plan), _cluster(plan), Assumptions(**plan["assumptions"])
    budget = plan["memory"]["budget_bytes"]
    curves = {}
    for sharding in sharding_levels(space, cluster):
        curves[sharding] = []
        for b in micro_batches(space, cluster):
            c = evaluate(spec, space, cluster, assumed, budget, b, d["checkpointed_blocks"], sharding)
            curves[sharding].append((b, c.memory.peak_bytes, c.throughput.images_per_s))
    return curves


def candidates_chart(plan: dict, fmt: str = "png") -> bytes:
    """One plan: peak memory (dashed, left axis) and estimated images/s (solid, right axis) against the
    micro-batch, one colour per sharding, at the decision's checkpointed blocks; the budget and the decision."""
    Figure = _pyplot()
    from matplotlib import colormaps

    curves = micro_batch_curves(plan)
    palette = colormaps["tab10"]
    fig, peak_ax, rate_ax = _two_axes(Figure)
    for i, (sharding, points) in enumerate(curves.items()):
        xs = [p[0] for p in points]
        peak_ax.plot(
            xs, [p[1] / _GIB for p in points], "s--", color=palette(i), label=f"{sharding}: peak GiB"
        )
        rate_ax.plot(xs, [p[2] for p in points], "o-", color=palette(i), label=f"{sharding}: img/s")
    peak_ax.axhline(plan["memory"]["budget_bytes"] / _GIB, color="red", linestyle=":", label="budget")
    d = plan["decision"]
    rate_ax.plot(
        [d["micro_batch"]],
        [plan["throughput"]["est_images_per_s"]],
        "k*",
        markersize=14,
        label="the decision",
    )
    peak_ax.set_xscale("log", base=2)
    ticks = sorted({p[0] for points in curves.values() for p in points})
    peak_ax.set_xticks(ticks, [str(t) for t in ticks])
    peak_ax.set_xlabel(
        f"micro-batch per GPU ({d['checkpointed_blocks']} checkpointed blocks, {d['precision']})"
    )
    fig.subplots_adjust(left=0.08, right=0.74, bottom=0.11, top=0.95)
    fig.legend(loc="center right", fontsize=8)
    return _save(fig, fmt)
