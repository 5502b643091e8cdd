"""`dit-plan --plot FILE`: peak memory and images/s across a sweep or across the candidates of one plan, as
PNG, SVG or PDF.

matplotlib (and so numpy) is imported inside the functions, with the Agg backend, so that planning, the
tables and plan/memory.png (Pillow, planner/memorychart.py) never pay for it: its import alone costs about
three times a plan's whole CPU time. Charts are rendered to bytes and written atomically by the caller.
"""

from __future__ import annotations

import io

from planner.errors import PlanError

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
    from planner.decision import Cluster
    from planner.hardware import gpu_preset

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
        compile=bool(d.get("compile", False)),
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
