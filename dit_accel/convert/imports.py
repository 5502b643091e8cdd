"""`dit-accel import-dit`, `import-sit`, `import-repa`: a published `.pt` checkpoint (the original DiT, SiT
or REPA repository's) written as a step-0 run folder that sample, export and `--init-from` read like any
other. The weight conversions themselves are `models.original_dit` and `models.original_sit`.

Import writes a run folder the trainer's `load_for_inference` and `dit-accel sample` read:

    OUT/checkpoints/step_00000000/   ema.safetensors, model.safetensors (the same weights: the released
                                     checkpoints hold the EMA only), plan.json (a placeholder plan for one
                                     80 GB GPU that records the network), train_state.json (step 0),
                                     dit_accel.json (the original's timestep shift, 0), COMPLETE
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from pathlib import Path

from dit_accel.atomic import staged_folder, write_json_atomically
from dit_accel.cli_args import OneLineParser, positive_int, refuse_file
from dit_accel.errors import UserError, exits_cleanly

# --- import ---------------------------------------------------------------------------------------------------
IMPORT_STEP = 0


def placeholder_plan(spec, objective: str = "ddpm") -> dict:
    """A real dit-plan plan (one 80 GB GPU, global batch 256) for the imported network: the checkpoint needs one
    to say which network it holds, and what it was trained under (a SiT, REPA or LightningDiT model's flow
    objective). Fine-tuning makes its own plan for the GPUs it runs on."""
    from planner.errors import PlanError
    from planner.plan import make_plan
    from planner.spec import OPTIONS, PREFIX

    prefix = PREFIX[spec.family]
    family = (
        spec.name.removesuffix("-custom")
        if spec.name.startswith(prefix + "-") and not spec.name.endswith("-custom")
        else f"{prefix}-B/{spec.patch}"
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
            model_options={key: getattr(spec, key) for key in OPTIONS} if spec.family != "dit" else None,
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
    latent_norm=None,
) -> Path:
    """A run folder with one complete checkpoint at step 0 holding `model` (see the module docstring);
    `objective` (a SiT, REPA or LightningDiT flow model's) and `latent_norm` (a `LatentNorm`: how its latents
    are normalised) are recorded in its dit_accel.json for sample and export."""
    import torch
    from safetensors.torch import save_file

    from dit_accel.models.diffusers_format import SIDECAR_NAME, sidecar
    from dit_accel.models.dit import spec_from_model
    from dit_accel.run import checkpoint as ckpt
    from planner.planfile import spec_from_plan

    out_dir = Path(out_dir)
    spec = spec_from_model(model)
    if spec.family == "dit" and not spec.learn_sigma:
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
        if latent_norm is not None:
            recorded["latent_norm"] = latent_norm.to_json()
        write_json_atomically(checkpoint_dir / SIDECAR_NAME, recorded)
        ckpt.commit(checkpoint_dir, final_dir, {"step": IMPORT_STEP, "imported_from": source_name})
    return out_dir


IMPORTED = {  # the command's layout -> what its --checkpoint is
    "dit": "an original DiT checkpoint (.pt state dict of the DiT repository, e.g. DiT-XL-2-256x256.pt)",
    "sit": "a SiT checkpoint (.pt state dict of the SiT repository, e.g. SiT-XL-2-256.pt), a flow model",
    "repa": "a REPA checkpoint (.pt of the REPA repository, e.g. its SiT-XL/2 last.pt), a flow model",
    "lightningdit": "a LightningDiT checkpoint (.pt of hustvl/LightningDiT, e.g. "
    "lightningdit-xl-imagenet256-64ep.pt), a flow model on VA-VAE latents",
}
LIGHTNINGDIT_OBJECTIVE = {  # the released recipe's: its checkpoints record what they were trained under
    "name": "flow",
    "path": "linear",
    "time_sampling": "lognormal",
    "cosine_loss_weight": 1.0,
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
        help="attention heads, only for a network outside the published sizes (shapes do not tell) (default: "
        "none: the DiT family table's, or a LightningDiT's rotary table's)",
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
    if layout in ("sit", "repa"):
        parser.add_argument(
            "--path",
            choices=("linear", "gvp"),
            default="linear",
            help="the interpolant the model was trained with (SiT's --path-type Linear or GVP; REPA's linear or "
            "cosine, which is GVP): recorded, since the SDE's score depends on it (default linear)",
        )
    if layout == "lightningdit":
        parser.add_argument(
            "--latent-stats",
            default=None,
            help="the latents' per-channel mean and std the model was trained on (the latents_stats.pt released "
            "with VA-VAE), recorded so that sampling decodes right; without it, sampling needs a VA-VAE folder "
            "that stores them",
        )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    return parser


@exits_cleanly("dit-accel import-dit")
def import_main(argv: list[str] | None = None) -> int:
    args = build_import_parser().parse_args(argv)  # before the imports: --help needs no torch
    from dit_accel.models.dit import spec_from_model
    from dit_accel.models.original_dit import load_original_dit

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
    from dit_accel.models.dit import spec_from_model
    from dit_accel.models.original_sit import load_flow_checkpoint

    refuse_file(args.out, "--out")
    model, notes = load_flow_checkpoint(
        args.checkpoint, layout, heads=args.heads, prefer=args.weights, trust_pickle=args.trust_checkpoint
    )
    objective = {"name": "flow", "path": args.path, "time_sampling": "uniform"}
    out = write_imported_checkpoint(
        model, args.out, Path(args.checkpoint).name, overwrite=args.overwrite, objective=objective
    )
    spec = spec_from_model(model)
    for note in notes:
        print(f"import-{layout}: {note}")
    print(
        f"wrote {out}: {spec.name} ({spec.depth} blocks x {spec.hidden}, {spec.resolution} px, {spec.num_classes} "
        f"classes) as a step-0 flow checkpoint ({args.path} path, velocity) with the original timestep shift (0); "
        f"sample it with `dit-accel sample --checkpoint {out} --sampler ode|sde ...`"
    )
    return 0


@exits_cleanly("dit-accel import-sit")
def import_sit_main(argv: list[str] | None = None) -> int:
    return import_flow_main("sit", argv)


@exits_cleanly("dit-accel import-repa")
def import_repa_main(argv: list[str] | None = None) -> int:
    return import_flow_main("repa", argv)


@exits_cleanly("dit-accel import-lightningdit")
def import_lightningdit_main(argv: list[str] | None = None) -> int:
    """A released LightningDiT `.pt` as a step-0 flow run (models.original_lightningdit), its recipe's objective
    and, with --latent-stats, its latent normalisation recorded."""
    args = build_import_parser("lightningdit").parse_args(argv)  # before the imports: --help needs no torch
    from dit_accel.models.original_lightningdit import load_lightningdit
    from dit_accel.models.vae import read_latent_statistics

    refuse_file(args.out, "--out")
    norm = read_latent_statistics(args.latent_stats) if args.latent_stats else None
    model, notes = load_lightningdit(
        args.checkpoint, heads=args.heads, prefer=args.weights, trust_pickle=args.trust_checkpoint
    )
    spec = model.dit_spec
    if norm is not None and norm.channels != spec.in_channels:
        raise UserError(
            f"--latent-stats {args.latent_stats} has {norm.channels} channels, the model's latents {spec.in_channels}",
            "pass the statistics of the latents this model was trained on",
        )
    out = write_imported_checkpoint(
        model,
        args.out,
        Path(args.checkpoint).name,
        overwrite=args.overwrite,
        objective=LIGHTNINGDIT_OBJECTIVE,
        latent_norm=norm,
    )
    for note in notes:
        print(f"import-lightningdit: {note}")
    print(
        f"wrote {out}: {spec.name} as a step-0 flow checkpoint; sample it as the paper did with "
        f"`dit-accel sample --checkpoint {out} --vae VA-VAE.pt --protocol lightningdit-xl1-64ep ...`"
    )
    return 0
