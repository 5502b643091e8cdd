"""Sampling a network, the part every caller shares (`dit-accel sample`, training's --sample-every and
--eval-every, export's check): the settings that decide sample i's pixels, each sample's own seed (the rule in
`sample.command`'s docstring), balanced and grid labels, the weights and decoder to sample with, and the DDPM,
DDIM or flow sampler run to images."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dit_accel.diffusion.names import DIFFUSION_FORMS, ODE_SOLVERS
from dit_accel.errors import UserError
from dit_accel.run.weights import load_weights
from dit_accel.sample.args import DDPM_SAMPLERS, FLOW_SAMPLERS, GUIDANCE_MODES, LABEL_MODES, SAMPLERS


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
    time_shift: float = 1.0  # the ODE grid's shift (LightningDiT's timestep shift; 1: even)
    labels: str = "balanced"  # the evaluation batch's: "balanced" or "random" (the papers' torch.randint)
    tf32: bool = False  # TF32 matmuls on CUDA while sampling

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
        if self.labels not in LABEL_MODES:
            raise UserError(f"--labels must be one of {', '.join(LABEL_MODES)}, got {self.labels!r}")


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


def random_labels(num_samples: int, num_classes: int, seed: int) -> np.ndarray:
    """num_samples labels drawn uniformly at random, as the papers' repositories draw them (torch.randint),
    here from one generator of `seed`: the same list whatever the number of processes."""
    return np.random.default_rng([seed, RANDOM_LABELS_STREAM]).integers(0, num_classes, num_samples)


RANDOM_LABELS_STREAM = 0x1ABE15  # keeps the labels' stream apart from any other use of the seed


def grid_labels(classes: Sequence[int], per_class: int) -> list[int]:
    """Grid order: all samples of the first class, then the second, ... (one grid row per class)."""
    return [int(label) for label in classes for _ in range(per_class)]


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

    @property
    def latent_norm(self):
        """How the model's latents were normalised in training (its checkpoint's record), or None where
        nothing recorded it (runs before it was, diffusers folders: the VAE's own factors then)."""
        from dit_accel.models.diffusers_format import read_sidecar
        from dit_accel.models.vae import LatentNorm

        folder = Path(self.info["checkpoint"])
        recorded = read_sidecar(folder).get("latent_norm") if folder.is_dir() else None
        return LatentNorm.from_json(recorded) if recorded else None


def load_source(path: str | os.PathLike, use_ema: bool = True, device: torch.device | str = "cpu") -> Source:
    """A trainer checkpoint or run folder (EMA weights by default), or a diffusers transformer/pipeline folder.

    The timestep shift travels with the weights (`dit_accel.json`): a checkpoint written by `import-dit`, or
    fine-tuned from one, computes with the original DiT's shift (0).
    """
    from dit_accel.run import checkpoint as ckpt

    path = Path(path)
    if not path.exists():
        raise UserError(
            f"--checkpoint {path} does not exist: pass a run folder, a checkpoint folder or a diffusers "
            f"DiT pipeline folder"
        )
    model, spec, info = load_weights(path, use_ema=use_ema, device=device)
    config_path = Path(info["checkpoint"]) / ckpt.TRAIN_CONFIG
    train_config = (
        json.loads(config_path.read_text())
        if info["weights"] != "diffusers" and config_path.is_file()
        else {}
    )
    return Source(model, spec, info, train_config)


EMA_INITIAL_SHARE_WARNING = 0.1  # above this share of its initial weights, EMA samples look untrained


def warn_about_the_ema(source: Source, command: str = "sample") -> None:
    """Once the request is known to be good, just before sampling (or exporting) starts."""
    if source.info["weights"] == "ema":
        warn_if_ema_is_mostly_initial(Path(source.info["checkpoint"]), source.train_config, command)


def warn_if_ema_is_mostly_initial(
    checkpoint: Path, train_config: dict, command: str = "sample"
) -> float | None:
    """Say so when the EMA has seen too few updates to forget the untrained weights it started from (0.9999
    needs ~23k to forget 90%): such a grid (or exported pipeline) is noise, not a broken run. Returns the
    share, or None if unknown."""
    from dit_accel.run import checkpoint as ckpt
    from dit_accel.run.weights import initial_weight_share

    if not (Path(checkpoint) / ckpt.TRAIN_STATE).is_file():
        return None
    state = ckpt.read_train_state(checkpoint)  # a crafted one: one line
    if state.get("imported_from") or state.get("init_from"):  # imported, or --init-from: a trained start
        return None
    updates = int(state.get("applied_steps", state.get("step", 0)))
    decay = float(train_config.get("ema_decay", 0.9999))
    share = initial_weight_share(decay, bool(train_config.get("ema_warmup", False)), updates)
    if share > EMA_INITIAL_SHARE_WARNING:
        what = "samples" if command == "sample" else "the pipeline's images"
        print(
            f"dit-accel {command}: warning: the EMA weights are still {share:.0%} their initial weights "
            f"({updates} updates at decay {decay:g}), so {what} will look untrained; {command} the trained "
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

        recorded = read_manifest(latents_dir)["vae"]  # None for published latents: --vae then
        return recorded["source"] if recorded else None
    folder = Path(source.info["checkpoint"])
    if source.info.get("weights") == "diffusers" and (folder / "vae" / "config.json").is_file():
        return str(folder / "vae")
    return None


@dataclass
class Decoder:
    """Latents -> pixels in [-1, 1]. The network's latents are (posterior sample - shift) * scale per channel
    (`models.vae.LatentNorm`), as the latent cache and the trainer make them, so decoding undoes that first.
    `vae` None for a pixel-space model."""

    vae: torch.nn.Module | None
    latent_norm: object | None = None  # models.vae.LatentNorm
    source: str | None = None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            return x.clamp(-1, 1)
        latents = self.latent_norm.denormalize(x.float()).to(self.vae.device, self.vae.dtype)
        return self.vae.decode(latents).sample.float().clamp(-1, 1)


def load_decoder(
    spec, vae_path: str | None, device: torch.device | str, latent_norm=None, latent_stats: str | None = None
) -> Decoder:
    """The VAE and the latent normalisation to decode with: `latent_norm` (what the model was trained on, its
    checkpoint's record), else the VAE's own (its factors, or a VA-VAE's `latent_stats` or stored statistics)."""
    if spec.latents == "pixel":
        if vae_path:
            raise UserError("--vae is for latent models, but this model works in pixel space: drop --vae")
        return Decoder(None)
    if not vae_path:
        raise UserError(
            "this model makes VAE latents and no VAE is recorded with its run: pass --vae DIR "
            "(the AutoencoderKL folder it was trained with)"
        )
    from dit_accel.models.vae import load_vae, online_latent_norm

    vae, identity = load_vae(vae_path)
    vae.to(device)
    norm = latent_norm or online_latent_norm(vae, identity, latent_stats)
    if norm.channels != spec.in_channels:
        raise UserError(
            f"the VAE {identity['source']} makes {norm.channels}-channel latents, the model {spec.in_channels}",
            "pass the --vae the model was trained with",
        )
    return Decoder(vae, norm, identity["source"])


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
    from dit_accel.diffusion.objective import Diffusion
    from dit_accel.diffusion.sampling import classifier_free_guidance, ddim_sample, ddpm_sample
    from dit_accel.models.dit import as_model_fn, null_class

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
    from dit_accel.models.dit import as_model_fn, null_class

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
        return ode_sample(
            model_fn, flow, shape, y, solver=settings.ode_solver, time_shift=settings.time_shift, **common
        )
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
