"""--format table: a plan and a sweep for the terminal, every table fitted to 100 columns (--wide: unwrapped)."""

from __future__ import annotations

import re
import textwrap

from tabulate import tabulate

from planner.report.tables import (
    TEXT_COLUMNS,
    forecast_lines,
    plan_notes,
    plan_tables,
    sweep_headers,
    sweep_table,
    title,
)

TERMINAL_COLUMNS = 100  # what the terminal tables fit unless --wide
# The columns of each table left out first when wrapping its text is not enough (with a footnote).
LEAVE_OUT_FIRST = {
    "decision": ("latents", "EMA", "% VRAM", "precision"),
    "alternatives": ("% VRAM",),
    "sweep": ("precision", "% VRAM", "ckpt blocks"),
    "forecast": ("(range)",),
}


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


def terminal_table(kind: str, headers, rows, wide: bool = False) -> str:
    """A table for the terminal: fitted to 100 columns with a footnote, or every column with --wide."""
    if wide:
        return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    text, note = fit_table(headers, rows, TEXT_COLUMNS[kind], LEAVE_OUT_FIRST.get(kind, ()))
    return text if note is None else f"{text}\n{note}"


def plan_text(plan: dict, wide: bool = False) -> str:
    """One plan: its title and notes, each table under its name, then the warnings marked `!`."""
    out = [textwrap.fill(title(plan), TERMINAL_COLUMNS, subsequent_indent="  "), *plan_notes(plan), ""]
    for name, kind, headers, rows in plan_tables(plan):
        out += [name, terminal_table(kind, headers, rows, wide), ""]
    forecast = forecast_lines(plan)  # the --target-fid answer and what the milestones are
    if forecast:
        out += [*(textwrap.fill(line, TERMINAL_COLUMNS) for line in forecast), ""]
    if plan["warnings"]:
        out.append("Warnings")
        out += [
            textwrap.fill(
                w, TERMINAL_COLUMNS, initial_indent="! ", subsequent_indent="  ", break_on_hyphens=False
            )
            for w in plan["warnings"]
        ]
    return "\n".join(out).rstrip() + "\n"


def sweep_text(rows: list[dict], wide: bool = False) -> str:
    return terminal_table("sweep", sweep_headers(rows), sweep_table(rows), wide) + "\n"
