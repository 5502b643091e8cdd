"""plan.md, the design-review document `dit-plan` writes beside plan.json: how the plan was made, the
decision and warnings first, the memory with its chart and arithmetic, throughput, alternatives, inputs and
assumptions, the search path folded away."""

from __future__ import annotations

import json

from planner.calibration import describe as calibration_line
from planner.report.markdown import markdown_table
from planner.report.tables import (
    ACTIVATIONS_AT,
    PHASE_NAMES,
    alternative_rows,
    decision_rows,
    forecast_lines,
    forecast_rows,
    gib_cell,
    host_rows,
    human_value,
    memory_rows,
    phase_rows,
    rate_cell,
    share_cell,
    time_to_train_rows,
    title,
)
from planner.units import count, format_bytes


def _compute_regime(breakdown: dict, decision: dict) -> str:
    """How the step computes: fp32, autocast on CUDA/CPU, or pure bf16/fp16 (sharded plans: FSDP2's bf16
    parameters, no autocast)."""
    if decision["precision"] == "fp32":
        return "fp32"
    if breakdown.get("pure_low_precision"):
        return f"pure {decision['precision']} under FSDP2, no autocast"
    return f"{breakdown['autocast_device'].upper()} {decision['precision']} autocast"


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
        markdown_table(*decision_rows(plan)),
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
        markdown_table(*memory_rows(plan)),
        "",
        "### At each moment of the step",
        "",
        markdown_table(*phase_rows(plan)),
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
        f"{a['attention']} attention): {count(b, 'image')} x {s} tokens x {h} x {a['bytes_per_token_hidden_block']:.1f} B = "
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
        f"- overhead = CUDA context {format_bytes(plan['assumptions']['cuda_context_bytes'])}"
        + (f" + NCCL {format_bytes(plan['assumptions']['nccl_buffer_bytes'])}" if c["world_size"] > 1 else "")
        + "; the caching allocator's share holds the rounding, "
        + (
            f"the measured fragmentation ({plan['assumptions']['fragmentation']:.1%} of the allocated bytes)"
            if plan["assumptions"]["fragmentation"]
            else "the modelled fragmentation"
        )
        + f" and cuBLAS's workspaces ({format_bytes(plan['assumptions']['cublas_workspace_bytes'])}).",
        f"- peak = the largest moment, {PHASE_NAMES[m['peak_phase']]}: {format_bytes(m['peak_bytes'])} of a "
        f"{format_bytes(m['budget_bytes'])} budget ({share_cell(m['peak_bytes'], m['vram_bytes'])} of VRAM).",
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
        f"{rate_cell(t['est_images_per_s'], t.get('est_images_per_s_low'), t.get('est_images_per_s_high'))} "
        f"images/s ({t['step_time_s']:.3f} s per optimizer step).",
        "",
        "## Alternatives",
        "",
        markdown_table(*alternative_rows(plan)) if plan["alternatives"] else "None that fit.",
        "",
    ]
    if t.get("train_steps"):
        lines += [
            "## Time to train",
            "",
            f"{t['train_steps']:,} optimizer steps x {plan['global_batch']} images / the estimated images/s "
            f"(range from the MFU range); GPU-hours = wall-clock x {count(c['world_size'], 'GPU')}"
            + (f"; cost at ${t['gpu_hour_cost']:g} per GPU-hour." if t.get("cost") is not None else "."),
            "",
            markdown_table(*time_to_train_rows(plan)),
            "",
        ]
    if plan.get("forecast"):
        f = plan["forecast"]
        lines += ["## What these hours buy", ""]
        if f["rows"]:
            lines += [
                f"{f['method']}'s published FID-50K milestones, each at this plan's steps to the same images seen "
                f"(steps x global batch), timed at the estimated images/s (range from the MFU range).",
                "",
                markdown_table(*forecast_rows(plan)),
                "",
            ]
        lines += [f"- {line}" for line in forecast_lines(plan)]
        sources = f["rows"] + [row for row in (f["target"], f["best"]) if row and row not in f["rows"]]
        if sources:
            lines += ["", "Sources:", ""]
            lines += [
                f"- {row['method']} {row['steps']:,} steps x {row['global_batch']}: {row['source']}"
                for row in sources
            ]
        lines.append("")
    path = plan["search"]["path"]
    lines += [
        "## Host RAM per node (exitcode -9)",
        "",
        markdown_table(*host_rows(plan)),
        "",
        "## Inputs",
        "",
        markdown_table(["input", "value"], inputs),
        "",
        "## Assumptions",
        "",
        markdown_table(*assumption_rows(plan)),
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
        markdown_table(
            ["sharding", "micro-batch", "checkpointed", "peak GiB", "est. img/s", "fits"],
            [
                [
                    p[0],
                    p[1],
                    p[2],
                    gib_cell(p[3]),
                    f"{p[4]:.0f}",
                    "yes" if p[3] <= m["budget_bytes"] else "no",
                ]
                for p in path
            ],
        ),
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)
