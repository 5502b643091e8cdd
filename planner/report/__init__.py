"""A plan or a sweep for people, in each --format: `terminal` (table), `markdown` (markdown, github),
`latex` and JSON here; `planmd` writes plan.md; `tables` holds the rows all of them lay out."""

from __future__ import annotations

import json

from planner.report.latex import plan_latex, sweep_latex
from planner.report.markdown import plan_markdown_text, sweep_markdown_text
from planner.report.terminal import plan_text, sweep_text

FORMATS = ("table", "markdown", "github", "latex", "json")


def render(plan: dict, fmt: str = "table", wide: bool = False, chart: str | None = None) -> str:
    """One plan in any --format; `chart`: the memory chart's path, which the LaTeX document includes."""
    if fmt == "json":
        return json.dumps(plan, indent=2) + "\n"
    if fmt == "latex":
        return plan_latex(plan, chart)
    if fmt == "table":
        return plan_text(plan, wide)
    return plan_markdown_text(plan, fmt)


def render_sweep(rows: list[dict], fmt: str = "table", wide: bool = False) -> str:
    """A sweep's rows (sweep_row) in any --format."""
    if fmt == "json":
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "latex":
        return sweep_latex(rows)
    if fmt == "table":
        return sweep_text(rows, wide)
    return sweep_markdown_text(rows, fmt)
