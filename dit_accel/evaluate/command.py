"""`dit-accel evaluate --samples S.npz --reference R.npz [--out results.json]`: the ADM evaluator's FID,
sFID, Inception Score, precision and recall, as a table and as JSON. Under `accelerate launch` every
process extracts the features of its share of the images. Flags are parsed before torch is imported."""

from __future__ import annotations

import argparse
from pathlib import Path

from dit_accel.cli_args import OneLineParser, positive_int
from dit_accel.errors import exit_command, exits_cleanly
from dit_accel.evaluate.report import report


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dit-accel evaluate",
        description="FID, sFID, Inception Score, precision and recall of a sample batch against a reference "
        "batch, as guided-diffusion's TensorFlow evaluator defines them (docs/evaluation.md). Run it under "
        "`accelerate launch` to extract features on every GPU.",
    )
    parser.add_argument("--samples", required=True, help="sample batch .npz (arr_0: uint8 N x H x W x 3)")
    parser.add_argument(
        "--reference",
        required=True,
        help="reference batch .npz in the ADM layout, e.g. VIRTUAL_imagenet256_labeled.npz (its mu/sigma/"
        "mu_s/sigma_s are used when present)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results JSON to write, whole or not at all (default: none: the table only)",
    )
    parser.add_argument(
        "--plumbing-check",
        action="store_true",
        help="run the whole path offline on a random Inception network (no weights needed): the table and the "
        "JSON, loudly labelled, with numbers that are NOT an FID (default: off)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        help="images per Inception forward pass on each process",
    )
    parser.add_argument(
        "--inception-weights",
        default=None,
        help="TF-ported Inception-v3 weights (default: weights-inception-2015-12-05-6726825d.pth in the torch "
        "hub cache, ~/.cache/torch/hub/checkpoints/)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where reference statistics are cached (default: ~/.cache/dit-accel/reference-stats)",
    )
    parser.add_argument(
        "--input-px",
        type=positive_int,
        default=299,
        help="side the images are resized to: the TF graph's 299; only tests lower it (75 is the least)",
    )
    return parser


def evaluate(args) -> int:
    from accelerate import Accelerator

    from dit_accel.evaluate.evaluator import Evaluator, check_enough
    from dit_accel.evaluate.features import NpzImages
    from dit_accel.evaluate.weights import check_evaluation_files

    if not args.plumbing_check:  # every missing file named at once
        check_evaluation_files(args.reference, args.inception_weights, "--reference")
    accelerator = Accelerator(cpu=not _cuda_available())
    samples = NpzImages(args.samples, "--samples")
    check_enough(len(samples), "the samples")
    evaluator = Evaluator(
        accelerator,
        args.inception_weights,
        args.batch_size,
        args.cache_dir,
        args.input_px,
        args.plumbing_check,
    )
    side = samples.shape[1] if samples.shape[1] == samples.shape[2] else None
    reference = evaluator.reference(args.reference, side)  # checked before the samples' features
    features = evaluator.npz_features(samples, desc="sample features")
    scores = evaluator.score(features, reference)
    if accelerator.is_main_process:
        scores = {"samples": str(Path(args.samples)), "reference": str(Path(args.reference)), **scores}
        scores["inception_weights"] = str(evaluator.weights)
        report(scores, reference, args.out)
    accelerator.wait_for_everyone()
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@exits_cleanly("dit-accel evaluate")
def main(argv: list[str] | None = None) -> int:
    from dit_accel.cpu_threads import cpu_threads

    args = build_parser().parse_args(argv)
    with cpu_threads():
        return evaluate(args)


if __name__ == "__main__":
    exit_command(main)
