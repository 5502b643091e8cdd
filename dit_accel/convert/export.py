"""`dit-accel export`: a checkpoint as a diffusers DiTPipeline folder (the `import-*` commands, the other way, are
`convert.imports`).

Export writes, atomically (a staging folder, then a rename):

    OUT/model_index.json   DiTPipeline, its three components, and id2label (the run's class names)
    OUT/transformer/       stock DiTTransformer2DModel layout (the tied embedder copied into every block)
    OUT/vae/               the AutoencoderKL the model was trained with
    OUT/scheduler/         DDIMScheduler with DiT's training betas (linear 1e-4..0.02 over 1000 steps),
                           "leading" timesteps, clip_sample off: `dit-accel sample --sampler ddim` walks the
                           same steps, so both give the same latents for the same seed and step count

DiTPipeline hard-codes the null class of guidance as 1000, so a model with fewer classes is exported with
its class table padded to 1001 rows: rows 0..K-1 are its classes, row 1000 its null class, and the unused
rows in between copy the null row (asking for such a class samples unconditionally). More than 1000
classes cannot work with DiTPipeline's guidance and is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from dit_accel.atomic import staged_folder, write_json_atomically
from dit_accel.class_names import read_labels_file, run_class_names
from dit_accel.cli_args import OneLineParser, refuse_file
from dit_accel.errors import UserError, exits_cleanly

SCHEDULER_CONFIG = {"timestep_spacing": "leading", "set_alpha_to_one": True, "steps_offset": 0}


# --- export ---------------------------------------------------------------------------------------------------
def pipeline_scheduler():
    """The scheduler an exported pipeline carries: DDIM on DiT's training betas (see the module docstring)."""
    from diffusers import DDIMScheduler

    from dit_accel.diffusion.objective import DIT_SCHEDULER_CONFIG

    return DDIMScheduler(**DIT_SCHEDULER_CONFIG, **SCHEDULER_CONFIG)


def refuse_pixel_space(spec) -> None:
    """Asked before anything else (the VAE above all): a pixel-space model has no DiTPipeline form."""
    if spec.latents == "pixel":
        raise UserError(
            "this model works in pixel space, but a DiTPipeline always decodes latents with a VAE",
            "sample it with `dit-accel sample`, or train on latents to export (on a laptop: "
            "`dit-accel demo-data DIR --resolution 64 --vae VAE_DIR`, then extract-latents; README, CPU tour)",
        )


def refuse_flow_model(checkpoint) -> None:
    """A flow model (SiT, REPA, --objective flow) takes t in [0, 1] and predicts a velocity: DiTPipeline's
    schedulers call the network with timesteps in [0, 1000) and step an epsilon, so there is no DiTPipeline
    form that samples it right. Refused before the VAE is read."""
    from dit_accel.run.weights import recorded_objective

    if recorded_objective(checkpoint).get("name") == "flow":
        raise UserError(
            "this is a flow model (--objective flow, or imported from SiT/REPA): DiTPipeline calls its network "
            "with timesteps in [0, 1000) and steps an epsilon, so no DiTPipeline samples it right",
            "sample it with `dit-accel sample --sampler ode|sde` (its checkpoint records the objective)",
        )


def write_pipeline(
    model,
    vae_path: str,
    out_dir: str | os.PathLike,
    class_names: list[str] | None = None,
    *,
    allow_freq_shift_change: bool = False,
    overwrite: bool = False,
) -> Path:
    """A DiTPipeline folder that `DiTPipeline.from_pretrained(out_dir)` loads offline (see the module docstring)."""
    import diffusers

    from dit_accel.models.diffusers_format import (
        EXPORT_INFO,
        PIPELINE_NULL_CLASS,
        export_diffusers,
        with_pipeline_null_class,
    )
    from dit_accel.models.dit import spec_from_model
    from dit_accel.models.vae import load_vae

    out_dir = Path(out_dir)
    spec = spec_from_model(model)
    refuse_pixel_space(spec)
    if class_names is not None and len(class_names) > spec.num_classes:
        raise UserError(
            f"{len(class_names)} class names for a model with {spec.num_classes} classes: pass the "
            f"--labels the model was trained with"
        )
    exported = with_pipeline_null_class(model)
    vae, _identity = load_vae(vae_path)
    with staged_folder(out_dir, overwrite) as staging:
        export_diffusers(exported, staging / "transformer", allow_freq_shift_change=allow_freq_shift_change)
        write_json_atomically(  # what --init-from reads to take the padding off again
            staging / "transformer" / EXPORT_INFO,
            {
                "num_classes": spec.num_classes,
                "padded_to": PIPELINE_NULL_CLASS,
                "null_class_row": PIPELINE_NULL_CLASS,
            },
        )
        vae.save_pretrained(staging / "vae")
        pipeline_scheduler().save_pretrained(staging / "scheduler")
        index = {
            "_class_name": "DiTPipeline",
            "_diffusers_version": diffusers.__version__,
            "scheduler": ["diffusers", "DDIMScheduler"],
            "transformer": ["diffusers", "DiTTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        }
        if class_names:
            index["id2label"] = {str(i): name for i, name in enumerate(class_names)}
        write_json_atomically(staging / "model_index.json", index)
    return out_dir


def build_export_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dit-accel export",
        description="Write a checkpoint as a diffusers DiTPipeline folder (transformer, VAE, DDIM scheduler with "
        "DiT's betas, id2label): DiTPipeline.from_pretrained(OUT) loads it offline.",
    )
    parser.add_argument(
        "--checkpoint", required=True, help="run folder, checkpoint folder, or diffusers DiT folder"
    )
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="export the EMA weights (default) or, with --no-ema, the raw weights",
    )
    parser.add_argument(
        "--vae", default=None, help="AutoencoderKL folder (default: the one the run was trained with)"
    )
    parser.add_argument(
        "--labels",
        default=None,
        help="class names: a classes.json or JSON list (default: the run's classes.json)",
    )
    parser.add_argument("--out", required=True, help="the pipeline folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument(
        "--allow-freq-shift-change",
        action="store_true",
        help="export a model imported from an original DiT checkpoint anyway: stock diffusers runs it "
        "with its own timestep frequencies (shift 1), so outputs differ slightly",
    )
    return parser


@exits_cleanly("dit-accel export")
def main(argv: list[str] | None = None) -> int:
    args = build_export_parser().parse_args(argv)  # before the imports: --help needs no torch
    from dit_accel.sample.generate import default_vae_path, load_source, warn_about_the_ema

    refuse_file(args.out, "--out")
    source = load_source(args.checkpoint, use_ema=args.ema)
    refuse_flow_model(source.info["checkpoint"])
    refuse_pixel_space(source.spec)
    vae_path = args.vae or default_vae_path(source)
    if not vae_path:
        raise UserError(
            "no VAE is recorded with this run: pass --vae DIR (the AutoencoderKL folder it was trained with)"
        )
    class_names = read_labels_file(args.labels) if args.labels else run_class_names(source)
    warn_about_the_ema(source, "export")  # the request is good: what it will hold
    with warnings.catch_warnings(record=True) as caught:  # the library's warning, as this command's line
        warnings.simplefilter("always", UserWarning)
        out = write_pipeline(
            source.model,
            vae_path,
            args.out,
            class_names,
            allow_freq_shift_change=args.allow_freq_shift_change,
            overwrite=args.overwrite,
        )
    for warning in caught:
        if issubclass(warning.category, UserWarning) and "frequency shift" in str(warning.message):
            print(f"dit-accel export: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    labels = (
        f"{len(class_names)} class names" if class_names else "no class names (pass --labels to add them)"
    )
    print(
        f"wrote {out}: DiTPipeline ({source.spec.name}, {source.info['weights']} weights), VAE from {vae_path}, "
        f"DDIMScheduler with DiT's betas, {labels}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
