"""What dit-plan shows people: tables that fit 100 columns, LaTeX that compiles, plan.md for a reviewer, the
memory chart and --plot."""

import json
import re
import shutil
import subprocess

import pytest
from PIL import Image

from planner import cli, report
from planner.plan import make_plan
from planner.report import latex, tables, terminal
from planner.report.latex import latex_document, tex_escape
from planner.report.terminal import TERMINAL_COLUMNS, fit_table

SPECIALS = "50% a_b #1 R&D $5 ~x 2^30 C:\\dir {b} <i> a|b"
ESCAPED = r"50\% a\_b \#1 R\&D \$5 $\sim$x $2^{30}$ C:$\backslash$dir \{b\} $<$i$>$ a$|$b"


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def plans():
    """Plans whose tables are wide: the long path on one GPU (checkpointing), two nodes, and time to train."""
    return [
        make_plan(gpus=8, vram="40G", global_batch=256, steps=400_000, gpu_hour_cost=2),
        make_plan(gpus=1, gpu="rtx4090", global_batch=256, resolution=512, steps=400_000),
        make_plan(gpus=8, nodes=2, gpu="h100-80g", global_batch=256, main_process_ip="10.0.0.1"),
    ]


def _tables(text: str) -> list[str]:
    """The lines of a terminal render that belong to tables (not the title, notes and warnings)."""
    return [line for line in text.splitlines() if not line.startswith(("! ", "units:", "DiT-"))]


def test_every_table_fits_100_columns_and_says_what_it_left_out(plans):
    for plan in plans:
        for name, kind, headers, rows in tables.plan_tables(plan):
            text = terminal.terminal_table(kind, headers, rows)
            assert max(len(line) for line in text.splitlines()) <= TERMINAL_COLUMNS, (name, text)
            if "--wide" not in text:  # no footnote: nothing left out, no cell wrapped (headers may be)
                assert all(str(cell) in text for row in rows for cell in row), text
        rendered = report.render(plan)
        assert max(len(line) for line in _tables(rendered)) <= TERMINAL_COLUMNS
        # the title and the warnings too: a warning once ran to 401 columns
        assert max(len(line) for line in rendered.splitlines()) <= TERMINAL_COLUMNS, rendered


def test_the_decision_table_leaves_out_the_least_important_columns_first(plans):
    headers, rows = tables.decision_rows(plans[0])
    text, note = fit_table(headers, rows, (), terminal.LEAVE_OUT_FIRST["decision"])
    assert "micro-" in text and "est. img/s" in text  # the decision itself stays
    assert note.startswith("(left out to fit 100 columns: latents") and "--wide shows every column" in note
    wide = report.render(plans[0], wide=True)
    assert "precomputed" in wide and "checkpointed blocks" in wide  # every column, headers on one line


def test_fitting_wraps_text_keeps_every_word_and_handles_any_columns():
    headers = ["name", "size", "an extra column someone adds", "what"]
    rows = [[f"row{i}", "1.00", "x" * 10, "word " * 40] for i in range(3)]
    text, note = fit_table(headers, rows, wrap=("what",))
    assert max(len(line) for line in text.splitlines()) <= 100
    assert text.count("word") == 120 and note == "(what wrapped to fit 100 columns; --wide unwraps)"
    text, note = fit_table(["a", "b"], [["1", "2"]])
    assert note is None and text == terminal.tabulate([["1", "2"]], headers=["a", "b"], disable_numparse=True)


def test_the_sweep_table_fits_100_columns(capsys):
    argv = ["--gpu", "a100-40g,h100-80g", "--gpus", "7,8", "--resolution", "256,512", "--format", "json"]
    code, out, _ = run(argv, capsys)
    rows = json.loads(out)
    assert code == 0 and len(rows) == 8
    text = report.render_sweep(rows)
    assert max(len(line) for line in text.splitlines()) <= TERMINAL_COLUMNS
    words = " ".join(text.split())
    assert "not divide by the 7 GPUs" in words and "--wide shows" in text  # the note: wrapped, kept
    assert "1 x 7" in text and "1 x 8" in text and "512" in text  # what the rows differ in stays
    wide = report.render_sweep(rows, wide=True)
    assert max(len(line) for line in wide.splitlines()) > TERMINAL_COLUMNS and "precision" in wide


def test_tex_escape_covers_every_special_character():
    assert tex_escape(SPECIALS) == ESCAPED
    assert tex_escape("2 x 8 -> GPUs") == "2 x 8 -$>$ GPUs"
    assert tex_escape("a ^ b") == r"a \^{} b"  # a caret that is not a power


def test_latex_prints_flags_quotes_and_powers_as_written():
    # `--` and `---` are TeX ligatures (en and em dash): every hyphen before another is kept apart
    assert tex_escape("--gpus 8 --no-chart") == "-{}-gpus 8 -{}-no-chart"
    assert tex_escape("a---b") == "a-{}-{}-b"
    assert tex_escape("well-known") == "well-known"
    # a straight quote prints as a closing one: quotations open with `` and ` and close with '' and '
    assert tex_escape('the "reserved" peak') == "the ``reserved'' peak"
    assert tex_escape('("quoted")') == "(``quoted'')"
    assert tex_escape("it's 'fused'") == "it's `fused'"
    # 10^9 in math mode, not a circumflex accent over the next digit
    assert tex_escape("G/GB = 10^9 bytes, GiB = 2^30") == "G/GB = $10^{9}$ bytes, GiB = $2^{30}$"
    assert tex_escape("2 \u00d7 8 \u2248 16 \u2013 \u2192") == r"2 $\times$ 8 $\approx$ 16 -- $\rightarrow$"
    assert tex_escape("caf\u00e9") == "caf?"  # other non-ASCII: replaced, never a font error


def test_latex_escapes_every_cell_heading_and_warning(plans, monkeypatch):
    plan = json.loads(json.dumps(plans[0]))
    plan["model"]["name"] = SPECIALS
    plan["units"] = SPECIALS
    plan["warnings"] = [SPECIALS]
    special_tables = [(f"table {SPECIALS}", "memory", [SPECIALS, "what"], [[SPECIALS, SPECIALS]] * 2)]
    monkeypatch.setattr(latex, "plan_tables", lambda _: special_tables)
    text = report.render(plan, "latex")
    assert text.startswith(r"\documentclass{article}") and text.endswith("\\end{document}\n")
    assert rf"{ESCAPED} & what \\" in text and rf"{ESCAPED} & {ESCAPED} \\" in text
    assert rf"\subsection*{{table {ESCAPED}}}" in text and rf"\item {ESCAPED}" in text
    assert f"units: {ESCAPED}" in text
    for line in text.splitlines():  # no raw special left: each is escaped or part of a command
        bare = re.sub(
            r"\\\\$|\\[%_#&${}~^]|\\[a-zA-Z]+\*?|\$[<>|]\$|\$\\(backslash|sim)\$|\$\d+\^\{\d+\}\$| & |\{|\}",
            "",
            line,
        )
        assert not set(bare) & set("%_#&$~^\\"), line


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no TeX engine installed (pdflatex)")
def test_the_latex_compiles(plans, tmp_path, capsys):
    documents = {f"plan{i}": report.render(plan, "latex") for i, plan in enumerate(plans)}
    code, out, _ = run(["--gpu", "a100-40g,h100-80g", "--gpus", "7,8", "--format", "latex"], capsys)
    documents["sweep"] = out
    code, out, _ = run(
        ["--gpus", "8", "--vram", "40G", "--format", "latex", "--out", str(tmp_path / "p")], capsys
    )
    assert code == 0 and "includegraphics" in out
    documents["with-chart"] = out
    documents["specials"] = latex_document(
        SPECIALS, [SPECIALS], [(SPECIALS, [SPECIALS], [[SPECIALS]], ())], [SPECIALS]
    )
    for name, text in documents.items():
        (tmp_path / f"{name}.tex").write_text(text)
        result = subprocess.run(
            ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", f"{name}.tex"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and (tmp_path / f"{name}.pdf").stat().st_size > 1000, result.stdout[
            -2000:
        ]


@pytest.mark.parametrize("fmt", ["markdown", "github", "latex", "json"])
def test_document_formats_write_only_the_document_to_stdout(tmp_path, capsys, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    code, alone, err = run(["--gpus", "8", "--vram", "40G", "--format", fmt], capsys)
    assert code == 0 and err == "" and list(tmp_path.iterdir()) == []  # no ./plan, no chart
    assert alone.endswith("\n") and not alone.endswith("\n\n")
    code, out, err = run(["--gpus", "8", "--vram", "40G", "--format", fmt, "--out", "p"], capsys)
    assert code == 0 and "wrote" not in out and err.startswith("wrote ") and "plan.json" in err
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "accelerate_config.yaml",
        "memory.png",
        "plan.json",
        "plan.md",
    ]
    if fmt == "latex":
        assert out.startswith(r"\documentclass") and out.endswith("\\end{document}\n")
        assert "graphicx" not in alone and "includegraphics" not in alone  # no chart was written
        assert r"keepaspectratio]{p/memory.png}" in out and r"\usepackage{graphicx}" in out
    elif fmt == "json":
        assert json.loads(alone) == json.loads(out) == json.loads((tmp_path / "p" / "plan.json").read_text())
    else:
        assert out.startswith("### DiT-XL/2") and out == alone


def test_latex_includes_the_chart_only_where_tex_can_read_its_name():
    assert latex._graphic("plan/memory.png").endswith("{plan/memory.png}")
    assert latex._graphic("50%/memory.png") == r"the memory chart: 50\%/memory.png"


def test_plan_md_is_ordered_for_a_reviewer(tmp_path, capsys):
    argv = ["--gpus", "8", "--vram", "40G", "--global-batch", "256", "--out", str(tmp_path / "p")]
    assert run(argv, capsys)[0] == 0
    text = (tmp_path / "p" / "plan.md").read_text()
    lines = text.splitlines()
    assert lines[2:5] == ["```", "dit-plan " + " ".join(argv), "```"]  # the exact command line, first
    version = cli.package_version()
    assert re.search(rf"^dit-accel {re.escape(version)}, written \d{{4}}-\d\d-\d\d \d\d:\d\d UTC", text, re.M)
    order = [text.index(h) for h in ("## Decision", "## Warnings", "## Memory per GPU", "## Assumptions")]
    assert order == sorted(order)
    details = text[text.index("<details>") : text.index("</details>")]
    assert "| sharding   | micro-batch" in details  # the search path, folded away
    assumptions = text[text.index("## Assumptions") : text.index("## How the decision")]
    assert "| cuda_context_bytes " in assumptions and "512 MiB" in assumptions and "25 GB/s" in assumptions
    assert "536870912" not in assumptions and "25000000000" not in assumptions
    assert "![Memory per GPU" in text and "](memory.png)" in text


def test_memory_png_is_written_with_the_plan(tmp_path, capsys):
    assert run(["--gpus", "8", "--vram", "40G", "--out", str(tmp_path / "p")], capsys)[0] == 0
    with Image.open(tmp_path / "p" / "memory.png") as image:
        assert image.format == "PNG" and image.size == (1600, 900)


def test_the_chart_shows_every_alternative_by_component(plans):
    from planner.components import COMPONENTS
    from planner.memorychart import alternative_components

    for plan in plans:
        for alternative in plan["alternatives"]:
            parts = alternative_components(plan, alternative)
            assert parts is not None and set(parts) == set(COMPONENTS)
            assert sum(parts.values()) == alternative["peak_bytes"]


def test_a_failing_chart_leaves_no_file(tmp_path, capsys, monkeypatch):
    import planner.memorychart

    def broken(plan):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(planner.memorychart, "memory_chart", broken)
    with pytest.raises(RuntimeError):
        cli.main(["--gpus", "8", "--vram", "40G", "--out", str(tmp_path / "p")])
    assert list(tmp_path.iterdir()) == []


def test_plot_draws_a_sweep_and_a_single_plan(tmp_path, capsys):
    sweep = tmp_path / "sweep.png"
    code, out, err = run(["--gpu", "a100-80g", "--gpus", "8,16,32", "--plot", str(sweep)], capsys)
    assert code == 0 and f"wrote {sweep}" in out and "2 x 8" in out
    with Image.open(sweep) as image:
        assert image.size == (900, 500)
    single = tmp_path / "candidates.svg"
    argv = [
        "--gpus",
        "8",
        "--vram",
        "40G",
        "--plot",
        str(single),
        "--out",
        str(tmp_path / "p"),
        "--format",
        "json",
    ]
    code, out, err = run(argv, capsys)
    assert code == 0 and json.loads(out)["schema"] == "dit-plan/1" and str(single) in err
    assert single.read_text().lstrip().startswith("<?xml") and "micro-batch per GPU" in single.read_text()
    code, _, err = run(
        ["--gpu", "a100-80g", "--gpus", "8,16", "--plot", str(tmp_path / "no" / "x.png")], capsys
    )
    assert code == 2 and "does not exist" in err


def test_the_micro_batch_chart_uses_the_planners_own_figures(plans):
    from planner.plot import micro_batch_curves

    for plan in plans:
        d = plan["decision"]
        points = {b: (peak, rate) for b, peak, rate in micro_batch_curves(plan)[d["sharding"]]}
        peak, rate = points[d["micro_batch"]]
        assert peak == plan["memory"]["peak_bytes"] and rate == plan["throughput"]["est_images_per_s"]


def test_no_chart_writes_the_plan_without_it(tmp_path, capsys):
    assert run(["--gpus", "8", "--vram", "40G", "--no-chart", "--out", str(tmp_path / "p")], capsys)[0] == 0
    assert not (tmp_path / "p" / "memory.png").exists()
    assert "memory.png" not in (tmp_path / "p" / "plan.md").read_text()


def test_the_memory_chart_says_whether_it_fits_and_starts_at_the_vram_line(plans):
    """The verdict line is green when the peak fits the budget and red when it does not; the VRAM line is at
    the top of the panels (no empty strip above it)."""
    import copy
    import io

    from PIL import ImageColor

    from planner import memorychart

    def colours(plan) -> tuple[set, Image.Image]:
        image = Image.open(io.BytesIO(memorychart.memory_chart(plan))).convert("RGB")
        verdict = image.crop((40, 64, 1000, 100))
        return {colour for _, colour in verdict.getcolors(1_000_000)}, image

    fits, over = (ImageColor.getrgb(c) for c in (memorychart.FITS, memorychart.OVER))
    seen, image = colours(plans[0])
    assert fits in seen and over not in seen
    ink = ImageColor.getrgb(memorychart.INK)
    first_ink = next(y for y in range(150, 600) if image.getpixel((100, y)) == ink)
    assert first_ink <= 220  # the panels start at 210: the VRAM line, not an empty strip
    tight = copy.deepcopy(plans[0])
    tight["memory"]["budget_bytes"] = tight["memory"]["peak_bytes"] // 2
    seen, _ = colours(tight)
    assert over in seen and fits not in seen
