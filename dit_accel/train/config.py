"""The run's own settings: what plan.json does not decide. Defaults are the DiT recipe.

plan.json decides the shape of the job (micro-batch, accumulation, precision, checkpointed blocks, latents);
`TrainConfig` holds the optimisation recipe and the run's bookkeeping. Every field is a CLI flag of the same
name (`--max-steps` / `--max_steps`), so a config written to a run folder reads back as the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from dit_accel.cli_args import OneLineParser
from dit_accel.diffusion.names import FLOW_PATHS, TIME_SAMPLINGS
from dit_accel.errors import UserError

NAN_POLICIES = ("abort", "skip")
DEFAULT_NUM_WORKERS = 4  # DataLoader workers per rank unless the node's CPUs allow fewer
MAX_SEED = 2**31 - 1  # seed + rank must stay a valid seed for torch, numpy and Python alike


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, as the DataLoader's own worker warning counts them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def most_workers_per_rank(ranks_per_node: int, cpus: int) -> int:
    """The DataLoader workers each rank can have without sharing cores: the node's CPUs split over its ranks,
    less the rank's own process (may be 0 or less on a crowded node)."""
    return cpus // max(ranks_per_node, 1) - 1


def loader_workers(requested: int | None, ranks_per_node: int, cpus: int) -> int:
    """DataLoader workers per rank: --num-workers as given; without it the default, but no more than
    `most_workers_per_rank` (at least 0), so that workers do not starve the ranks (and the DataLoader does not
    warn about it)."""
    if requested is not None:
        return requested
    return max(0, min(DEFAULT_NUM_WORKERS, most_workers_per_rank(ranks_per_node, cpus)))


def check_data_sources(data_path, latents, repa_encoder) -> None:
    """One of --data-path and --latents; both only for REPA from a latent cache, which reads its source
    images too (--data-path then says where they are now). The trainer's rule, and the doctor's."""
    if bool(data_path) == bool(latents) and not (data_path and latents and repa_encoder):
        raise UserError(
            "pass exactly one of --data-path DIR (images) or --latents DIR (a latent cache)",
            "both only for REPA from a latent cache (with --repa-encoder): --data-path then says where the "
            "cache's images are",
        )


def _flag(name: str) -> str:
    return name.replace("_", "-")


@dataclass
class TrainConfig:
    plan: str = field(default="", metadata={"help": "plan.json written by dit-plan (required)"})
    output_dir: str = field(
        default="", metadata={"help": "run folder: checkpoints, logs, TensorBoard (required)"}
    )
    data_path: str | None = field(
        default=None,
        metadata={
            "help": "image folder (one sub-folder per class), or a Hugging Face dataset: a save_to_disk folder, "
            "parquet files (FILE, DIR or glob) or a dataset name in the local cache (docs/data.md); beside --latents "
            "with REPA, where the cache's source images are now (default: none: give it or --latents)"
        },
    )
    split: str | None = field(
        default=None,
        metadata={"help": "a dataset's split to train on (default: train, or the dataset's only split)"},
    )
    image_column: str = field(default="image", metadata={"help": "a dataset's column of images"})
    label_column: str = field(
        default="label", metadata={"help": "a dataset's column of class labels (ClassLabel, int or str)"}
    )
    latents: str | None = field(
        default=None,
        metadata={
            "help": "latent cache written by `dit-accel extract-latents` (default: none: give it or --data-path)"
        },
    )
    vae: str | None = field(
        default=None,
        metadata={
            "help": "AutoencoderKL folder, or a released VA-VAE .pt, for online encoding (plan latents 'online') "
            "(default: none: required by an online plan)"
        },
    )
    latent_stats: str | None = field(
        default=None,
        metadata={
            "help": "online VA-VAE latents: the per-channel mean and std to normalise them by (LightningDiT's "
            "latents_stats.pt, or a JSON); default: the VAE folder's own"
        },
    )

    max_steps: int = field(
        default=400_000, metadata={"help": "optimizer steps to train to (DiT's main results: 400K)"}
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "'auto' or 'latest' (the newest complete checkpoint in the run folder) or a checkpoint/run "
            "folder (default: none: a new run, refused in a folder that already holds checkpoints)"
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "start a NEW run (step 0, fresh optimizer) from these weights: a dit-accel run or checkpoint folder "
            "(e.g. one made by `dit-accel import-dit`) or a diffusers DiT transformer/pipeline folder; ignored once "
            "--output-dir holds a checkpoint (the run then resumes from it) (default: none: the model's own init)"
        },
    )
    init_from_ema: bool = field(
        default=False,
        metadata={
            "help": "with --init-from a dit-accel checkpoint: start from its EMA weights instead of its raw weights"
        },
    )
    checkpoint_every: int = field(
        default=5_000,
        metadata={"help": "optimizer steps between checkpoints (one is also written at the end)"},
    )
    keep_last: int = field(
        default=3,
        metadata={"help": "complete checkpoints to keep; older ones are deleted after a new one is complete"},
    )
    final_checkpoint: bool = field(
        default=True,
        metadata={
            "help": "write a checkpoint at --max-steps (--no-final-checkpoint: a speed or memory measurement "
            "that keeps no weights; --checkpoint-every still applies)"
        },
    )
    log_every: int = field(default=100, metadata={"help": "optimizer steps between log lines"})

    lr: float = field(default=1e-4, metadata={"help": "AdamW learning rate (before --scale-lr)"})
    betas: tuple[float, float] = field(
        default=(0.9, 0.999), metadata={"help": "AdamW betas, e.g. --betas 0.9 0.999"}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (DiT: 0)"})
    warmup_steps: int = field(
        default=0, metadata={"help": "linear lr warmup over this many optimizer steps (DiT: 0)"}
    )
    scale_lr: bool = field(
        default=False, metadata={"help": "multiply lr by global_batch / 256 (linear scaling rule)"}
    )
    grad_clip: float | None = field(
        default=None,
        metadata={"help": "clip the gradient norm to this value (default: none, not clipped: DiT's)"},
    )
    ema_decay: float = field(default=0.9999, metadata={"help": "EMA decay per optimizer step, kept in fp32"})
    ema_warmup: bool = field(
        default=False,
        metadata={
            "help": "ramp the EMA decay up as diffusers' EMAModel warm-up does, min(decay, 1 - (1 + n)^(-2/3)) "
            "after n updates (off: the DiT recipe's constant decay)"
        },
    )
    class_dropout: float = field(
        default=0.1, metadata={"help": "probability of replacing a label by the null class (for guidance)"}
    )
    seed: int = field(default=0, metadata={"help": "base seed; rank r seeds its global RNGs with seed + r"})
    objective: str | None = field(
        default=None,
        metadata={
            "help": "ddpm (DiT's: epsilon and learned variance) or flow (SiT's and REPA's: linear interpolant, "
            "velocity prediction); default: the plan's (dit-plan --objective), which it must agree with"
        },
    )
    time_sampling: str = field(
        default="uniform",
        metadata={"help": "flow: how t is drawn per sample, uniform or lognormal (REPA's option)"},
    )
    flow_path: str = field(
        default="linear",
        metadata={"help": "flow: the interpolant, linear (SiT's default) or gvp (cos/sin, SiT's GVP)"},
    )
    cosine_loss_weight: float = field(
        default=0.0,
        metadata={
            "help": "flow: weight of LightningDiT's velocity-direction term, 1 - cos(predicted, target velocity) "
            "over channels, added to the MSE (their recipe: 1; default: none)"
        },
    )
    repa_encoder: str | None = field(
        default=None,
        metadata={
            "help": "REPA: a DINOv2 ViT/14 backbone's weights (dinov2_vit*14*_pretrain.pth, or a folder with "
            "one), read offline; the plan must be made with dit-plan --repa (default: no REPA)"
        },
    )
    repa_depth: int = field(
        default=8, metadata={"help": "REPA: the block (1-based) whose output tokens are aligned (8 for XL/2)"}
    )
    repa_coeff: float = field(default=0.5, metadata={"help": "REPA: the alignment term's weight (lambda)"})
    repa_projector_dim: int = field(
        default=2048, metadata={"help": "REPA: the projector MLP's width; must be the plan's"}
    )

    nan_policy: str = field(
        default="abort", metadata={"help": "on a NaN/Inf loss or gradient: abort (default) or skip the step"}
    )
    max_skipped_steps: int = field(
        default=10, metadata={"help": "with --nan-policy skip, abort after this many skipped steps"}
    )
    # None (the command line without --num-workers): DEFAULT_NUM_WORKERS, capped to the node's CPUs.
    num_workers: int | None = field(
        default=DEFAULT_NUM_WORKERS,
        metadata={
            "help": f"DataLoader worker processes per rank (default: {DEFAULT_NUM_WORKERS}, or fewer on a node whose CPUs "
            f"cannot run that many: CPUs // ranks per node - 1)"
        },
    )
    skip_bad_images: bool = field(
        default=False,
        metadata={
            "help": "images (--data-path) that do not decode are skipped, each logged once per rank with the "
            "rank's count, instead of stopping the run"
        },
    )
    max_bad_images: int = field(
        default=100,
        metadata={"help": "with --skip-bad-images: stop once a rank has met more than this many bad images"},
    )
    tf32: bool = field(
        default=True, metadata={"help": "TF32 matmuls and convolutions on CUDA (--no-tf32 for full fp32)"}
    )
    fp8: bool = field(
        default=False,
        metadata={
            "help": "FP8 matmuls in the transformer blocks' linear layers (torchao float8 training, dynamic "
            "tensorwise scaling), bf16 elsewhere; a bf16 plan only; on a CPU torchao emulates it (tests). The "
            "plan's memory and img/s are bf16's: FP8's are unmeasured (default: off)"
        },
    )
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each transformer block (dit_accel.models.compile); default auto: the plan's "
            "decision.compile on CUDA, off on a CPU"
        },
    )
    tensorboard: bool = field(
        default=True,
        metadata={"help": "log to TensorBoard in OUTPUT_DIR/tensorboard (--no-tensorboard to turn off)"},
    )
    report_to: str = field(
        default="tensorboard",
        metadata={
            "help": "experiment trackers: tensorboard (OUTPUT_DIR/tensorboard), wandb (pip install "
            "'dit-accel[wandb]'), several comma-separated, all (every installed one) or none"
        },
    )
    hflip: bool | None = field(
        default=None,
        metadata={
            "help": "random horizontal flips (DiT's only augmentation; default on). With --latents the cache's "
            "own setting (extract-latents --hflip/--no-hflip) unless given; --hflip on a cache made with "
            "--no-hflip is refused"
        },
    )
    sample_every: int = field(
        default=0,
        metadata={
            "help": "every N optimizer steps, an EMA sample grid to OUTPUT_DIR/samples/ and the trackers (0: off)"
        },
    )
    sample_classes: str = field(
        default="",
        metadata={
            "help": "the classes of --sample-every's grid, e.g. 207,360,387 (default: the DiT paper's showcase "
            "classes for ImageNet-1k, else the first 8)"
        },
    )
    sample_steps: int = field(
        default=50,
        metadata={"help": "steps of --sample-every's grid: DDPM's, or a flow run's ODE (Heun) steps"},
    )
    sample_cfg_scale: float = field(
        default=4.0, metadata={"help": "classifier-free guidance scale of --sample-every's grid"}
    )
    eval_every: int = field(
        default=0,
        metadata={
            "help": "every N optimizer steps, FID and Inception Score of --eval-samples EMA samples against "
            "--eval-reference, to metrics.jsonl and the trackers as eval/fid and eval/is (0: off)"
        },
    )
    eval_samples: int = field(
        default=10_000, metadata={"help": "images each --eval-every evaluation samples, shared by the ranks"}
    )
    eval_reference: str | None = field(
        default=None,
        metadata={
            "help": "--eval-every's ADM reference batch .npz, e.g. VIRTUAL_imagenet256_labeled.npz "
            "(default: none: required with --eval-every)"
        },
    )
    eval_steps: int = field(
        default=250,
        metadata={
            "help": "sampling steps of --eval-every: DDPM's (ddpm runs), or the ODE's Heun steps (flow)"
        },
    )
    eval_cfg_scale: float = field(
        default=1.0, metadata={"help": "classifier-free guidance scale of --eval-every's samples (1: none)"}
    )
    inception_weights: str | None = field(
        default=None,
        metadata={
            "help": "--eval-every's TF-ported Inception-v3 weights (default: torch-fidelity's file in the torch "
            "hub cache)"
        },
    )
    eval_input_px: int = field(
        default=299,
        metadata={
            "help": "side --eval-every's Inception resizes images to: the TF graph's 299; only tests lower it"
        },
    )
    progress_bar: bool = field(
        default=True,
        metadata={
            "help": "progress on the main process (tqdm on a terminal, a plain line every 10% in a log)"
        },
    )
    debug_checksums: bool = field(
        default=False,
        metadata={"help": "write a parameter checksum per step to each rank's log (slow; for tests)"},
    )
    preempt_signals: str = field(
        default="TERM,USR1",
        metadata={
            "help": "signals that save the current step and exit 4 (preempted; requeue with --resume auto), "
            "comma-separated; '' to leave signals alone"
        },
    )
    collective_timeout_s: float = field(
        default=1800.0,
        metadata={
            "help": "end the run (exit 5) when a rank makes no progress for this long, e.g. stuck in a "
            "collective; also the process group's timeout"
        },
    )

    def saves_checkpoint_at(self, step: int) -> bool:
        """Every --checkpoint-every steps, and at --max-steps unless --no-final-checkpoint."""
        return step % self.checkpoint_every == 0 or (step == self.max_steps and self.final_checkpoint)

    def check(self) -> None:
        """Refuse bad values up front, before any process group or model exists."""
        if not self.plan:
            raise UserError("--plan is required: pass the plan.json written by `dit-plan --out DIR`")
        if not self.output_dir:
            raise UserError(
                "--output-dir is required: the run folder for checkpoints and logs, e.g. runs/xl2"
            )
        check_data_sources(self.data_path, self.latents, self.repa_encoder)
        if self.resume == "latest":  # the name other trainers use for the same thing
            self.resume = "auto"
        if self.init_from and self.resume not in (None, "auto"):
            raise UserError(
                f"--init-from starts a new run from weights but --resume {self.resume} continues a run: pass "
                f"one of them (--resume auto with --init-from is fine: it resumes once the run has a checkpoint)"
            )
        if self.init_from_ema and not self.init_from:
            raise UserError(
                "--init-from-ema chooses the weights of --init-from: add --init-from RUN_OR_CHECKPOINT, or drop it"
            )
        positive = ("max_steps", "checkpoint_every", "keep_last", "log_every", "sample_steps", "eval_steps")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        numbers = ("lr", "weight_decay", "ema_decay", "class_dropout", "grad_clip", "sample_cfg_scale")
        numbers += ("eval_cfg_scale",)
        for flag, value in [(_flag(n), getattr(self, n)) for n in numbers] + [
            ("betas", b) for b in self.betas
        ]:
            if value is not None and not math.isfinite(value):
                raise UserError(f"--{flag} must be a finite number, got {value}", "pass a real number")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}", "pass e.g. --lr 1e-4 (DiT's)")
        if self.weight_decay < 0:
            raise UserError(
                f"--weight-decay must not be negative, got {self.weight_decay}", "pass 0 (DiT's) or more"
            )
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise UserError(
                f"--betas must both be in [0, 1), got {self.betas[0]} {self.betas[1]}",
                "pass e.g. --betas 0.9 0.999 (DiT's)",
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be in 0..{MAX_SEED}, got {self.seed}", "pass a smaller seed")
        from dit_accel.data.source_kind import dataset_kind  # a parquet file is a dataset, not a bad folder

        data_path = () if self.data_path and dataset_kind(self.data_path) else ("data_path",)
        for name in ("output_dir", *data_path, "latents"):
            value = getattr(self, name)
            existing = (
                next((p for p in (Path(value), *Path(value).parents) if p.exists()), None) if value else None
            )
            if existing is not None and not existing.is_dir():
                raise UserError(
                    f"--{_flag(name)} {value}: {existing} is a file, not a folder", "pass a folder"
                )
        if self.skip_bad_images and not self.data_path:
            raise UserError(
                "--skip-bad-images is for an image folder (--data-path)",
                "drop it: a latent cache holds only images that decoded (extract-latents has its own flag)",
            )
        for name in (
            "warmup_steps",
            "num_workers",
            "max_skipped_steps",
            "max_bad_images",
            "sample_every",
            "eval_every",
        ):
            if (getattr(self, name) or 0) < 0:
                raise UserError(
                    f"--{_flag(name)} must not be negative, got {getattr(self, name)}", "pass 0 or more"
                )
        if not 0.0 <= self.ema_decay < 1.0:
            raise UserError(f"--ema-decay must be in [0, 1), got {self.ema_decay}")
        if not 0.0 <= self.class_dropout < 1.0:
            raise UserError(f"--class-dropout must be in [0, 1), got {self.class_dropout}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise UserError(f"--grad-clip must be positive, got {self.grad_clip}")
        if self.sample_cfg_scale < 0:
            raise UserError(
                f"--sample-cfg-scale must be >= 0 (1 turns guidance off), got {self.sample_cfg_scale}"
            )
        if self.eval_every:
            self.check_eval()
        from dit_accel.train.trackers import parse_report_to

        parse_report_to(self.report_to)
        from planner.rules import OBJECTIVES

        for flag, value, choices in (
            ("objective", self.objective or "ddpm", tuple(OBJECTIVES)),
            ("time-sampling", self.time_sampling, TIME_SAMPLINGS),
            ("flow-path", self.flow_path, FLOW_PATHS),
        ):
            if value not in choices:
                raise UserError(f"--{flag} must be one of {', '.join(choices)}, got {value!r}")
        if not (math.isfinite(self.cosine_loss_weight) and self.cosine_loss_weight >= 0):
            raise UserError(
                f"--cosine-loss-weight must be a finite number >= 0, got {self.cosine_loss_weight}"
            )
        if self.repa_depth <= 0 or self.repa_projector_dim <= 0:
            raise UserError("--repa-depth and --repa-projector-dim must be positive", "pass e.g. 8 and 2048")
        if not (math.isfinite(self.repa_coeff) and self.repa_coeff >= 0):
            raise UserError(f"--repa-coeff must be a finite number >= 0, got {self.repa_coeff}", "pass 0.5")
        if self.nan_policy not in NAN_POLICIES:
            raise UserError(f"--nan-policy must be one of {', '.join(NAN_POLICIES)}, got {self.nan_policy!r}")
        try:
            parse_signals(self.preempt_signals)
        except ValueError as bad:
            raise UserError(
                f"--preempt-signals {self.preempt_signals!r}: {bad} is not a signal that can be caught",
                "pass names such as TERM,USR1 (or '' for none)",
            ) from None
        if not (math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise UserError(
                f"--collective-timeout-s must be a positive number of seconds, got {self.collective_timeout_s}",
                "pass e.g. 1800",
            )

    def check_eval(self) -> None:
        """--eval-every's numbers and files, before anything starts: the reference batch and the Inception
        weights (--inception-weights, else the torch hub cache's file) must be there."""
        from dit_accel.evaluate.weights import check_evaluation_files

        if self.eval_samples < 4 or self.eval_input_px < 75 or self.eval_cfg_scale < 0:
            raise UserError(
                f"--eval-samples {self.eval_samples}, --eval-input-px {self.eval_input_px}, --eval-cfg-scale "
                f"{self.eval_cfg_scale}: precision/recall need 4 samples, the Inception 75 px, guidance >= 0",
                "pass e.g. --eval-samples 10000 (--eval-input-px 299, --eval-cfg-scale 1)",
            )
        fetch = "docs/evaluation.md says where to fetch it"
        if not self.eval_reference:
            raise UserError(
                "--eval-every needs --eval-reference REF.npz", f"pass an ADM reference batch: {fetch}"
            )
        check_evaluation_files(self.eval_reference, self.inception_weights, "--eval-reference")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


class _Parser(OneLineParser):
    """argparse that raises UserError (one line, exit 2) instead of printing usage and exiting."""

    def error(self, message):
        raise UserError(f"{self.suggested(message)} (see `python -m dit_accel.train --help`)")


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """`TERM,USR1` (or `SIGTERM,SIGUSR1`) as signals; ValueError names a name that is not a catchable one."""
    found = []
    for name in filter(None, (part.strip().upper() for part in text.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, name):
            raise ValueError(name)
        found.append(signal.Signals[name])
    return tuple(found)


def build_parser(given_only: bool = False) -> argparse.ArgumentParser:
    """The trainer's flags; `given_only`: without defaults, so that a parse holds only the flags given."""
    unset = argparse.SUPPRESS if given_only else None
    parser = _Parser(
        prog="dit_accel.train",
        description="Train a DiT exactly as plan.json says. Launch with "
        "`accelerate launch --config_file PLAN_DIR/accelerate_config.yaml -m dit_accel.train --plan PLAN_DIR/plan.json ...`.",
    )
    parser.add_argument(
        "--config",
        default=unset,
        help="a recipe: a shipped recipe's name (e.g. dit-xl2-256 or demo-cpu; an unknown name lists them) or "
        "a flat YAML file whose keys are these flags; flags on the command line override it (default: none)",
    )
    for spec in dataclasses.fields(TrainConfig):
        flags = [f"--{spec.name.replace('_', '-')}"]
        if "_" in spec.name:
            flags.append(f"--{spec.name}")
        help_text = spec.metadata.get("help", "").replace("%", "%%")  # argparse %-formats every help
        default = argparse.SUPPRESS if given_only else spec.default
        if spec.type == "bool" or isinstance(spec.default, bool) or spec.name in ("hflip", "compile"):
            parser.add_argument(
                *flags,
                dest=spec.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        elif spec.name == "betas":
            parser.add_argument(
                *flags,
                dest=spec.name,
                type=float,
                nargs=2,
                default=default,
                metavar=("BETA1", "BETA2"),
                help=help_text,
            )
        else:
            kind = {"int": int, "float": float}.get(type(spec.default).__name__, str)
            if spec.name == "grad_clip":
                kind = float
            if spec.name == "num_workers":  # not given: None, so that the trainer may cap the default
                parser.add_argument(*flags, dest=spec.name, type=int, default=unset, help=help_text)
                continue
            parser.add_argument(*flags, dest=spec.name, type=kind, default=default, help=help_text)
    return parser


def save_config(config: TrainConfig, path: Path) -> None:
    from dit_accel.atomic import write_json_atomically

    write_json_atomically(path, config.to_json())
