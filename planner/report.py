"""Tables of a plan for people: the terminal, markdown/github/latex for reviews, and plan.md."""

from __future__ import annotations

import json
import re
import textwrap

from tabulate import tabulate

from planner.calibration import describe as calibration_line
from planner.memory import COMPONENTS
from planner.rules import SHARDING_MODES
from planner.units import format_bytes, gib

FORMATS = ("table", "markdown", "github", "latex", "json")
TABLEFMT = {"table": "simple", "markdown": "pipe", "github": "github", "latex": "latex"}

TERMINAL_COLUMNS = 100  # what the terminal tables fit unless --wide


# --- fitting a table to a terminal -------------------------------------------------------------------


def _width(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def _simple(headers, rows, header_widths=None, col_widths=None) -> str:
    return tabulate(
        rows,
        headers=headers,
        tablefmt="simple",
        disable_numparse=True,
        maxheadercolwidths=header_widths,
        maxcolwidths=col_widths,
    )


def _longest_word(text) -> int:
    """The narrowest a header wraps to: its longest word, split after hyphens (micro-|batch)."""
    return max((len(word) for word in re.split(r"\s+|(?<=-)", str(text)) if word), default=1)


WRAP_FLOOR = 40  # text columns wrap this narrow before other columns are left out, then down to 16


def fit_table(headers, rows, wrap=(), drop=(), width: int = TERMINAL_COLUMNS) -> tuple[str, str | None]:
    """A "simple" table no wider than `width`, and a footnote saying what was changed (None if nothing).

    In order, until it fits: headers wrapped at spaces and hyphens, the `wrap` text columns wrapped down to
    40 characters, the columns that say the same on every row and then the `drop` columns left out, the
    text wrapped down to 16, then other columns left out from the right. Works on whatever columns the
    rows have."""
    headers, rows = list(headers), [list(row) for row in rows]
    text = _simple(headers, rows)
    if _width(text) <= width:
        return text, None
    data_width = [max([len(str(row[i])) for row in rows] or [1]) for i in range(len(headers))]
    # a header gets 2 columns of padding: wrapping it to its data's width less 2 costs nothing
    heads = [max(_longest_word(h), min(len(h), data_width[i] - 2)) for i, h in enumerate(headers)]
    cols = [None] * len(headers)
    wrapped_text, dropped = False, []

    def rewrap(floor: int) -> str:
        """The widest wrap of the text columns (not below `floor`) that fits, else the narrowest."""
        nonlocal cols, wrapped_text
        widths = [max([len(str(row[i])) for row in rows] or [1]) for i in range(len(headers))]
        limit = max([widths[i] for i, h in enumerate(headers) if h in wrap] or [0])
        cols = [None] * len(headers)
        table = _simple(headers, rows, heads, cols)
        while _width(table) > width and limit > floor:
            limit = max(floor, limit - 2)
            cols = [limit if h in wrap and widths[i] > limit else None for i, h in enumerate(headers)]
            wrapped_text = wrapped_text or any(cols)
            table = _simple(headers, rows, heads, cols)
        return table

    def leave_out(names, floor: int) -> str:
        table = rewrap(floor)
        for name in names:
            if _width(table) <= width:
                break
            if name not in headers:
                continue
            i = headers.index(name)
            for seq in (headers, heads, *rows):
                del seq[i]
            dropped.append(name)
            table = rewrap(floor)
        return table

    constant = [
        h for i, h in enumerate(headers) if i and len(rows) > 1 and len({str(r[i]) for r in rows}) == 1
    ]
    empty = [h for h in constant if not str(rows[0][headers.index(h)]).strip()]
    first = (
        empty + [h for h in constant if h not in wrap and h not in empty] + [h for h in drop if h in headers]
    )
    text = leave_out(first, WRAP_FLOOR)
    rest = [h for h in reversed(headers[1:]) if h not in wrap] + [h for h in wrap if h in headers]
    text = leave_out(rest, 16)
    if dropped:
        note = f"(left out to fit {width} columns: {', '.join(dropped)}; --wide shows every column)"
    elif wrapped_text:
        note = (
            f"({', '.join(h for h in wrap if h in headers)} wrapped to fit {width} columns; --wide unwraps)"
        )
    else:
        return text, None  # only the headers were wrapped
    return text, "\n".join(textwrap.wrap(note, width))


# --- LaTeX -------------------------------------------------------------------------------------------

# in math mode or as accents where the text font lacks the glyph (no TS1 font needed)
_TEX = {
    "\\": r"$\backslash$",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\~{}",
    "^": r"\^{}",
    "<": r"$<$",
    ">": r"$>$",
    "|": r"$|$",
}


def tex_escape(text) -> str:
    """Text as LaTeX typesets it literally: every special character escaped, non-ASCII replaced."""
    return "".join(_TEX.get(ch, ch if ord(ch) < 128 else "?") for ch in str(text))


def latex_table(headers, rows, wrap=()) -> str:
    """A tabular with every cell escaped; `wrap` columns become paragraph columns."""
    spec = " ".join(r"p{6cm}" if h in wrap else "l" for h in headers)
    lines = [r"\begin{tabular}{" + spec + "}", r"\hline"]
    lines.append(" & ".join(tex_escape(h) for h in headers) + r" \\")
    lines.append(r"\hline")
    lines += [" & ".join(tex_escape(cell) for cell in row) + r" \\" for row in rows]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines)


def latex_document(heading: str, notes: list[str], tables: list, warnings: list[str]) -> str:
    """A whole document that pdflatex compiles: `tables` is [(name, headers, rows, wrap)]."""
    out = [
        r"\documentclass{article}",
        r"\usepackage[landscape,margin=1.5cm]{geometry}",
        r"\begin{document}",
        r"\footnotesize",
        r"\section*{" + tex_escape(heading) + "}",
    ]
    out += [tex_escape(note) + r"\par" for note in notes]
    for name, headers, rows, wrap in tables:
        out += [r"\subsection*{" + tex_escape(name) + "}", r"\noindent", latex_table(headers, rows, wrap)]
    if warnings:
        out += [r"\subsection*{Warnings}", r"\begin{itemize}"]
        out += [r"\item " + tex_escape(w) for w in warnings]
        out.append(r"\end{itemize}")
    out.append(r"\end{document}")
    return "\n".join(out) + "\n"


# --- assumptions in human units ----------------------------------------------------------------------


def human_value(name: str, value):
    """An assumed constant as people read it: 512 MiB, 25 GB/s, 312 TFLOP/s, 5%."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if name.endswith("_bytes_per_s"):
        return f"{value / 1e9:g} GB/s" if value else "0 (the GPU's figure)"
    if name.endswith("_bytes"):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value >= size:
                return f"{value / size:g} {unit}"
        return f"{value} B"
    if name.endswith("_flops"):
        return f"{value / 1e12:g} TFLOP/s"
    if name.startswith("mfu_") and not value:
        return "0 (the measured MFU table)"
    if name.endswith("_per_param"):
        return f"{value:g} B/param"
    if name in ("fragmentation", "comm_exposed_fraction", "fsdp_efficiency"):
        return f"{value:.0%}"
    if name.endswith("_s"):
        return f"{value * 1e3:g} ms"
    if isinstance(value, int) and value >= 10_000:
        return f"{value:,}"
    return value


DESCRIBE = {
    "weights": "fp32 master weights and the positional table",
    "grads": "fp32 gradients",
    "optimizer": "AdamW exp_avg + exp_avg_sq, fp32",
    "ema": "EMA weights, fp32",
    "activations": "tensors saved for backward",
    "autocast_cache": "bf16/fp16 weight copies the linears save",
    "vae": "VAE weights (+ encoder working set)",
    "temporaries": "short-lived buffers",
    "overhead": "CUDA context, cuBLAS, NCCL (outside the caching allocator)",
}
PHASE_NAMES = {
    "vae_encode": "VAE encode",
    "last_block_forward": "last block's forward",
    "end_of_forward": "end of forward",
    "start_of_backward": "start of backward",
    "end_of_backward": "end of backward",
    "optimizer_step": "optimizer step",
}
# What the activations are at each moment (plan.md's arithmetic).
ACTIVATIONS_AT = {
    "vae_encode": "none yet (the DiT forward has not started)",
    "last_block_forward": "every block's input and the last (checkpointed) block's working set at its MLP",
    "end_of_forward": "every saved tensor and the loss's working set",
    "start_of_backward": "the saved tensors less the loss, the final layer's and the last block's MLP output"
    " (+ the last block recomputed when checkpointed)",
    "end_of_backward": "block 0's saved set (recomputed when checkpointed) and the patch embedding's input",
    "optimizer_step": "none",
}


def _gib(n: float) -> str:
    return f"{gib(n):.2f}"


def _share(n: float, whole: float) -> str:
    return f"{100 * n / whole:.1f}%"


def _rate(point: float, low: float | None, high: float | None) -> str:
    """images/s with its range: "967 (793-1130)"; the point alone for plans written before the range."""
    if low is None or high is None or round(low) == round(high):
        return f"{point:.0f}"  # older plans, and a measured (--calibration / --assume) MFU: one value
    return f"{point:.0f} ({low:.0f}-{high:.0f})"


def duration(seconds: float) -> str:
    """Wall-clock time as people read it: 45 min, 29.4 h, 6.2 days."""
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _money(value: float) -> str:
    return f"${value:,.0f}"


def time_to_train_rows(plan: dict) -> tuple[list, list]:
    """The run's wall-clock time, GPU-hours and cost, for the decision and each alternative (with --steps)."""
    t = plan["throughput"]
    if not t.get("train_steps"):
        return [], []
    priced = t.get("cost") is not None
    headers = ["choice", "steps", "wall-clock", "(range)", "GPU-hours", "(range)"] + (
        ["cost", "(range)"] if priced else []
    )
    d = plan["decision"]
    row = [
        f"decision: {d['sharding']}, micro-batch {d['micro_batch']}, {d['checkpointed_blocks']} checkpointed",
        f"{t['train_steps']:,}",
        duration(t["time_to_train_s"]),
        f"{duration(t['time_to_train_s_low'])} - {duration(t['time_to_train_s_high'])}",
        f"{t['gpu_hours']:,.0f}",
        f"{t['gpu_hours_low']:,.0f} - {t['gpu_hours_high']:,.0f}",
    ] + ([_money(t["cost"]), f"{_money(t['cost_low'])} - {_money(t['cost_high'])}"] if priced else [])
    rows = [row]
    world = plan["cluster"]["world_size"]
    steps, batch = t["train_steps"], plan["global_batch"]
    for a in plan["alternatives"]:
        times = [
            steps * batch / a[key]
            for key in ("est_images_per_s", "est_images_per_s_high", "est_images_per_s_low")
        ]
        hours = [x * world / 3600 for x in times]
        rows.append(
            [
                f"{a['sharding']}, micro-batch {a['micro_batch']}, {a['checkpointed_blocks']} checkpointed",
                f"{steps:,}",
                duration(times[0]),
                f"{duration(times[1])} - {duration(times[2])}",
                f"{hours[0]:,.0f}",
                f"{hours[1]:,.0f} - {hours[2]:,.0f}",
            ]
            + (
                [
                    _money(hours[0] * t["gpu_hour_cost"]),
                    f"{_money(hours[1] * t['gpu_hour_cost'])} - {_money(hours[2] * t['gpu_hour_cost'])}",
                ]
                if priced
                else []
            )
        )
    return headers, rows


def describe(plan: dict, component: str) -> str:
    d, m = plan["decision"], plan["memory"]
    text = DESCRIBE[component]
    shards = SHARDING_MODES[d["sharding"]].shard_degree(
        plan["cluster"]["nodes"], plan["cluster"]["gpus_per_node"]
    )
    if component == "weights" and d["sharding"] != "ddp":
        text = f"fp32 master shard (1/{shards}) + FSDP gathered {d['precision']} params"
    elif component == "grads":
        if d["sharding"] != "ddp":
            text = f"fp32 gradient shard (1/{shards})"
        elif plan["cluster"]["world_size"] > 1:
            text += " in DDP buckets" if d["gradient_as_bucket_view"] else " + DDP all-reduce buckets"
        if d["grad_accum"] > 1 and m["peak_phase"] != "optimizer_step":
            text += "; kept across accumulation"
        elif m["peak_phase"] in ("start_of_backward", "end_of_backward"):
            text += "; those backward has made so far"
    elif component == "activations":
        a = m["activation_breakdown"]
        text = f"{a['stored_blocks']} blocks stored, {a['checkpointed_blocks']} checkpointed"
        text += {
            "last_block_forward": "; the last block's forward",
            "end_of_forward": "; + the loss",
            "start_of_backward": "; the last block's backward",
            "end_of_backward": "; block 0's backward",
        }.get(m["peak_phase"], "")
    elif component == "autocast_cache" and m["peak_phase"] == "last_block_forward":
        text = (
            "autocast's cached copies of the patch conv and the embedder (checkpointed blocks cast uncached)"
        )
    elif component == "autocast_cache" and m["peak_phase"] == "end_of_forward":
        text = "autocast's cached bf16/fp16 copy of every weight it cast"
        if d["checkpointed_blocks"]:
            text += f" outside the {d['checkpointed_blocks']} checkpointed blocks"
    elif component == "temporaries":
        in_backward = "activation and weight gradients in flight"
        text = {
            "optimizer_step": "foreach AdamW intermediate"
            if d["adamw"] == "foreach"
            else "none (fused AdamW)",
            "start_of_backward": in_backward,
            "end_of_backward": in_backward,
        }.get(m["peak_phase"], text)
    elif component == "overhead":
        nccl = ", NCCL" if plan["cluster"]["world_size"] > 1 else ""
        text = f"CUDA context, cuBLAS{nccl}"
    return text


def _compute_regime(breakdown: dict, decision: dict) -> str:
    """How the step computes: fp32, autocast on CUDA/CPU, or pure bf16/fp16 (sharded plans: FSDP2's bf16
    parameters, no autocast)."""
    if decision["precision"] == "fp32":
        return "fp32"
    if breakdown.get("pure_low_precision"):
        return f"pure {decision['precision']} under FSDP2, no autocast"
    return f"{breakdown['autocast_device'].upper()} {decision['precision']} autocast"


def title(plan: dict) -> str:
    c, m = plan["cluster"], plan["model"]
    nodes = f"{c['nodes']} node{'s' if c['nodes'] > 1 else ''}"
    memory = f"{format_bytes(c['vram_bytes'])} = {format_bytes(c['vram_bytes'], 'GB')}"
    gpu = f"{c['gpu']} GPUs ({memory})" if c["gpu"] else f"GPUs of {memory}"
    return (
        f"{m['name']} @ {m['resolution']} px ({m['params_trainable']:,} params) on {nodes} x "
        f"{c['gpus_per_node']} {gpu}, global batch {plan['global_batch']}"
    )


def decision_rows(plan: dict) -> tuple[list, list]:
    d, t, m = plan["decision"], plan["throughput"], plan["memory"]
    headers = [
        "micro-batch",
        "grad accum",
        "checkpointed blocks",
        "precision",
        "sharding",
        "latents",
        "EMA",
        "allocated / reserved GiB",
        "peak GiB",
        "% VRAM",
        "est. img/s",
    ]
    row = [
        d["micro_batch"],
        d["grad_accum"],
        f"{d['checkpointed_blocks']} / {plan['model']['depth']}",
        d["precision"],
        d["sharding"],
        d["latents"],
        "on" if d["ema"] else "off",
        f"{_gib(m['allocated_peak_bytes'])} / {_gib(m['reserved_peak_bytes'])}"
        if "reserved_peak_bytes" in m
        else "-",
        _gib(m["peak_bytes"]),
        _share(m["peak_bytes"], m["vram_bytes"]),
        _rate(t["est_images_per_s"], t.get("est_images_per_s_low"), t.get("est_images_per_s_high")),
    ]
    return headers, [row]


def memory_rows(plan: dict) -> tuple[list, list]:
    m = plan["memory"]
    vram = m["vram_bytes"]
    segments = m.get("allocator_segments", "expandable")
    allocator_text = (
        f"caching allocator: reserved beyond allocated ({segments} segments: rounding, fragmentation)"
        if not plan["assumptions"].get("fragmentation")
        else f"caching allocator: measured fragmentation {plan['assumptions']['fragmentation']:.1%}"
    )
    rows = [
        [
            name,
            _gib(m[name]),
            _share(m[name], vram),
            allocator_text
            if name == "allocator"
            else "CUDA context, cuBLAS" + (", NCCL" if plan["cluster"]["world_size"] > 1 else "")
            if name == "overhead"
            else describe(plan, name),
        ]
        for name in COMPONENTS
        if m.get(name)
    ]
    for key, label, what in (
        ("allocated_peak_bytes", "allocated peak", "the tensors (torch.cuda.max_memory_allocated)"),
        ("reserved_peak_bytes", "reserved peak", "the caching allocator (max_memory_reserved, nvidia-smi)"),
    ):
        if key in m:
            rows.append([label, _gib(m[key]), _share(m[key], vram), what])
    rows.append(
        [
            "peak",
            _gib(m["peak_bytes"]),
            _share(m["peak_bytes"], vram),
            f"reserved + overhead, at the {PHASE_NAMES[m['peak_phase']]}",
        ]
    )
    rows.append(
        [
            "budget",
            _gib(m["budget_bytes"]),
            _share(m["budget_bytes"], vram),
            f"VRAM {format_bytes(vram)} minus {format_bytes(m['headroom_bytes'])} headroom",
        ]
    )
    return ["component", "GiB", "% VRAM", "what"], rows


def phase_rows(plan: dict) -> tuple[list, list]:
    phases = plan["memory"]["phases"]
    headers = ["component"] + [PHASE_NAMES[p] + " GiB" for p in phases]
    # .get: plans written before a component existed (allocator) read as 0 for it
    rows = [[name] + [_gib(phases[p].get(name, 0)) for p in phases] for name in COMPONENTS]
    rows.append(["total"] + [_gib(phases[p]["total_bytes"]) for p in phases])
    return headers, rows


def alternative_rows(plan: dict) -> tuple[list, list]:
    headers = [
        "micro-batch",
        "grad accum",
        "checkpointed blocks",
        "sharding",
        "peak GiB",
        "% VRAM",
        "est. img/s",
    ]
    vram = plan["memory"]["vram_bytes"]
    rows = [
        [
            a["micro_batch"],
            a["grad_accum"],
            a["checkpointed_blocks"],
            a["sharding"],
            _gib(a["peak_bytes"]),
            _share(a["peak_bytes"], vram),
            _rate(a["est_images_per_s"], a.get("est_images_per_s_low"), a.get("est_images_per_s_high")),
        ]
        for a in plan["alternatives"]
    ]
    return headers, rows


def host_rows(plan: dict) -> tuple[list, list]:
    h = plan["host"]
    rows = [[name.replace("_", " "), _gib(v)] for name, v in h["per_rank"].items() if v]
    rows.append(["per rank", _gib(h["per_rank_bytes"])])
    rows.append([f"per node ({h['ranks_per_node']} ranks)", _gib(h["per_node_bytes"])])
    if h["host_ram_bytes"]:
        rows.append(["--host-ram", _gib(h["host_ram_bytes"])])
    return ["host RAM", "GiB"], rows


# How each table fits a 100-column terminal: its text columns to wrap, its columns to leave out first.
FIT = {
    "decision": ((), ("latents", "EMA", "% VRAM", "precision")),
    "memory": (("what",), ()),
    "alternatives": ((), ("% VRAM",)),
    "time": (("choice",), ()),
    "host": ((), ()),
    "sweep": (("note",), ("precision", "% VRAM", "ckpt blocks")),
}


def plan_tables(plan: dict) -> list[tuple[str, str, tuple]]:
    """(title, kind, (headers, rows)) of each table of a plan, in the order the terminal shows them."""
    peak = PHASE_NAMES[plan["memory"]["peak_phase"]]
    return [
        ("Decision", "decision", decision_rows(plan)),
        (f"Memory per GPU at its peak ({peak})", "memory", memory_rows(plan)),
        ("Alternatives (fastest first)", "alternatives", alternative_rows(plan)),
        ("Time to train", "time", time_to_train_rows(plan)),
    ]


def terminal_table(kind: str, headers, rows, wide: bool = False) -> str:
    """A table for the terminal: fitted to 100 columns with a footnote, or every column with --wide."""
    if wide:
        return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    wrap, drop = FIT[kind]
    text, note = fit_table(headers, rows, wrap, drop)
    return text if note is None else f"{text}\n{note}"


def render(plan: dict, fmt: str = "table", wide: bool = False) -> str:
    """The terminal view of one plan in any --format (latex: a whole document pdflatex compiles)."""
    if fmt == "json":
        return json.dumps(plan, indent=2)
    notes = [f"units: {plan['units']}"]
    if plan.get("calibration"):
        notes.append(calibration_line(plan["calibration"]))
    tables = [(name, kind, headers, rows) for name, kind, (headers, rows) in plan_tables(plan) if rows]
    if fmt == "latex":
        return latex_document(
            title(plan),
            notes,
            [(name, headers, rows, FIT[kind][0]) for name, kind, headers, rows in tables],
            plan["warnings"],
        )
    tablefmt = TABLEFMT[fmt]
    heading = "{}" if fmt == "table" else "### {}"
    out = [heading.format(title(plan)), *notes, ""]
    for name, kind, headers, rows in tables:
        if fmt == "table":
            text = terminal_table(kind, headers, rows, wide)
        else:
            text = tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
        out += [heading.format(name), text, ""]
    if plan["warnings"]:
        out.append(heading.format("Warnings"))
        out += [("! " if fmt == "table" else "- ") + w for w in plan["warnings"]]
    return "\n".join(out).rstrip() + "\n"


SWEEP_HEADERS = [
    "nodes x gpus",
    "gpu / vram",
    "global batch",
    "model",
    "res",
    "micro-batch",
    "grad accum",
    "ckpt blocks",
    "sharding",
    "precision",
    "peak GiB",
    "% VRAM",
    "est. img/s",
    "note",
]


def sweep_row(combo: dict, plan: dict | None, error: str | None) -> dict:
    """One sweep row as a dict (JSON) whose values `render_sweep` lays out."""
    gpu = combo.get("gpu") or combo.get("vram")
    row = {
        "nodes": combo["nodes"],
        "gpus": combo["gpus"],  # per node
        "world_size": combo["nodes"] * combo["gpus"],
        "gpu_or_vram": gpu,
        "global_batch": combo["global_batch"],
        "model": combo["model"],
        "resolution": combo["resolution"],
    }
    if plan is not None:
        d, m = plan["decision"], plan["memory"]
        row.update(
            global_batch=plan["global_batch"],
            micro_batch=d["micro_batch"],
            grad_accum=d["grad_accum"],
            checkpointed_blocks=d["checkpointed_blocks"],
            sharding=d["sharding"],
            precision=d["precision"],
            peak_bytes=m["peak_bytes"],
            vram_bytes=m["vram_bytes"],
            est_images_per_s=plan["throughput"]["est_images_per_s"],
            note="",
        )
    else:
        row.update(note=error)
    return row


def sweep_table(rows: list[dict]) -> list[list]:
    table = []
    for r in rows:
        planned = "micro_batch" in r
        table.append(
            [
                f"{r['nodes']} x {r['gpus']}",
                r["gpu_or_vram"],
                r["global_batch"],
                r["model"],
                r["resolution"],
                r.get("micro_batch", "-"),
                r.get("grad_accum", "-"),
                r.get("checkpointed_blocks", "-"),
                r.get("sharding", "-"),
                r.get("precision", "-"),
                _gib(r["peak_bytes"]) if planned else "-",
                _share(r["peak_bytes"], r["vram_bytes"]) if planned else "-",
                f"{r['est_images_per_s']:.0f}" if planned else "-",
                r["note"],
            ]
        )
    return table


def render_sweep(rows: list[dict], fmt: str = "table", wide: bool = False) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    table = sweep_table(rows)
    if fmt == "latex":
        return latex_document("dit-plan sweep", [], [("Sweep", SWEEP_HEADERS, table, ("note",))], [])
    if fmt == "table":
        return terminal_table("sweep", SWEEP_HEADERS, table, wide) + "\n"
    return tabulate(table, headers=SWEEP_HEADERS, tablefmt=TABLEFMT[fmt], disable_numparse=True) + "\n"


# --- plan.md -----------------------------------------------------------------------------------------


def _md(headers, rows) -> str:
    return tabulate(rows, headers=headers, tablefmt="pipe", disable_numparse=True)


def assumption_rows(plan: dict) -> tuple[list, list]:
    """The assumed constants in human units (512 MiB, 25 GB/s, 5%)."""
    return ["name", "value"], [[name, human_value(name, v)] for name, v in plan["assumptions"].items()]


def plan_markdown(plan: dict, provenance: dict | None = None, chart: str | None = None) -> str:
    """The design-review document: how it was made, the decision and warnings first, then the memory (with
    `chart`, an image beside plan.md), the arithmetic, alternatives, inputs, assumptions; the search path
    folded away. `provenance`: {"command", "version", "date"} of the run that wrote it."""
    m, d, t, mod, c = plan["memory"], plan["decision"], plan["throughput"], plan["model"], plan["cluster"]
    a = m["activation_breakdown"]
    P = mod["params_trainable"]
    b, s, h = d["micro_batch"], mod["tokens"], mod["hidden"]
    made = provenance or {}
    inputs = [[k, json.dumps(v)] for k, v in plan["inputs"].items() if v is not None]
    lines = [
        f"# Training plan: {title(plan)}",
        "",
        "```",
        made.get("command", "(made through the Python API: planner.plan.make_plan)"),
        "```",
        "",
        f"dit-accel {made.get('version', 'unknown')}, written {made.get('date', 'at an unrecorded date')}, "
        f"plan.json schema `{plan['schema']}`. Units: {plan['units']}. Memory is per GPU.",
        "",
        (
            f"Measured figures: {calibration_line(plan['calibration'])}."
            if plan.get("calibration")
            else "No calibration: every overhead, the fragmentation and the MFU are assumed (see Assumptions)."
        ),
        "",
        "## Decision",
        "",
        _md(*decision_rows(plan)),
        "",
        f"`micro_batch x grad_accum x world_size = {b} x {d['grad_accum']} x {c['world_size']} = {plan['global_batch']}`"
        f" (the global batch, exactly). Accelerate: `mixed_precision: {d['mixed_precision']}`"
        + (f", FSDP `{d['fsdp_sharding_strategy']}`" if d["fsdp_sharding_strategy"] else "")
        + ".",
        "",
        "## Warnings",
        "",
    ]
    lines += [f"- {w}" for w in plan["warnings"]] or ["None."]
    lines += [
        "",
        f"## Memory per GPU at its peak ({PHASE_NAMES[m['peak_phase']]})",
        "",
    ]
    if chart:
        lines += [
            f"![Memory per GPU: every component of the decision and the alternatives against the budget, "
            f"and the decision at each moment of the step]({chart})",
            "",
        ]
    lines += [
        _md(*memory_rows(plan)),
        "",
        "### At each moment of the step",
        "",
        _md(*phase_rows(plan)),
        "",
        "### The arithmetic",
        "",
        f"- Parameters P = {P:,} (trainable; the {s} x {h} positional table is a fixed buffer).",
        f"- weights = 4 B x P{' / ' + str(c['world_size']) + ' + gathered copies' if d['sharding'] != 'ddp' else ''}"
        f" + buffer = {format_bytes(m['weights'])} at the peak.",
        f"- optimizer = 8 B x P{' / ' + str(c['world_size']) if d['sharding'] != 'ddp' else ''} = {format_bytes(m['optimizer'])};"
        f" EMA = {'4 B x P' if d['ema'] else 'off'}"
        f"{' / ' + str(c['world_size']) if d['sharding'] != 'ddp' and d['ema'] else ''} = {format_bytes(m['ema'])}.",
        f"- One stored block saves {a['bytes_per_token_hidden_block']:.1f} B per token x hidden "
        f"({_compute_regime(a, d)}, "
        f"{a['attention']} attention): {b} images x {s} tokens x {h} x {a['bytes_per_token_hidden_block']:.1f} B = "
        f"{format_bytes(a['stored_block_bytes'])} per block.",
        f"- saved for backward = {a['stored_blocks']} stored x {format_bytes(a['stored_block_bytes'])} + "
        f"{a['checkpointed_blocks']} checkpointed x {format_bytes(a['checkpointed_block_bytes'])} (their inputs) + "
        f"patch embedding and final layer {format_bytes(a['head_and_tail_bytes'])} = {format_bytes(a['saved_bytes'])};"
        f" the loss adds {format_bytes(a['loss_bytes'])} at the end of the forward"
        + (
            f"; recomputing a checkpointed block adds {format_bytes(a['recompute_bytes'])}"
            if a["recompute_bytes"]
            else ""
        )
        + f". Backward has {format_bytes(a['backward_temporary_bytes'])} of gradients in flight inside a block.",
        f"- activations at the {PHASE_NAMES[m['peak_phase']]}: {ACTIVATIONS_AT[m['peak_phase']]} = "
        f"{format_bytes(m['activations'])}.",
        f"- overhead = CUDA context {format_bytes(plan['assumptions']['cuda_context_bytes'])} + cuBLAS "
        f"{format_bytes(plan['assumptions']['cublas_workspace_bytes'])}"
        + (f" + NCCL {format_bytes(plan['assumptions']['nccl_buffer_bytes'])}" if c["world_size"] > 1 else "")
        + f" + {plan['assumptions']['fragmentation']:.0%} fragmentation of the allocated bytes.",
        f"- peak = the largest moment, {PHASE_NAMES[m['peak_phase']]}: {format_bytes(m['peak_bytes'])} of a "
        f"{format_bytes(m['budget_bytes'])} budget ({_share(m['peak_bytes'], m['vram_bytes'])} of VRAM).",
        "",
        "## Throughput estimate",
        "",
        f"- FLOPs per image = 3 x forward ({mod['fwd_flops_per_image'] / 1e9:.1f} GFLOP)"
        + (f" + {d['checkpointed_blocks']} recomputed blocks" if d["checkpointed_blocks"] else "")
        + (" + the VAE encoder" if d["latents"] == "online" else "")
        + f"; one optimizer step = {t['step_flops'] / 1e12:.1f} TFLOP over {plan['global_batch']} images.",
        f"- per GPU: {t['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s {t.get('matmul', d['precision'])} peak "
        f"x MFU {t['assumed_mfu']:.3f} (range {t.get('mfu_low', t['assumed_mfu']):.3f}-"
        f"{t.get('mfu_high', t['assumed_mfu']):.3f}; {t.get('mfu_source', 'assumed')}) x small-batch "
        f"efficiency {t['small_batch_efficiency']:.3f} -> compute {t['compute_time_s'] * 1e3:.1f} ms per step"
        + (f", the VAE encoder (fp32) {t['vae_time_s'] * 1e3:.1f} ms" if t.get("vae_time_s") else "")
        + ", the fixed per-step cost (AdamW + EMA bytes over "
        f"{t.get('memory_bandwidth_bytes_per_s', 0) / 1e9:.0f} GB/s + launches) "
        f"{t.get('fixed_time_s', 0) * 1e3:.1f} ms, plus "
        f"{t['exposed_comm_time_s'] * 1e3:.1f} ms exposed communication ({format_bytes(t['comm_bytes_per_gpu'])} per GPU).",
        f"- estimate: "
        f"{_rate(t['est_images_per_s'], t.get('est_images_per_s_low'), t.get('est_images_per_s_high'))} "
        f"images/s ({t['step_time_s']:.3f} s per optimizer step).",
        "",
        "## Alternatives",
        "",
        _md(*alternative_rows(plan)) if plan["alternatives"] else "None that fit.",
        "",
    ]
    if t.get("train_steps"):
        lines += [
            "## Time to train",
            "",
            f"{t['train_steps']:,} optimizer steps x {plan['global_batch']} images / the estimated images/s "
            f"(range from the MFU range); GPU-hours = wall-clock x {c['world_size']} GPUs"
            + (f"; cost at ${t['gpu_hour_cost']:g} per GPU-hour." if t.get("cost") is not None else "."),
            "",
            _md(*time_to_train_rows(plan)),
            "",
        ]
    path = plan["search"]["path"]
    lines += [
        "## Host RAM per node (exitcode -9)",
        "",
        _md(*host_rows(plan)),
        "",
        "## Inputs",
        "",
        _md(["input", "value"], inputs),
        "",
        "## Assumptions",
        "",
        _md(*assumption_rows(plan)),
        "",
        "Every value is overridable with `dit-plan --assume NAME=VALUE`: sizes with a unit "
        "(`cuda_context_bytes=768MiB`), bandwidths in bytes/s (`inter_node_busbw_bytes_per_s=50e9`), "
        "fractions as numbers (`fragmentation=0.08`); docs/planner.md gives their sources.",
        "",
        "## How the decision was made",
        "",
        plan["search"]["rule"] + ".",
        "",
        "<details>",
        f"<summary>The search path: {len(path)} candidates; the decision is the furthest that fits</summary>",
        "",
        _md(
            ["sharding", "micro-batch", "checkpointed", "peak GiB", "est. img/s", "fits"],
            [
                [p[0], p[1], p[2], _gib(p[3]), f"{p[4]:.0f}", "yes" if p[3] <= m["budget_bytes"] else "no"]
                for p in path
            ],
        ),
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)
