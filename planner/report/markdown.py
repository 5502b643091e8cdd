"""--format markdown|github: a plan or a sweep as a markdown document for a review or an issue."""

from __future__ import annotations

from tabulate import tabulate

from planner.report.tables import (
    TABLEFMT,
    forecast_lines,
    plan_notes,
    plan_tables,
    sweep_headers,
    sweep_table,
    title,
)


def markdown_table(headers, rows, fmt: str = "markdown") -> str:
    return tabulate(rows, headers=headers, tablefmt=TABLEFMT[fmt], disable_numparse=True)


def plan_markdown_text(plan: dict, fmt: str = "markdown") -> str:
    """One plan: `###` headings over its tables, the warnings as a list."""
    out = [f"### {title(plan)}", *plan_notes(plan), ""]
    for name, _, headers, rows in plan_tables(plan):
        out += [f"### {name}", markdown_table(headers, rows, fmt), ""]
    forecast = forecast_lines(plan)
    out += [*forecast, ""] if forecast else []
    if plan["warnings"]:
        out.append("### Warnings")
        out += ["- " + w for w in plan["warnings"]]
    return "\n".join(out).rstrip() + "\n"


def sweep_markdown_text(rows: list[dict], fmt: str = "markdown") -> str:
    return markdown_table(sweep_headers(rows), sweep_table(rows), fmt) + "\n"
