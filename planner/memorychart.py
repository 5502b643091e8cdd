"""plan/memory.png: the memory per GPU of the decision and each alternative at its peak, and of the decision
at each moment of the step, as stacked components against the budget and the VRAM. Sized for a slide.

Drawn with Pillow (a dependency; its import costs a tenth of matplotlib's, which made a plan with its chart
take 4.7x the CPU of one without): every mark is an axis-aligned rectangle or line, the text is Pillow's
bundled scalable font. `dit-plan --plot FILE` keeps matplotlib (planner/plot.py).
"""

from __future__ import annotations

import dataclasses
import io
import textwrap

from planner.components import COMPONENTS
from planner.errors import PlanError
from planner.report.tables import PHASE_NAMES
from planner.units import count, plural

WIDTH, HEIGHT = 1600, 900  # 16:9
LEGEND_ROW = 34  # pixels per legend row
PEAK_TITLES = {True: "At the peak: the decision and the alternatives", False: "The decision at its peak"}
_GIB = 2**30
COLORS = {  # no red or green: those say fits / does not fit
    "weights": "#4c72b0",
    "grads": "#7fb2e5",
    "optimizer": "#8172b2",
    "ema": "#c39bd3",
    "activations": "#dd8452",
    "autocast_cache": "#ccb974",
    "vae": "#64b5cd",
    "repa": "#55a868",
    "temporaries": "#937860",
    "allocator": "#b0b0b0",
    "overhead": "#5d6d7e",
    "peak": "#d5d8dc",  # an alternative whose components could not be recomputed: its peak alone
}
INK, GRID, FITS, OVER, HEADROOM = "#1b1b1b", "#e3e3e3", "#1e7b34", "#c0392b", "#fbe3e1"
LABELS = {"autocast_cache": "autocast cache", "peak": "peak (not split)"}


def alternative_components(plan: dict, alternative: dict) -> dict[str, int] | None:
    """Every component of an alternative at its peak, recomputed from the plan's own inputs with the
    planner's memory model; None when the recomputation does not give the plan's recorded peak."""
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions, gpu_preset
    from planner.memory import step_memory
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


@dataclasses.dataclass
class Bar:
    label: list[str]  # lines under the bar
    parts: dict[str, int]  # component -> bytes, stacked in COMPONENTS order
    strong: bool = False  # the decision, and its peak moment: outlined, with `bold` label lines in bold
    bold: int = 0
    details: list[str] = dataclasses.field(default_factory=list)  # smaller lines under the label

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.get(name, 0) for name in (*COMPONENTS, "peak"))


def _fonts():
    from PIL import ImageFont

    def font(size: int):
        return ImageFont.load_default(size=size)  # Pillow's bundled scalable font (Pillow 10.1 and later)

    return {"title": font(34), "subtitle": font(25), "panel": font(24), "text": font(19), "small": font(17)}


def _choice_details(choice: dict) -> list[str]:
    return [f"micro-batch {choice['micro_batch']}", f"{choice['checkpointed_blocks']} ckpt"]


def _bars(plan: dict) -> tuple[list[Bar], list[Bar]]:
    """(the decision and the alternatives at their peaks, the decision at each moment of the step)."""
    m, d = plan["memory"], plan["decision"]
    decision = Bar(["decision", d["sharding"]], {n: m[n] for n in COMPONENTS}, True, 1, _choice_details(d))
    choices = [decision]
    for alternative in plan["alternatives"]:
        parts = alternative_components(plan, alternative) or {"peak": alternative["peak_bytes"]}
        choices.append(Bar([alternative["sharding"]], dict(parts), details=_choice_details(alternative)))
    moments = []
    for name, parts in m["phases"].items():
        label, peak = (
            textwrap.wrap(PHASE_NAMES.get(name, name.replace("_", " ")), 13),
            name == m["peak_phase"],
        )
        moments.append(Bar(label, {n: parts.get(n, 0) for n in COMPONENTS}, peak, len(label) if peak else 0))
    return choices, moments


def _tick_step(top_gib: float) -> float:
    for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500):
        if top_gib / step <= 8:
            return step
    return 1000


def _dashed(draw, x0: int, x1: int, y: int, color: str, width: int) -> None:
    for x in range(x0, x1, 18):
        draw.line([(x, y), (min(x + 10, x1), y)], fill=color, width=width)


def _boxed(draw, xy, text: str, font, fill: str) -> None:
    """Text centred on its baseline at `xy`, on a white box that hides the lines behind it."""
    x0, y0, x1, y1 = draw.textbbox(xy, text, font=font, anchor="ms")
    draw.rectangle([x0 - 3, y0 - 2, x1 + 3, y1 + 2], fill="white")
    draw.text(xy, text, font=font, fill=fill, anchor="ms")


def _panel_title(draw, text: str, font, x0: int, x1: int, baseline: int) -> None:
    """A panel's title from x0, wrapped to the panel's width, its last line on `baseline`."""
    lines = [""]
    for word in text.split():
        trial = f"{lines[-1]} {word}".strip()
        if lines[-1] and draw.textlength(trial, font=font) > x1 - x0:
            lines.append(word)
        else:
            lines[-1] = trial
    for i, line in enumerate(reversed(lines)):
        draw.text((x0, baseline - 28 * i), line, font=font, fill=INK, anchor="ls")


def _bold(draw, xy, text: str, font, fill: str, anchor: str) -> None:
    """Pillow's bundled font has no bold face: the text twice, a pixel apart."""
    for dx in (0, 1):
        draw.text((xy[0] + dx, xy[1]), text, font=font, fill=fill, anchor=anchor)


def _title(plan: dict) -> tuple[str, str, str]:
    """(the title, the verdict, the decision in words)."""
    m, d, c, mod = plan["memory"], plan["decision"], plan["cluster"], plan["model"]
    vram, budget, peak = m["vram_bytes"], m["budget_bytes"], m["peak_bytes"]
    n = c["gpus_per_node"]
    gpus = (
        f"{n} {c['gpu']} {plural(n, 'GPU')}"
        if c["gpu"]
        else f"{n} {plural(n, 'GPU')} of {vram / _GIB:.2f} GiB"
    )
    title = (
        f"{mod['name']} @ {mod['resolution']} px, global batch {plan['global_batch']}, on "
        f"{count(c['nodes'], 'node')} x {gpus}: memory per GPU"
    )
    needed = m.get("needed_bytes", peak)
    if peak <= budget:
        verdict = (
            f"Fits: peak {peak / _GIB:.2f} GiB = {100 * peak / vram:.1f}% of the VRAM, "
            f"{(budget - peak) / _GIB:.2f} GiB under the {budget / _GIB:.2f} GiB budget"
        )
    elif needed <= budget:
        verdict = (
            f"Fits once the allocator releases its cache: needs {needed / _GIB:.2f} GiB of the "
            f"{budget / _GIB:.2f} GiB budget (peak {peak / _GIB:.2f} GiB with memory to spare)"
        )
    else:
        verdict = (
            f"Does not fit: peak {peak / _GIB:.2f} GiB = {100 * peak / vram:.1f}% of the VRAM, "
            f"{(peak - budget) / _GIB:.2f} GiB over the {budget / _GIB:.2f} GiB budget"
        )
    decision = (
        f"The decision: {d['sharding']}, micro-batch {d['micro_batch']} x {d['grad_accum']} accumulation, "
        f"{d['checkpointed_blocks']} of {mod['depth']} blocks checkpointed, {d['precision']}"
    )
    return title, verdict, decision


def memory_chart(plan: dict) -> bytes:
    """PNG: left, the decision and each alternative at its peak; right, the decision at each moment of the
    step. Each bar is labelled with its total and its share of the VRAM, green within the budget, red over it;
    the band between the budget and the VRAM (the headroom) is shaded."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise PlanError(
            "the memory chart needs Pillow", "pip install pillow (a dit-accel dependency)"
        ) from None
    m = plan["memory"]
    vram, budget = m["vram_bytes"], m["budget_bytes"]
    choices, moments = _bars(plan)
    fonts = _fonts()
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)

    title, verdict, decision = _title(plan)
    _bold(draw, (40, 20), title, fonts["title"], INK, "la")
    draw.text(
        (40, 68),
        verdict,
        font=fonts["subtitle"],
        fill=FITS if m.get("needed_bytes", m["peak_bytes"]) <= budget else OVER,
    )
    draw.text((40, 102), decision, font=fonts["subtitle"], fill=INK)

    # the plotting area: two panels sharing one scale and one bar width
    left, right, top = 95, WIDTH - 30, 210
    legend = _legend_rows(draw, fonts["text"], choices + moments, vram, budget, right - left)
    label_lines = max(len(bar.label) + len(bar.details) for bar in choices + moments)
    bottom = HEIGHT - 24 - LEGEND_ROW * len(legend) - 14 - 22 * label_lines
    gap = 75  # between the panels
    slot = (right - left - gap) / (len(choices) + len(moments))
    label_room = 52  # above a bar: its two label lines
    tallest = max(bar.total_bytes for bar in choices + moments)
    # pixels per byte: the VRAM line or the tallest bar's labels at the top, no empty strip above them
    scale = min((bottom - top - 4) / vram, (bottom - top - label_room) / max(tallest, 1))

    def y_of(n_bytes: float) -> int:
        return round(bottom - n_bytes * scale)

    top_gib = max(vram, tallest) / _GIB
    step = _tick_step(top_gib)
    panels = [
        (left, left + slot * len(choices), choices, PEAK_TITLES[len(choices) > 1]),
        (left + slot * len(choices) + gap, right, moments, "The decision at each moment of the step"),
    ]
    for x0, x1, bars, name in panels:
        x0, x1 = round(x0), round(x1)
        draw.rectangle([x0, y_of(vram), x1, y_of(budget)], fill=HEADROOM)
        tick = 0.0
        while tick <= top_gib + 1e-9:
            y = y_of(tick * _GIB)
            draw.line([(x0, y), (x1, y)], fill=GRID, width=1)
            draw.text((x0 - 10, y), f"{tick:g}", font=fonts["small"], fill=INK, anchor="rm")
            tick += step
        _panel_title(draw, name, fonts["panel"], x0, x1 + gap // 2, top - 34)
        draw.text((x0 - 10, top - 34), "GiB", font=fonts["small"], fill=INK, anchor="rs")
        for i, bar in enumerate(bars):
            center = x0 + slot * (i + 0.5)
            half = slot * 0.33
            bx0, bx1 = round(center - half), round(center + half)
            height = 0
            for part in (*COMPONENTS, "peak"):
                size = bar.parts.get(part, 0)
                if size > 0:
                    draw.rectangle([bx0, y_of(height + size), bx1, y_of(height)], fill=COLORS[part])
                    height += size
            if bar.strong:
                draw.rectangle([bx0 - 1, y_of(height) - 1, bx1 + 1, y_of(0)], outline=INK, width=3)
            lines = [(line, "text", j < bar.bold) for j, line in enumerate(bar.label)]
            lines += [(line, "small", False) for line in bar.details]
            for j, (line, font, bold) in enumerate(lines):
                at = (center, bottom + 10 + 22 * j)
                if bold:
                    _bold(draw, at, line, fonts[font], INK, "ma")
                else:
                    draw.text(at, line, font=fonts[font], fill=INK, anchor="ma")
        _dashed(draw, x0, x1, y_of(budget), OVER, 3)
        draw.line([(x0, y_of(vram)), (x1, y_of(vram))], fill=INK, width=3)
        draw.line([(x0, bottom), (x1, bottom)], fill=INK, width=2)
        for i, bar in enumerate(bars):  # over the lines, on white, where a bar comes close to the VRAM
            center, height = x0 + slot * (i + 0.5), bar.total_bytes
            color, y = (FITS if height <= budget else OVER), y_of(height)
            _boxed(draw, (center, y - 28), f"{height / _GIB:.2f} GiB", fonts["text"], color)
            _boxed(draw, (center, y - 7), f"{100 * height / vram:.1f}% VRAM", fonts["small"], color)
    _draw_legend(draw, fonts["text"], legend, left, HEIGHT - 24 - LEGEND_ROW * len(legend))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()


def _legend_rows(draw, font, bars: list[Bar], vram: int, budget: int, width: int) -> list[list[tuple]]:
    """The legend as rows of (kind, text, x offset) that fit `width`: the two lines with their values and the
    headroom, then every component that has bytes in some bar, in the order the stacks are built."""
    present = [name for name in (*COMPONENTS, "peak") if any(bar.parts.get(name, 0) > 0 for bar in bars)]
    items = [
        ("vram", f"VRAM {vram / _GIB:.2f} GiB"),
        ("budget", f"budget {budget / _GIB:.2f} GiB"),
        ("headroom", "headroom: a bar reaching it does not fit"),
        *[(name, LABELS.get(name, name)) for name in present],
    ]
    rows, x = [[]], 0
    for kind, text in items:
        size = 42 + round(draw.textlength(text, font=font))
        if rows[-1] and x + size > width:
            rows.append([])
            x = 0
        rows[-1].append((kind, text, x))
        x += size + 28
    return rows


def _draw_legend(draw, font, rows: list[list[tuple]], x0: int, y0: int) -> None:
    for r, row in enumerate(rows):
        y = y0 + LEGEND_ROW * r
        for kind, text, offset in row:
            x = x0 + offset
            if kind == "vram":
                draw.line([(x, y + 12), (x + 32, y + 12)], fill=INK, width=3)
            elif kind == "budget":
                _dashed(draw, x, x + 32, y + 12, OVER, 3)
            else:
                color = HEADROOM if kind == "headroom" else COLORS[kind]
                draw.rectangle([x, y + 2, x + 32, y + 22], fill=color)
            draw.text((x + 42, y + 12), text, font=font, fill=INK, anchor="lm")
