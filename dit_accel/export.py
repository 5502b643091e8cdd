"""Weights out and in: `dit-accel export` (a checkpoint as a diffusers DiTPipeline folder) and
`dit-accel import-dit` (an original DiT `.pt` as a dit-accel run folder; `import-sit` and `import-repa` do
the same for SiT's and REPA's flow checkpoints, dit_accel.original_sit).

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

Import writes a run folder the trainer's `load_for_inference` and `dit-accel sample` read:

    OUT/checkpoints/step_00000000/   ema.safetensors, model.safetensors (the same weights: the released
                                     checkpoints hold the EMA only), plan.json (a placeholder plan for one
                                     80 GB GPU that records the network), train_state.json (step 0),
                                     dit_accel.json (the original's timestep shift, 0), COMPLETE
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

from dit_accel.atomic import staged_folder, write_json_atomically
from dit_accel.class_names import read_labels_file, run_class_names  # noqa: F401 (run_class_names: a public name here)
from dit_accel.cli_args import OneLineParser, positive_int, refuse_file
from dit_accel.errors import UserError, exits_cleanly

PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__: class_null = [1000] * batch_size
EXPORT_INFO = "dit_accel_export.json"  # in OUT/transformer/: the model's own class count before padding
SCHEDULER_CONFIG = {"timestep_spacing": "leading", "set_alpha_to_one": True, "steps_offset": 0}


# --- export ---------------------------------------------------------------------------------------------------
def pipeline_scheduler():
    """The scheduler an exported pipeline carries: DDIM on DiT's training betas (see the module docstring)."""
    from diffusers import DDIMScheduler

    from dit_accel.diffusion import DIT_SCHEDULER_CONFIG

    return DDIMScheduler(**DIT_SCHEDULER_CONFIG, **SCHEDULER_CONFIG)


def with_pipeline_null_class(model):
    """The model itself when its null class is already 1000, else a copy with the class table padded so the
    null class sits at row 1000 (DiTPipeline's fixed null label). Same outputs for every real class."""
    from dit_accel.model import build_model, set_timestep_freq_shift, spec_from_model, timestep_freq_shift

    spec = spec_from_model(model)
    if spec.num_classes == PIPELINE_NULL_CLASS:
        return model
    if spec.num_classes > PIPELINE_NULL_CLASS:
        raise UserError(
            f"this model has {spec.num_classes} classes, but DiTPipeline always uses label 1000 as the null "
            f"class for guidance, which would be a real class here: it cannot be exported as a DiTPipeline"
        )
    padded = build_model(dataclasses.replace(spec, num_classes=PIPELINE_NULL_CLASS), init="torch")
    set_timestep_freq_shift(padded, timestep_freq_shift(model))
    state = dict(model.state_dict())
    table_names = [name for name in state if name.endswith("class_embedder.embedding_table.weight")]
    table = state[table_names[0]]
    new_table = table[-1:].repeat(PIPELINE_NULL_CLASS + 1, 1)  # every row the null row ...
    new_table[: spec.num_classes] = table[: spec.num_classes]  # ... except the real classes
    for name in table_names:
        state[name] = new_table
    padded.load_state_dict(state)
    return padded.to(next(model.parameters()).device).eval()


def exported_num_classes(folder: str | os.PathLike) -> int | None:
    """The class count a pipeline (or its transformer) folder had before export padded it to 1,000."""
    from dit_accel.model import transformer_folder

    path = transformer_folder(folder) / EXPORT_INFO
    return int(json.loads(path.read_text())["num_classes"]) if path.is_file() else None


def unpad_class_table(parameters: dict, num_classes: int) -> dict:
    """The weights of an exported model with its class table back to `num_classes` + 1 rows (the real classes,
    then the null row from row 1000); refused unless the rows in between are the padding export wrote."""
    import torch

    names = [name for name in parameters if name.endswith("class_embedder.embedding_table.weight")]
    out = dict(parameters)
    for name in names:
        table = parameters[name]
        if table.shape[0] != PIPELINE_NULL_CLASS + 1 or num_classes >= PIPELINE_NULL_CLASS:
            raise ValueError(f"{name} has {table.shape[0]} rows: not a padded export")
        null_row = table[PIPELINE_NULL_CLASS : PIPELINE_NULL_CLASS + 1]
        if not torch.equal(
            table[num_classes:PIPELINE_NULL_CLASS], null_row.expand(PIPELINE_NULL_CLASS - num_classes, -1)
        ):
            raise ValueError(f"rows {num_classes}..999 of {name} are not export's padding: real classes")
        out[name] = torch.cat([table[:num_classes], null_row])
    return out


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
    from dit_accel.diffusion.flow import recorded_objective

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

    from dit_accel.data.vae import load_vae
    from dit_accel.model import export_diffusers, spec_from_model

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
    from dit_accel.sample import default_vae_path, load_source

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


# --- import ---------------------------------------------------------------------------------------------------
IMPORT_STEP = 0


def placeholder_plan(spec, objective: str = "ddpm") -> dict:
    """A real dit-plan plan (one 80 GB GPU, global batch 256) for the imported network: the checkpoint needs one
    to say which network it holds, and what it was trained under (a SiT or REPA model's flow objective).
    Fine-tuning makes its own plan for the GPUs it runs on."""
    from planner.errors import PlanError
    from planner.plan import make_plan

    family = (
        spec.name.removesuffix("-custom")
        if spec.name.startswith("DiT-") and spec.name != "DiT-custom"
        else f"DiT-S/{spec.patch}"
    )
    try:
        return make_plan(
            gpus=1,
            global_batch=256,
            vram="80GB",
            model=family,
            resolution=spec.resolution,
            latents=spec.latents,
            depth=spec.depth,
            hidden=spec.hidden,
            heads=spec.heads,
            patch=spec.patch,
            num_classes=spec.num_classes,
            round_global_batch=True,
            objective=objective,
        )
    except PlanError as error:
        raise UserError(f"cannot describe the imported {spec.name} with a plan ({error})") from None


def write_imported_checkpoint(
    model,
    out_dir: str | os.PathLike,
    source_name: str,
    *,
    overwrite: bool = False,
    objective: dict | None = None,
) -> Path:
    """A run folder with one complete checkpoint at step 0 holding `model` (see the module docstring);
    `objective` (a SiT or REPA flow model's) is recorded in its dit_accel.json for sample and export."""
    import torch
    from safetensors.torch import save_file

    from dit_accel import checkpoint as ckpt
    from dit_accel.model import SIDECAR_NAME, sidecar, spec_from_model
    from planner.planfile import spec_from_plan

    out_dir = Path(out_dir)
    spec = spec_from_model(model)
    if not spec.learn_sigma:
        raise UserError(
            "this checkpoint predicts no variance (learn_sigma off)",
            "dit-accel trains and samples DiTs with learned sigma only, as the released DiT checkpoints are",
        )
    plan = placeholder_plan(spec, (objective or {}).get("name", "ddpm"))
    rebuilt = spec_from_plan(plan)
    if dataclasses.replace(rebuilt, name=spec.name) != spec:
        raise UserError(
            f"the plan for the imported network describes {rebuilt}, not {spec}: report this as a bug"
        )
    with staged_folder(out_dir, overwrite) as staging:
        final_dir = ckpt.checkpoints_dir(staging) / ckpt.checkpoint_name(IMPORT_STEP)
        checkpoint_dir = final_dir.with_name(final_dir.name + ckpt.TMP_SUFFIX)
        checkpoint_dir.mkdir(parents=True)
        weights = {
            name: param.detach().to("cpu", torch.float32).contiguous()
            for name, param in model.named_parameters()
        }
        save_file(weights, str(checkpoint_dir / ckpt.EMA_WEIGHTS), metadata={"format": "pt"})
        try:  # the released checkpoints hold one set of weights: the raw-weights file is the same file
            os.link(checkpoint_dir / ckpt.EMA_WEIGHTS, checkpoint_dir / ckpt.MODEL_WEIGHTS)
        except OSError:
            shutil.copyfile(checkpoint_dir / ckpt.EMA_WEIGHTS, checkpoint_dir / ckpt.MODEL_WEIGHTS)
        write_json_atomically(checkpoint_dir / ckpt.PLAN, plan)
        write_json_atomically(staging / ckpt.PLAN, plan)
        write_json_atomically(
            checkpoint_dir / ckpt.TRAIN_STATE,
            {
                "step": IMPORT_STEP,
                "applied_steps": 0,
                "skipped_steps": 0,
                "imported_from": source_name,
                "world_size": None,
                "global_batch": None,
            },
        )
        recorded = sidecar(model) if objective is None else dict(sidecar(model), objective=objective)
        write_json_atomically(checkpoint_dir / SIDECAR_NAME, recorded)
        ckpt.commit(checkpoint_dir, final_dir, {"step": IMPORT_STEP, "imported_from": source_name})
    return out_dir


IMPORTED = {  # the command's layout -> what its --checkpoint is
    "dit": "an original DiT checkpoint (.pt state dict of the DiT repository, e.g. DiT-XL-2-256x256.pt)",
    "sit": "a SiT checkpoint (.pt state dict of the SiT repository, e.g. SiT-XL-2-256.pt), a flow model",
    "repa": "a REPA checkpoint (.pt of the REPA repository, e.g. its SiT-XL/2 last.pt), a flow model",
}


def build_import_parser(layout: str = "dit") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=f"dit-accel import-{layout}",
        description=f"Turn {IMPORTED[layout]} into a dit-accel run folder that `dit-accel sample` and "
        "`dit-accel export` read and that `dit_accel.train --init-from` fine-tunes.",
    )
    parser.add_argument("--checkpoint", required=True, help="the original .pt file")
    parser.add_argument("--out", required=True, help="the run folder to write")
    parser.add_argument(
        "--heads",
        type=positive_int,
        default=None,
        help="attention heads, only for a network outside the DiT family table (shapes do not tell)",
    )
    parser.add_argument(
        "--weights",
        choices=("ema", "model"),
        default="ema",
        help="for a training checkpoint holding both: which weights to import (default ema)",
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="allow pickled Python objects besides tensors in the file (only for files you trust)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    return parser


@exits_cleanly("dit-accel import-dit")
def import_main(argv: list[str] | None = None) -> int:
    args = build_import_parser().parse_args(argv)  # before the imports: --help needs no torch
    from dit_accel.model import spec_from_model
    from dit_accel.original_dit import load_original_dit

    refuse_file(args.out, "--out")
    model = load_original_dit(
        args.checkpoint, heads=args.heads, prefer=args.weights, trust_pickle=args.trust_checkpoint
    )
    out = write_imported_checkpoint(
        model, args.out, str(Path(args.checkpoint).name), overwrite=args.overwrite
    )
    spec = spec_from_model(model)
    print(
        f"wrote {out}: {spec.name} ({spec.depth} blocks x {spec.hidden}, {spec.resolution} px, {spec.num_classes} "
        f"classes) as a step-0 checkpoint with the original timestep shift (0); "
        f"sample it with `dit-accel sample --checkpoint {out} ...`"
    )
    return 0


def import_flow_main(layout: str, argv: list[str] | None) -> int:
    """`dit-accel import-sit` / `import-repa`: the checkpoint folded into dit-accel's flow convention
    (dit_accel.original_sit), recorded as a flow model."""
    args = build_import_parser(layout).parse_args(argv)  # before the imports: --help needs no torch
    from dit_accel.model import spec_from_model
    from dit_accel.original_sit import load_flow_checkpoint

    refuse_file(args.out, "--out")
    model, notes = load_flow_checkpoint(
        args.checkpoint, layout, heads=args.heads, prefer=args.weights, trust_pickle=args.trust_checkpoint
    )
    objective = {"name": "flow", "path": "linear", "time_sampling": "uniform"}
    out = write_imported_checkpoint(
        model, args.out, Path(args.checkpoint).name, overwrite=args.overwrite, objective=objective
    )
    spec = spec_from_model(model)
    for note in notes:
        print(f"import-{layout}: {note}")
    print(
        f"wrote {out}: {spec.name} ({spec.depth} blocks x {spec.hidden}, {spec.resolution} px, {spec.num_classes} "
        f"classes) as a step-0 flow checkpoint (linear path, velocity) with the original timestep shift (0); "
        f"sample it with `dit-accel sample --checkpoint {out} --sampler ode|sde ...`"
    )
    return 0


@exits_cleanly("dit-accel import-sit")
def import_sit_main(argv: list[str] | None = None) -> int:
    return import_flow_main("sit", argv)


@exits_cleanly("dit-accel import-repa")
def import_repa_main(argv: list[str] | None = None) -> int:
    return import_flow_main("repa", argv)


if __name__ == "__main__":
    sys.exit(main())
