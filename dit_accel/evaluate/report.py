"""What an evaluation prints and writes (`evaluate`, `sample --evaluate`): the table of the five numbers, the
FID line with its sample count, the warning when the count is not the papers', and the JSON. No torch."""

from __future__ import annotations

from pathlib import Path

from dit_accel.evaluate import PAPER_SAMPLES

METRIC_ROWS = (  # key, name in the table
    ("fid", "FID"),
    ("sfid", "sFID"),
    ("inception_score", "Inception Score"),
    ("precision", "Precision"),
    ("recall", "Recall"),
)


def table(scores: dict, reference_note: str) -> str:
    from tabulate import tabulate

    count = f"{scores['num_samples']:,} samples"
    notes = {
        "fid": f"{count} vs {reference_note}",
        "sfid": f"{count}, mixed_6/conv features",
        "inception_score": f"{count}, {scores['inception_score_splits']} split(s) of 5,000",
        "precision": f"k = 3, {scores['num_reference']:,} reference images",
        "recall": f"k = 3, {count}",
    }
    rows = [(name, f"{scores[key]:.4f}", notes[key]) for key, name in METRIC_ROWS]
    return tabulate(
        rows,
        headers=("metric", "value", "measured on"),
        disable_numparse=True,
        colalign=("left", "right", "left"),
    )


def fid_line(scores: dict, reference_note: str) -> str:
    """The one line to quote: 'FID 2.2700 (50,000 samples vs 10,000 reference images)'."""
    return f"FID {scores['fid']:.4f} ({scores['num_samples']:,} samples vs {reference_note})"


def report(scores: dict, reference, out: str | Path | None) -> None:
    """The main process's output of an evaluation (`evaluate`, `sample --evaluate`): the table, the FID line
    with its sample count, a warning when the count is not the papers', and the JSON written whole."""
    from dit_accel.atomic import write_json_atomically

    plumbing = scores.get("plumbing_check")
    if plumbing:
        print(f"!!! PLUMBING CHECK with {plumbing}: the path runs, the numbers mean nothing")
    print(table(scores, reference.describe()))
    print(fid_line(scores, reference.describe()) + (" -- PLUMBING CHECK, not an FID" if plumbing else ""))
    if warning := sample_count_warning(scores["num_samples"]):
        print(warning)
    if out:
        write_json_atomically(out, scores)
        print(f"wrote {out}")


def sample_count_warning(num_samples: int) -> str | None:
    if num_samples == PAPER_SAMPLES:
        return None
    return (
        f"! {num_samples:,} samples, not the {PAPER_SAMPLES:,} the papers score: FID falls as the count grows, "
        f"so compare it only with FIDs of {num_samples:,} samples"
    )
