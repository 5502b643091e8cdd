"""The tables of a plan and of a sweep as rows of text, the same for every --format: each format module
(terminal, markdown, latex, planmd) only lays them out."""

from __future__ import annotations

from planner.calibration import describe as calibration_line
from planner.components import COMPONENTS
from planner.rules import SHARDING_MODES
from planner.units import count, format_bytes, gib, plural

TABLEFMT = {"table": "simple", "markdown": "pipe", "github": "github", "latex": "latex"}  # tabulate's names

# Each table's long text columns: wrapped to fit a terminal, paragraph columns in LaTeX.
TEXT_COLUMNS = {
    "decision": (),
    "memory": ("what",),
    "alternatives": (),
    "time": ("choice",),
    "host": (),
    "sweep": ("note",),
    "forecast": (),
}


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
    "repa": "REPA encoder weights, projector + grads + AdamW (+ encoder working set)",
    "temporaries": "short-lived buffers",
    "overhead": "CUDA context, NCCL (outside the caching allocator)",
}
PHASE_NAMES = {
    "vae_encode": "VAE encode",
    "repa_encode": "REPA encode",
    "last_block_forward": "last block's forward",
    "end_of_forward": "end of forward",
    "start_of_backward": "start of backward",
    "end_of_backward": "end of backward",
    "optimizer_step": "optimizer step",
}
# What the activations are at each moment (plan.md's arithmetic).
ACTIVATIONS_AT = {
    "vae_encode": "none yet (the DiT forward has not started)",
    "repa_encode": "none yet (the DiT forward has not started)",
    "last_block_forward": "every block's input and the last (checkpointed) block's working set at its MLP",
    "end_of_forward": "every saved tensor and the loss's working set",
    "start_of_backward": "the saved tensors less the loss, the final layer's and the last block's MLP output"
    " (+ the last block recomputed when checkpointed)",
    "end_of_backward": "block 0's saved set (recomputed when checkpointed) and the patch embedding's input",
    "optimizer_step": "none",
}


def gib_cell(n: float) -> str:
    return f"{gib(n):.2f}"


def share_cell(n: float, whole: float) -> str:
    return f"{100 * n / whole:.1f}%"


def rate_cell(point: float, low: float | None, high: float | None) -> str:
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


def money_cell(value: float) -> str:
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
    ] + (
        [money_cell(t["cost"]), f"{money_cell(t['cost_low'])} - {money_cell(t['cost_high'])}"]
        if priced
        else []
    )
    rows = [row]
    world = plan["cluster"]["world_size"]
    evaluation = t.get("evaluation")  # --eval-every: its sampling is in every row's time, and on a line
    extra = [evaluation[key] for key in ("time_s", "time_s_low", "time_s_high")] if evaluation else [0, 0, 0]
    if evaluation:
        hours = [x * world / 3600 for x in extra]
        rows.append(
            [
                f"  of which evaluation: {evaluation['evaluations']:,} x {evaluation['samples']:,} samples, "
                f"{evaluation['steps']} steps, cfg {evaluation['cfg_scale']:g}",
                f"every {evaluation['every']:,}",
                duration(extra[0]),
                f"{duration(extra[1])} - {duration(extra[2])}",
                f"{hours[0]:,.0f}",
                f"{hours[1]:,.0f} - {hours[2]:,.0f}",
            ]
            + ([money_cell(hours[0] * t["gpu_hour_cost"]), ""] if priced else [])
        )
    steps, batch = t["train_steps"], plan["global_batch"]
    for a in plan["alternatives"]:
        times = [
            steps * batch / a[key] + more
            for key, more in zip(("est_images_per_s", "est_images_per_s_high", "est_images_per_s_low"), extra)
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
                    money_cell(hours[0] * t["gpu_hour_cost"]),
                    f"{money_cell(hours[1] * t['gpu_hour_cost'])} - {money_cell(hours[2] * t['gpu_hour_cost'])}",
                ]
                if priced
                else []
            )
        )
    return headers, rows


def _steps_text(steps: int) -> str:
    """400000 -> 400K, 7000000 -> 7M: a milestone as papers name it."""
    return f"{steps / 1e6:g}M" if steps >= 1e6 else f"{steps / 1e3:g}K"


def forecast_rows(plan: dict) -> tuple[list, list]:
    """What these hours buy: each published milestone of the plan's recipe (its images seen, its FID-50K
    guided / unguided) at this plan's steps, wall-clock and GPU-hours (and cost with --gpu-hour-cost)."""
    f = plan.get("forecast")
    if not f or not f["rows"]:
        return [], []
    priced = any(row["cost"] is not None for row in f["rows"])
    headers = ["published run", "images", "FID cfg", "no cfg", "steps here", "time", "(range)", "GPU-h"]
    headers += ["cost"] if priced else []
    rows = []
    for row in f["rows"]:
        fid = [f"{row[key]:g}" if row[key] is not None else "-" for key in ("fid_guided", "fid_unguided")]
        rows.append(
            [
                f"{row['method']} {_steps_text(row['steps'])} x {row['global_batch']}",
                f"{row['images_seen'] / 1e6:,.1f}M",
                *fid,
                f"{row['steps']:,}",
                duration(row["time_s"]),
                f"{duration(row['time_s_low'])} - {duration(row['time_s_high'])}",
                f"{row['gpu_hours']:,.0f}",
            ]
            + ([money_cell(row["cost"])] if priced else [])
        )
    return headers, rows


def forecast_lines(plan: dict) -> list[str]:
    """The lines under the forecast table: the --target-fid answer, and what the rows are and are not."""
    from planner.forecast import target_sentence

    f = plan.get("forecast")
    if not f:
        return []
    lines = [line for line in [target_sentence(f)] if line]
    lines += f["notes"]
    if f["rows"]:
        lines.append(
            "published FID-50K at equal images seen, under each paper's sampling protocol (`dit-accel sample "
            "--protocol`), timed at this plan's img/s: the public record, not a prediction for your data "
            '(docs/planner.md, "What these hours buy")'
        )
    return lines


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
            "start_of_backward": f"; the {a.get('backward_starts_in', 'last block')}'s backward",
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
            "start_of_backward": in_backward
            if m["activation_breakdown"].get("backward_starts_in", "last block") == "last block"
            else "the final layer's activation gradients in flight",
            "end_of_backward": in_backward,
        }.get(m["peak_phase"], text)
    elif component == "overhead":
        nccl = ", NCCL" if plan["cluster"]["world_size"] > 1 else ""
        text = f"CUDA context{nccl}"
    return text


def title(plan: dict) -> str:
    c, m = plan["cluster"], plan["model"]
    memory = f"{format_bytes(c['vram_bytes'])} = {format_bytes(c['vram_bytes'], 'GB')}"
    n, gpus = c["gpus_per_node"], plural(c["gpus_per_node"], "GPU")
    gpu = f"{n} {c['gpu']} {gpus} ({memory})" if c["gpu"] else f"{n} {gpus} of {memory}"
    return (
        f"{m['name']} @ {m['resolution']} px ({m['params_trainable']:,} params) on "
        f"{count(c['nodes'], 'node')} x {gpu}, global batch {plan['global_batch']}"
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
        f"{gib_cell(m['allocated_peak_bytes'])} / {gib_cell(m['reserved_peak_bytes'])}"
        if "reserved_peak_bytes" in m
        else "-",
        gib_cell(m["peak_bytes"]),
        share_cell(m["peak_bytes"], m["vram_bytes"]),
        rate_cell(t["est_images_per_s"], t.get("est_images_per_s_low"), t.get("est_images_per_s_high")),
    ]
    return headers, [row]


def memory_rows(plan: dict) -> tuple[list, list]:
    m = plan["memory"]
    vram = m["vram_bytes"]
    segments = m.get("allocator_segments", "expandable")
    allocator_text = (
        f"caching allocator: reserved beyond allocated ({segments} segments: rounding, fragmentation, cuBLAS)"
        if not plan["assumptions"].get("fragmentation")
        else f"caching allocator: measured fragmentation {plan['assumptions']['fragmentation']:.1%}"
    )
    rows = [
        [
            name,
            gib_cell(m[name]),
            share_cell(m[name], vram),
            allocator_text if name == "allocator" else describe(plan, name),
        ]
        for name in COMPONENTS
        if m.get(name)
    ]
    for key, label, what in (
        ("allocated_peak_bytes", "allocated peak", "the tensors (torch.cuda.max_memory_allocated)"),
        ("reserved_peak_bytes", "reserved peak", "the caching allocator (max_memory_reserved, nvidia-smi)"),
    ):
        if key in m:
            rows.append([label, gib_cell(m[key]), share_cell(m[key], vram), what])
    rows.append(
        [
            "peak",
            gib_cell(m["peak_bytes"]),
            share_cell(m["peak_bytes"], vram),
            f"reserved + overhead, at the {PHASE_NAMES[m['peak_phase']]}",
        ]
    )
    needed = m.get("needed_bytes", m["peak_bytes"])
    if m["peak_bytes"] > m["budget_bytes"] and needed < m["peak_bytes"]:
        rows.append(
            [
                "after release",
                gib_cell(needed),
                share_cell(needed, vram),
                "the least it runs in: the allocator releases its unused cache before an OOM",
            ]
        )
    rows.append(
        [
            "budget",
            gib_cell(m["budget_bytes"]),
            share_cell(m["budget_bytes"], vram),
            f"VRAM {format_bytes(vram)} minus {format_bytes(m['headroom_bytes'])} headroom",
        ]
    )
    return ["component", "GiB", "% VRAM", "what"], rows


def phase_rows(plan: dict) -> tuple[list, list]:
    phases = plan["memory"]["phases"]
    headers = ["component"] + [PHASE_NAMES[p] + " GiB" for p in phases]
    # .get: plans written before a component existed (allocator) read as 0 for it
    rows = [[name] + [gib_cell(phases[p].get(name, 0)) for p in phases] for name in COMPONENTS]
    rows.append(["total"] + [gib_cell(phases[p]["total_bytes"]) for p in phases])
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
            gib_cell(a["peak_bytes"]),
            share_cell(a["peak_bytes"], vram),
            rate_cell(a["est_images_per_s"], a.get("est_images_per_s_low"), a.get("est_images_per_s_high")),
        ]
        for a in plan["alternatives"]
    ]
    return headers, rows


def host_rows(plan: dict) -> tuple[list, list]:
    h = plan["host"]
    rows = [[name.replace("_", " "), gib_cell(v)] for name, v in h["per_rank"].items() if v]
    rows.append(["per rank", gib_cell(h["per_rank_bytes"])])
    rows += [
        [f"{name.replace('_', ' ')} (main process, once)", gib_cell(v)]
        for name, v in h.get("main_process_once", {}).items()
        if v
    ]
    rows.append([f"per node ({count(h['ranks_per_node'], 'rank')})", gib_cell(h["per_node_bytes"])])
    if h["host_ram_bytes"]:
        rows.append(["--host-ram", gib_cell(h["host_ram_bytes"])])
    return ["host RAM", "GiB"], rows


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
        target = (plan.get("forecast") or {}).get("target")
        if target is not None:  # --target-fid: this combination's hours and cost to the milestone
            row.update(
                target_hours=target["time_s"] / 3600,
                target_gpu_hours=target["gpu_hours"],
                target_cost=target["cost"],
                target_method=target["method"],
            )
    else:
        row.update(note=error)
    return row


def sweep_headers(rows: list[dict]) -> list[str]:
    """SWEEP_HEADERS, with the hours, GPU-hours and cost to --target-fid's milestone when a row has them."""
    if not any("target_hours" in r for r in rows):
        return SWEEP_HEADERS
    priced = any(r.get("target_cost") is not None for r in rows)
    return [*SWEEP_HEADERS[:-1], "h to FID", "GPU-h to FID", *(["cost to FID"] if priced else []), "note"]


def sweep_table(rows: list[dict]) -> list[list]:
    targeted = any("target_hours" in r for r in rows)
    priced = any(r.get("target_cost") is not None for r in rows)
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
                gib_cell(r["peak_bytes"]) if planned else "-",
                share_cell(r["peak_bytes"], r["vram_bytes"]) if planned else "-",
                f"{r['est_images_per_s']:.0f}" if planned else "-",
                *(
                    [
                        f"{r['target_hours']:,.1f}" if "target_hours" in r else "-",
                        f"{r['target_gpu_hours']:,.0f}" if "target_hours" in r else "-",
                    ]
                    if targeted
                    else []
                ),
                *(
                    [money_cell(r["target_cost"]) if r.get("target_cost") is not None else "-"]
                    if priced
                    else []
                ),
                r["note"],
            ]
        )
    return table


def plan_tables(plan: dict) -> list[tuple[str, str, list, list]]:
    """(title, kind, headers, rows) of each table of a plan that has rows, in the order the terminal shows them."""
    peak = PHASE_NAMES[plan["memory"]["peak_phase"]]
    tables = [
        ("Decision", "decision", *decision_rows(plan)),
        (f"Memory per GPU at its peak ({peak})", "memory", *memory_rows(plan)),
        ("Alternatives (fastest first)", "alternatives", *alternative_rows(plan)),
        ("Time to train", "time", *time_to_train_rows(plan)),
        ("What these hours buy", "forecast", *forecast_rows(plan)),
    ]
    return [table for table in tables if table[3]]


def plan_notes(plan: dict) -> list[str]:
    """The lines under a plan's title: the unit convention and the calibration applied, if any."""
    notes = [f"units: {plan['units']}"]
    if plan.get("calibration"):
        notes.append(calibration_line(plan["calibration"]))
    return notes
