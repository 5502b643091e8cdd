"""`dit-accel sample`: class-conditional samples from a trained (or imported) DiT.

Two outputs, one code path:
  --out grid.png            a PNG grid plus every image alone in grid_images/ (for looking at)
  --num-samples N --npz F   the evaluation batch for the ADM/DiT FID evaluator: F.npz with `arr_0`
                            (N, H, W, 3) uint8 and `arr_1` (N,) int64 labels, made by every process of
                            `accelerate launch`, resumable shard by shard.
  --evaluate REF.npz        the same batch scored as it is made (dit_accel.evaluate: each rank's images go
                            straight to its Inception features), with or without --npz.

Reproducibility rule: sample i (its global index) starts from noise drawn with its own generator, seeded
from (seed, i), and every later noise draw of the sampler for that sample comes from the same generator.
So a sample does not depend on which process made it, on the batch it was in, or on how many processes
ran; only on (checkpoint, seed, i, label, sampler settings). The labels of an evaluation batch are
balanced (N spread evenly over the classes) and shuffled by a permutation fixed by the seed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from dit_accel.atomic import write_atomically, write_json_atomically
from dit_accel.cpu_threads import cpu_threads
from dit_accel.errors import UserError, exit_command, exits_cleanly
from dit_accel.evaluate import PAPER_SAMPLES
from dit_accel.sample_args import (
    DDPM_SAMPLERS,
    DIFFUSION_FORMS,
    FLOW_SAMPLERS,
    GUIDANCE_MODES,
    ODE_SOLVERS,
    SAMPLERS,
    build_parser,
    check_sampler_flags,
)


# --- what to sample -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleSettings:
    """Everything besides the checkpoint that decides the pixels of sample i."""

    cfg_scale: float = 4.0
    steps: int = 250
    sampler: str = "ddpm"
    guidance: str = "all"  # "all" latent channels (diffusers) | "first3" (the original DiT repository)
    seed: int = 0
    # Flow models only (--sampler ode|sde); the path is the checkpoint's, recorded with its objective.
    ode_solver: str = "heun"
    diffusion_form: str = "sigma"
    diffusion_norm: float = 1.0
    cfg_low: float = 0.0  # guidance where cfg_low <= t <= cfg_high (--cfg-interval)
    cfg_high: float = 1.0
    flow_path: str = "linear"

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise UserError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.ode_solver not in ODE_SOLVERS or self.diffusion_form not in DIFFUSION_FORMS:
            raise UserError(
                f"the ODE solver must be one of {', '.join(ODE_SOLVERS)} and the SDE's diffusion form one of "
                f"{', '.join(DIFFUSION_FORMS)}, got {self.ode_solver!r} and {self.diffusion_form!r}"
            )
        if self.guidance not in GUIDANCE_MODES:
            raise UserError(f"--guidance must be one of {', '.join(GUIDANCE_MODES)}, got {self.guidance!r}")
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if self.cfg_scale < 0:
            raise UserError(f"--cfg-scale must be >= 0 (1 turns guidance off), got {self.cfg_scale}")


def sample_seed(seed: int, index: int) -> int:
    """The torch seed of global sample `index`: the trainer's per-sample rule (a SeedSequence mix of the two),
    so distinct (seed, index) pairs do not collide in practice."""
    from dit_accel.data.order import sample_seed as keyed_seed

    return keyed_seed(seed, index)


def sample_generators(
    seed: int, indices: Sequence[int], device: torch.device | str = "cpu"
) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(sample_seed(seed, int(i))) for i in indices]


def balanced_labels(num_samples: int, num_classes: int, seed: int) -> np.ndarray:
    """num_samples labels, each class num_samples // num_classes times (the first num_samples % num_classes
    classes once more), in an order fixed by `seed`: the same list whatever the number of processes."""
    labels = np.arange(num_samples, dtype=np.int64) % num_classes
    return labels[np.random.default_rng(seed).permutation(num_samples)]


def grid_labels(classes: Sequence[int], per_class: int) -> list[int]:
    """Grid order: all samples of the first class, then the second, ... (one grid row per class)."""
    return [int(label) for label in classes for _ in range(per_class)]


def parse_classes(text: str, num_classes: int) -> list[int]:
    try:
        classes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(
            f"--classes must be comma-separated class indices like 207,360,387, got {text!r}"
        ) from None
    if not classes:
        raise UserError("--classes is empty: give class indices like 207,360,387")
    bad = [label for label in classes if not 0 <= label < num_classes]
    if bad:
        raise UserError(f"--classes {bad} out of range: this model has classes 0..{num_classes - 1}")
    return classes


# --- the evaluation batch: shards per batch, assembled once ---------------------------------------------
@dataclass(frozen=True)
class EvalBatch:
    """num_samples images cut into fixed batches of global indices [b*batch_size, (b+1)*batch_size).

    Batch b belongs to rank b % world_size; each finished batch is one shard file written atomically, so a
    rerun (with any number of processes) skips what exists and a kill loses at most the batches in flight.
    """

    npz_path: Path | None  # None: scored (--evaluate) and not kept
    num_samples: int
    batch_size: int
    classes: tuple[int, ...]  # the labels to balance over (usually every class of the model)
    seed: int

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    @property
    def shard_dir(self) -> Path:
        return self.npz_path.with_name(self.npz_path.name + ".parts")

    @cached_property
    def labels(self) -> np.ndarray:
        return np.asarray(self.classes, dtype=np.int64)[
            balanced_labels(self.num_samples, len(self.classes), self.seed)
        ]

    def indices(self, batch: int) -> range:
        return range(batch * self.batch_size, min((batch + 1) * self.batch_size, self.num_samples))

    def batches_for_rank(self, rank: int, world_size: int) -> list[int]:
        return list(range(rank, self.num_batches, world_size))

    def shard_path(self, batch: int) -> Path:
        return self.shard_dir / f"batch_{batch:06d}.npz"

    def shard_is_done(self, batch: int) -> bool:
        """A shard counts when it exists (it was renamed into place whole) and holds the expected labels."""
        path = self.shard_path(batch)
        if not path.exists():
            return False
        try:
            with np.load(path) as shard:
                expected = self.labels[self.indices(batch).start : self.indices(batch).stop]
                return shard["images"].shape[0] == len(expected) and np.array_equal(shard["labels"], expected)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            return False

    def read_shard(self, batch: int) -> np.ndarray:
        with np.load(self.shard_path(batch)) as shard:
            return shard["images"]

    def save_shard(self, batch: int, images: np.ndarray, labels: np.ndarray) -> None:
        write_atomically(self.shard_path(batch), lambda file: np.savez(file, images=images, labels=labels))

    def check_or_write_settings(self, fingerprint: dict, write: bool) -> None:
        """Shards of another job (other checkpoint, seed, cfg...) must never be mixed into this one."""
        settings_path = self.shard_dir / "settings.json"
        if settings_path.exists():
            found = json.loads(settings_path.read_text())
            if found != fingerprint:
                changed = sorted(
                    key for key in set(found) | set(fingerprint) if found.get(key) != fingerprint.get(key)
                )
                raise UserError(
                    f"{self.shard_dir} holds shards made with other settings ({', '.join(changed)} differ): "
                    f"rerun with the same settings to resume, or delete {self.shard_dir} to start over"
                )
        elif write:
            write_json_atomically(settings_path, fingerprint)

    def assemble(self) -> Path:
        """Stream every shard, in global order, into npz_path (arr_0 images, arr_1 labels), then drop the shards.

        Streaming keeps host memory at one shard: 50,000 images of 256 px are 9.8 GB.
        """
        missing = [batch for batch in range(self.num_batches) if not self.shard_path(batch).exists()]
        if missing:
            raise UserError(
                f"{len(missing)} of {self.num_batches} batches are missing in {self.shard_dir} "
                f"(first: {missing[0]}): rerun the same command to make them"
            )
        with np.load(self.shard_path(0)) as first:
            image_shape = first["images"].shape[1:]
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
            "fortran_order": False,
            "shape": (self.num_samples, *image_shape),
        }

        def write(file) -> None:
            with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                written = 0
                with archive.open("arr_0.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array_header_1_0(member, header)
                    for batch in range(self.num_batches):
                        with np.load(self.shard_path(batch)) as shard:
                            images = shard["images"]
                        if images.shape[1:] != image_shape or images.dtype != np.uint8:
                            raise UserError(
                                f"{self.shard_path(batch)} holds {images.dtype} images of shape "
                                f"{images.shape[1:]}, expected uint8 {image_shape}: delete it and rerun"
                            )
                        member.write(np.ascontiguousarray(images).tobytes())
                        written += len(images)
                if written != self.num_samples:
                    raise UserError(
                        f"the shards in {self.shard_dir} hold {written} images, expected "
                        f"{self.num_samples}: delete {self.shard_dir} and rerun"
                    )
                with archive.open("arr_1.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, self.labels)

        write_atomically(self.npz_path, write)
        shutil.rmtree(self.shard_dir, ignore_errors=True)
        return self.npz_path


# --- the model and the decoder ------------------------------------------------------------------------------
@dataclass
class Source:
    """What a --checkpoint resolved to: the network, its spec, where it came from, and what it was trained on."""

    model: torch.nn.Module
    spec: object  # planner.spec.DiTSpec
    info: (
        dict  # "checkpoint", "weights" ("ema" | "model" | "diffusers"), and the train state when there is one
    )
    train_config: dict  # the run's train_config.json ({} for a diffusers folder)


def load_source(path: str | os.PathLike, use_ema: bool = True, device: torch.device | str = "cpu") -> Source:
    """A trainer checkpoint or run folder (EMA weights by default), or a diffusers transformer/pipeline folder.

    The timestep shift travels with the weights (`dit_accel.json`): a checkpoint written by `import-dit`, or
    fine-tuned from one, computes with the original DiT's shift (0).
    """
    from dit_accel import checkpoint as ckpt

    path = Path(path)
    if not path.exists():
        raise UserError(
            f"--checkpoint {path} does not exist: pass a run folder, a checkpoint folder or a diffusers "
            f"DiT pipeline folder"
        )
    model, spec, info = ckpt.load_weights(path, use_ema=use_ema, device=device)
    config_path = Path(info["checkpoint"]) / ckpt.TRAIN_CONFIG
    train_config = (
        json.loads(config_path.read_text())
        if info["weights"] != "diffusers" and config_path.is_file()
        else {}
    )
    return Source(model, spec, info, train_config)


EMA_INITIAL_SHARE_WARNING = 0.1  # above this share of its initial weights, EMA samples look untrained


def warn_about_the_ema(source: Source) -> None:
    """Once the request is known to be good, just before sampling starts."""
    if source.info["weights"] == "ema":
        warn_if_ema_is_mostly_initial(Path(source.info["checkpoint"]), source.train_config)


def warn_if_ema_is_mostly_initial(checkpoint: Path, train_config: dict) -> float | None:
    """Say so when the EMA has seen too few updates to forget the untrained weights it started from (0.9999
    needs ~23k to forget 90%): such a grid is noise, not a broken run. Returns the share, or None if unknown."""
    from dit_accel import checkpoint as ckpt
    from dit_accel.ema import initial_weight_share

    try:
        state = ckpt.read_train_state(checkpoint)
    except (OSError, ValueError):
        return None
    if state.get("imported_from") or state.get("init_from"):  # imported, or --init-from: a trained start
        return None
    updates = int(state.get("applied_steps", state.get("step", 0)))
    decay = float(train_config.get("ema_decay", 0.9999))
    share = initial_weight_share(decay, bool(train_config.get("ema_warmup", False)), updates)
    if share > EMA_INITIAL_SHARE_WARNING:
        print(
            f"dit-accel sample: warning: the EMA weights are still {share:.0%} their initial weights "
            f"({updates} updates at decay {decay:g}), so samples will look untrained; sample the trained "
            f"weights with --no-ema, train longer, or train with --ema-warmup",
            file=sys.stderr,
        )
    return share


def default_vae_path(source: Source) -> str | None:
    """The VAE the model was trained with: the run's online --vae, else the one its latent cache recorded,
    else a pipeline folder's own vae/."""
    if source.train_config.get("vae"):
        return str(source.train_config["vae"])
    latents_dir = source.train_config.get("latents")
    if latents_dir and (Path(latents_dir) / "manifest.json").is_file():
        from dit_accel.data.latent_cache import read_manifest

        return read_manifest(latents_dir)["vae"]["source"]
    folder = Path(source.info["checkpoint"])
    if source.info.get("weights") == "diffusers" and (folder / "vae" / "config.json").is_file():
        return str(folder / "vae")
    return None


@dataclass
class Decoder:
    """Latents -> pixels in [-1, 1]. latents = (posterior sample - shift) * scale, as the latent cache and the
    trainer make them, so decoding divides by scale and adds shift back. None for a pixel-space model."""

    vae: torch.nn.Module | None
    scale_factor: float = 1.0
    shift_factor: float = 0.0
    source: str | None = None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            return x.clamp(-1, 1)
        latents = x.to(self.vae.device, self.vae.dtype) / self.scale_factor + self.shift_factor
        return self.vae.decode(latents).sample.float().clamp(-1, 1)


def load_decoder(spec, vae_path: str | None, device: torch.device | str) -> Decoder:
    if spec.latents == "pixel":
        if vae_path:
            raise UserError("--vae is for latent models, but this model works in pixel space: drop --vae")
        return Decoder(None)
    if not vae_path:
        raise UserError(
            "this model makes VAE latents and no VAE is recorded with its run: pass --vae DIR "
            "(the AutoencoderKL folder it was trained with)"
        )
    from dit_accel.data.vae import load_vae

    vae, identity = load_vae(vae_path)
    vae.to(device)
    return Decoder(
        vae,
        float(vae.config.scaling_factor),
        float(getattr(vae.config, "shift_factor", None) or 0.0),
        identity["source"],
    )


# --- sampling -------------------------------------------------------------------------------------------------
def default_spacing(sampler: str) -> str:
    """DDPM walks DiT's evenly respaced chain (the FID protocol of the paper); DDIM uses diffusers'
    "leading" steps, the DDIMScheduler an exported pipeline carries, so the two give the same latents."""
    return "even" if sampler == "ddpm" else "leading"


@torch.no_grad()
def sample_latents(
    model: torch.nn.Module,
    spec,
    labels: Sequence[int],
    indices: Sequence[int],
    settings: SampleSettings,
    spacing: str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """The sampler's x_0 (scaled latents, or pixels) for samples `indices` with classes `labels`.

    Each sample draws all of its noise from its own generator (see the module docstring).
    """
    from dit_accel.diffusion import Diffusion, classifier_free_guidance, ddim_sample, ddpm_sample
    from dit_accel.model import as_model_fn, null_class

    device = torch.device(device)
    y = torch.as_tensor(list(labels), dtype=torch.long, device=device)
    shape = (len(y), spec.in_channels, spec.latent_size, spec.latent_size)
    if settings.sampler in FLOW_SAMPLERS:
        return sample_flow_latents(model, shape, y, indices, settings, device, progress)
    model_fn = classifier_free_guidance(
        as_model_fn(model), settings.cfg_scale, null_class(model), settings.guidance
    )
    run = ddpm_sample if settings.sampler == "ddpm" else ddim_sample
    return run(
        model_fn,
        Diffusion.linear(),
        shape,
        y,
        num_steps=settings.steps,
        spacing=spacing or default_spacing(settings.sampler),
        generator=sample_generators(settings.seed, indices, device),
        device=device,
        clip_denoised=spec.latents == "pixel",
        progress=progress,
    )


def sample_flow_latents(model, shape, y, indices, settings: SampleSettings, device, progress: bool):
    """sample_latents for a flow model: the ODE or the SDE from t = 1 to 0 (dit_accel.diffusion.flow_sampling)."""
    from dit_accel.diffusion.flow import FlowMatching
    from dit_accel.diffusion.flow_sampling import ode_sample, sde_sample
    from dit_accel.model import as_model_fn, null_class

    common = dict(
        num_steps=settings.steps,
        guidance_scale=settings.cfg_scale,
        null_class=null_class(model),
        cfg_interval=(settings.cfg_low, settings.cfg_high),
        guidance=settings.guidance,
        generator=sample_generators(settings.seed, indices, device),
        device=device,
        progress=progress,
    )
    flow, model_fn = FlowMatching(settings.flow_path), as_model_fn(model)
    if settings.sampler == "ode":
        return ode_sample(model_fn, flow, shape, y, solver=settings.ode_solver, **common)
    return sde_sample(
        model_fn,
        flow,
        shape,
        y,
        diffusion_form=settings.diffusion_form,
        diffusion_norm=settings.diffusion_norm,
        **common,
    )


def sampler_for(objective: dict, sampler: str | None) -> str:
    """The sampler asked for, or the objective's default (ddpm: DiT's ancestral; flow: the ODE); a sampler of
    the other objective is refused in one line."""
    name = objective.get("name", "ddpm")
    own, default = (FLOW_SAMPLERS, "ode") if name == "flow" else (DDPM_SAMPLERS, "ddpm")
    if sampler is None:
        return default
    if sampler not in own:
        raise UserError(
            f"--sampler {sampler} is for {'flow' if sampler in FLOW_SAMPLERS else 'ddpm'} models, but this "
            f"checkpoint was trained with --objective {name}",
            f"pass --sampler {' or '.join(own)} (or leave it out: {default})",
        )
    return sampler


def sample_images(
    model,
    spec,
    decoder: Decoder,
    labels: Sequence[int],
    indices: Sequence[int],
    settings: SampleSettings,
    spacing: str | None = None,
    device="cpu",
    progress: bool = False,
) -> np.ndarray:
    """(N, H, W, 3) uint8 images for one batch; `progress` shows its denoising steps on stderr."""
    from dit_accel.images import to_uint8_nhwc

    latents = sample_latents(model, spec, labels, indices, settings, spacing, device, progress=progress)
    return to_uint8_nhwc(decoder(latents))


def label_rows(grid: np.ndarray, names: Sequence[str], cell_px: int, padding: int = 2) -> np.ndarray:
    """The grid (one row per class, `make_grid`'s layout) with a white margin on the left naming each row."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    width = max(int(measure.textlength(str(name), font=font)) for name in names) + 2 * padding + 2
    picture = Image.new("RGB", (grid.shape[1] + width, grid.shape[0]), (255, 255, 255))
    picture.paste(Image.fromarray(grid), (width, 0))
    draw = ImageDraw.Draw(picture)
    for row, name in enumerate(names):
        middle = padding + row * (cell_px + padding) + cell_px // 2
        draw.text((padding + 1, middle), str(name), fill=(0, 0, 0), font=font, anchor="lm")
    return np.asarray(picture)


def grid_class_names(source: Source) -> list[str] | None:
    """The class names the run recorded (its classes.json, its latent cache's, a pipeline's id2label)."""
    from dit_accel.class_names import run_class_names

    try:
        return run_class_names(source)
    except (OSError, ValueError, UserError):
        return None


# --- the command --------------------------------------------------------------------------------------------
# The classes the DiT paper shows (sample.py of the reference): used when an ImageNet-1k model gets no --classes.
IMAGENET_SHOWCASE = (207, 360, 387, 974, 88, 979, 417, 279)


def _check_args(args) -> None:
    batch = args.npz is not None or args.evaluate is not None  # the evaluation batch, kept and/or scored
    if (args.out is None) != batch:
        raise UserError(
            "pass exactly one of --out grid.png (a grid to look at) or --npz samples.npz and/or --evaluate "
            "REF.npz (the FID evaluation batch, kept and/or scored)"
        )
    if args.num_samples is not None and not batch:
        raise UserError(
            "--num-samples is for the evaluation batch: add --npz samples.npz or --evaluate REF.npz"
        )
    if batch and args.num_samples is None:
        args.num_samples = PAPER_SAMPLES
    for flag in ("per_class", "batch_size", "num_samples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.out is not None and not args.out.lower().endswith(".png"):
        raise UserError(f"--out {args.out} must name a .png file (the grid)", "singles go next to it")


def _settings(args, default_cfg: float, source: Source) -> SampleSettings:
    from dit_accel.diffusion.flow import recorded_objective

    objective = recorded_objective(source.info["checkpoint"])
    sampler = sampler_for(objective, args.sampler)
    check_sampler_flags(args, sampler)
    return SampleSettings(
        cfg_scale=default_cfg if args.cfg_scale is None else args.cfg_scale,
        steps=args.steps,
        sampler=sampler,
        guidance=args.guidance,
        seed=args.seed,
        ode_solver=args.ode_solver,
        diffusion_form=args.diffusion_form,
        diffusion_norm=args.diffusion_norm,
        cfg_low=args.cfg_interval[0],
        cfg_high=args.cfg_interval[1],
        flow_path=objective.get("path", "linear"),
    )


def _classes(args, spec, for_grid: bool) -> list[int]:
    if args.classes is not None:
        return parse_classes(args.classes, spec.num_classes)
    if not for_grid:
        return list(range(spec.num_classes))
    return list(IMAGENET_SHOWCASE) if spec.num_classes == 1000 else list(range(min(8, spec.num_classes)))


def sample_grid(args) -> int:
    from dit_accel.images import grid_columns, make_grid, save_grid_and_singles, save_png
    from dit_accel.progress import progress_bar

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    source = load_source(args.checkpoint, use_ema=args.ema, device=device)
    decoder = load_decoder(source.spec, args.vae or default_vae_path(source), device)
    settings = _settings(args, default_cfg=4.0, source=source)
    classes = _classes(args, source.spec, for_grid=True)
    labels = grid_labels(classes, args.per_class)
    names = grid_class_names(source) if args.row_labels else None
    warn_about_the_ema(source)

    batches = []
    starts = range(0, len(labels), args.batch_size)
    # a grid on a CPU takes minutes: the batches and each one's denoising steps show on stderr
    for start in progress_bar(starts, desc=f"grid of {len(labels)}", unit="batch"):
        indices = range(start, min(start + args.batch_size, len(labels)))
        batches.append(
            sample_images(
                source.model,
                source.spec,
                decoder,
                labels[start : indices.stop],
                indices,
                settings,
                args.spacing,
                device,
                progress=True,
            )
        )
    images = np.concatenate(batches)
    columns = args.per_class if names else grid_columns(len(labels), args.per_class)
    grid_path, singles = save_grid_and_singles(images, labels, args.out, columns)
    if names:  # rows named by class: the grid written again, with its margin
        row_names = [names[c] if c < len(names) else str(c) for c in classes]
        save_png(label_rows(make_grid(images, columns), row_names, images.shape[1]), grid_path)
    print(
        f"wrote {grid_path} ({len(labels)} samples, {settings.sampler} {settings.steps} steps, cfg {settings.cfg_scale}, "
        f"{source.info['weights']} weights) and {len(labels)} single images in {singles}/"
    )
    return 0


def sample_eval_batch(args) -> int:
    from accelerate import Accelerator

    from dit_accel.evaluate.evaluator import Scorer
    from dit_accel.progress import progress_bar

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    npz_path = Path(args.npz) if args.npz else None
    if npz_path and npz_path.exists():
        raise UserError(f"{npz_path} already exists: delete it, or choose another --npz")
    for flag, path in (("--npz", npz_path), ("--results", args.evaluate and Path(args.results))):
        if path and not path.parent.is_dir():
            raise UserError(f"the folder of {flag} {path} does not exist: create {path.parent} first")
    scorer = Scorer.from_flags(accelerator, args) if args.evaluate else None  # a bad reference stops here
    source = load_source(args.checkpoint, use_ema=args.ema, device=accelerator.device)
    vae_path = args.vae or default_vae_path(source)
    decoder = load_decoder(source.spec, vae_path, accelerator.device)
    settings = _settings(args, default_cfg=1.5, source=source)
    job = EvalBatch(
        npz_path,
        args.num_samples,
        args.batch_size,
        tuple(_classes(args, source.spec, for_grid=False)),
        settings.seed,
    )
    fingerprint = {
        **asdict(settings),
        "spacing": args.spacing or default_spacing(settings.sampler),
        "checkpoint": source.info["checkpoint"],
        "weights": source.info["weights"],
        "step": source.info.get("step"),
        "vae": decoder.source,
        "num_samples": job.num_samples,
        "batch_size": job.batch_size,
        "classes": list(job.classes),
    }
    if npz_path:  # every rank refuses foreign shards before any work
        job.check_or_write_settings(fingerprint, write=False)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if npz_path:
            job.check_or_write_settings(fingerprint, write=True)
        warn_about_the_ema(source)
    accelerator.wait_for_everyone()

    mine = job.batches_for_rank(accelerator.process_index, accelerator.num_processes)
    where = (args.spacing, accelerator.device)
    done = {batch for batch in mine if npz_path and job.shard_is_done(batch)}
    for batch in progress_bar(  # a resumed --evaluate reads the batches already made back for their features
        mine if scorer else [batch for batch in mine if batch not in done],
        desc="batches",
        unit="batch",
        disable=not accelerator.is_local_main_process,
    ):
        indices = job.indices(batch)
        labels = job.labels[indices.start : indices.stop]
        if batch in done:
            images = job.read_shard(batch)
        else:
            images = sample_images(source.model, source.spec, decoder, labels, indices, settings, *where)
        if npz_path and batch not in done:
            job.save_shard(batch, images, labels)
        if scorer:
            scorer.add(images, indices)
    print(
        f"rank {accelerator.process_index}: {len(mine) - len(done)} batches made, {len(done)} already done",
        flush=True,
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and npz_path:
        job.assemble()
        counts = np.bincount(job.labels, minlength=max(job.classes) + 1)[list(job.classes)]
        print(
            f"wrote {npz_path}: arr_0 {job.num_samples} images, arr_1 labels ({len(job.classes)} classes, "
            f"{counts.min()}-{counts.max()} each), {settings.sampler} {settings.steps} steps, cfg {settings.cfg_scale}"
        )
    if scorer:
        kept = str(npz_path) if npz_path else f"sampled from {source.info['checkpoint']}, not kept"
        scorer.finish(args.results, {"samples": kept, "sampling": fingerprint})
    accelerator.wait_for_everyone()
    return 0


@exits_cleanly("dit-accel sample")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    with cpu_threads():
        return sample_eval_batch(args) if args.out is None else sample_grid(args)


if __name__ == "__main__":
    exit_command(main)
