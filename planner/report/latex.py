"""--format latex: a plan or a sweep as a whole document that pdflatex compiles (`> plan.tex`).

Every cell, heading, note and warning is escaped so that it prints as written: the special characters, a
`--flag` (kept from TeX's en-dash ligature), quotation marks (opening and closing), powers such as 10^9
(in math mode, not a circumflex accent) and the non-ASCII signs the planner prints.
"""

from __future__ import annotations

import re

from planner.report.tables import TEXT_COLUMNS, plan_notes, plan_tables, sweep_headers, sweep_table, title

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
    "~": r"$\sim$",
    "^": r"\^{}",
    "<": r"$<$",
    ">": r"$>$",
    "|": r"$|$",
    "\u00d7": r"$\times$",
    "\u2248": r"$\approx$",
    "\u2264": r"$\leq$",
    "\u2265": r"$\geq$",
    "\u00b1": r"$\pm$",
    "\u2192": r"$\rightarrow$",
    "\u00b5": r"$\mu$",
    "\u03bc": r"$\mu$",
    "\u2013": "--",
    "\u2014": "---",
}
_POWER = re.compile(r"(\d+)\^(\d+)")  # 10^9, 2^30
_OPENS_AFTER = " \t\n([{/"  # a quotation mark after these (or first) opens a quotation


def _escape_plain(text: str) -> str:
    out = []
    for i, ch in enumerate(text):
        before = text[i - 1] if i else " "
        after = text[i + 1] if i + 1 < len(text) else " "
        if ch == "-" and after == "-":
            out.append("-{}")  # `--flag`, not an en dash
        elif ch == '"':
            out.append("``" if before in _OPENS_AFTER else "''")
        elif ch == "'" and before in _OPENS_AFTER and not after.isspace():
            out.append("`")  # an opening single quote; after a letter it stays an apostrophe
        else:
            out.append(_TEX.get(ch, ch if ord(ch) < 128 else "?"))
    return "".join(out)


def tex_escape(text) -> str:
    """Text as LaTeX typesets it literally: every special character escaped, non-ASCII replaced."""
    text, out, start = str(text), [], 0
    for power in _POWER.finditer(text):
        out += [_escape_plain(text[start : power.start()]), f"${power[1]}^{{{power[2]}}}$"]
        start = power.end()
    return "".join(out) + _escape_plain(text[start:])


def latex_table(headers, rows, wrap=()) -> str:
    """A tabular with every cell escaped; `wrap` columns become paragraph columns."""
    spec = " ".join(r"p{6cm}" if h in wrap else "l" for h in headers)
    lines = [r"\begin{tabular}{" + spec + "}", r"\hline"]
    lines.append(" & ".join(tex_escape(h) for h in headers) + r" \\")
    lines.append(r"\hline")
    lines += [" & ".join(tex_escape(cell) for cell in row) + r" \\" for row in rows]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines)


def _graphic(path: str) -> str:
    """\\includegraphics of a file, or its name as text where TeX cannot read it as a file name."""
    if set(path) & set("%#{}\\$&~^"):
        return "the memory chart: " + tex_escape(path)
    return r"\includegraphics[width=\linewidth,height=0.75\textheight,keepaspectratio]{" + path + "}"


def latex_document(
    heading: str, notes: list[str], tables: list, warnings: list[str], chart: str | None = None
) -> str:
    """A whole document that pdflatex compiles: `tables` is [(name, headers, rows, wrap)]; `chart`, an image
    file (the plan's memory.png, as a path from where pdflatex runs) shown after the tables."""
    out = [
        r"\documentclass{article}",
        r"\usepackage[landscape,margin=1.5cm]{geometry}",
        *([r"\usepackage{graphicx}"] if chart else []),
        r"\begin{document}",
        r"\footnotesize",
        r"\section*{" + tex_escape(heading) + "}",
    ]
    out += [tex_escape(note) + r"\par" for note in notes]
    for name, headers, rows, wrap in tables:
        out += [r"\subsection*{" + tex_escape(name) + "}", r"\noindent", latex_table(headers, rows, wrap)]
    if chart:
        out += [r"\subsection*{Memory per GPU, chart}", r"\noindent " + _graphic(chart)]
    if warnings:
        out += [r"\subsection*{Warnings}", r"\begin{itemize}"]
        out += [r"\item " + tex_escape(w) for w in warnings]
        out.append(r"\end{itemize}")
    out.append(r"\end{document}")
    return "\n".join(out) + "\n"


def plan_latex(plan: dict, chart: str | None = None) -> str:
    tables = [(name, headers, rows, TEXT_COLUMNS[kind]) for name, kind, headers, rows in plan_tables(plan)]
    return latex_document(title(plan), plan_notes(plan), tables, plan["warnings"], chart)


def sweep_latex(rows: list[dict]) -> str:
    return latex_document(
        "dit-plan sweep", [], [("Sweep", sweep_headers(rows), sweep_table(rows), TEXT_COLUMNS["sweep"])], []
    )
