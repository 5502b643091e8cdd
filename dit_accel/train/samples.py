"""`--sample-every N`: an EMA sample grid while training, to RUN/samples/step_N.png and to the trackers.

The grid is the one `dit-accel sample` makes (the same sampler, seeds and class-name labels), for a few
fixed classes with fixed seeds, so grids of successive steps differ only by the weights. It is sampled on
the main process from the EMA weights (the raw weights when the plan has no EMA). Under FSDP2 each rank
holds only its shard of the EMA: every rank takes part in gathering the full tensors (a collective, as a
checkpoint's save does), then the main process samples from an unsharded copy while the others wait.
That copy, and the gathered EMA, are memory the plan does not count: about 8 bytes per parameter on the
main process while the grid is made.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dit_accel.errors import UserError

log = logging.getLogger("dit_accel.train")
SAMPLES_PER_CLASS = 2  # one row per class, two seeds each
SAMPLES_DIR = "samples"


def grid_classes(text: str, num_classes: int) -> list[int]:
    """--sample-classes, or the default handful `dit-accel sample` shows."""
    from dit_accel.sample import command as sample

    if text:
        try:
            return sample.parse_classes(text, num_classes)
        except UserError as error:
            raise UserError(str(error).replace("--classes", "--sample-classes", 1)) from None
    return list(sample.IMAGENET_SHOWCASE) if num_classes == 1000 else list(range(min(8, num_classes)))


def run_vae_path(config, plan) -> str | None:
    """The VAE that decodes this run's latents: --vae (online), else the one its latent cache recorded."""
    if plan.decision.latents == "pixel":
        return None
    if config.vae:  # online, or the decoder of published latents (which name no VAE)
        return config.vae
    from dit_accel.data.latent_cache import read_manifest

    recorded = read_manifest(config.latents)["vae"]
    return recorded["source"] if recorded else None


def run_latent_norm(config, plan):
    """A precomputed run's latent normalisation (its cache's), before the trainer has built its parts;
    None for the others (online: the VAE's, from the same flags)."""
    if plan.decision.latents != "precomputed" or not config.latents:
        return None
    from dit_accel.data.latent_cache import manifest_latent_norm, read_manifest

    return manifest_latent_norm(read_manifest(config.latents))


class TrainingSamples:
    """Made once at the start (the classes and the decoder checked then, not at step N)."""

    def __init__(self, config, plan, spec, accelerator, components, run_dir: Path, class_names: list[str]):
        from dit_accel.sample.generate import SampleSettings, grid_labels, load_decoder

        self.every, self.spec, self.accelerator, self.components = (
            config.sample_every,
            spec,
            accelerator,
            components,
        )
        self.folder = run_dir / SAMPLES_DIR
        if not self.every:
            return
        classes = grid_classes(config.sample_classes, spec.num_classes)
        self.labels = grid_labels(classes, SAMPLES_PER_CLASS)
        self.row_names = [class_names[c] if c < len(class_names) else str(c) for c in classes]
        self.settings = SampleSettings(  # a flow run's grid: the probability-flow ODE (Heun)
            cfg_scale=config.sample_cfg_scale,
            steps=config.sample_steps,
            seed=config.seed,
            sampler="ode" if config.objective == "flow" else "ddpm",
            flow_path=config.flow_path,
        )
        self.decoder = None
        if accelerator.is_main_process:
            vae_path = run_vae_path(config, plan)
            if vae_path is None and spec.latents != "pixel":
                raise UserError(
                    f"--sample-every decodes its grids with a VAE, and the latents {config.latents} name none "
                    "(published latents)",
                    "pass --vae VAE (the one they were made with, e.g. VA-VAE's .pt), or --sample-every 0",
                )
            try:
                self.decoder = load_decoder(spec, vae_path, components.device, components.latent_norm)
            except (OSError, ValueError) as error:
                raise UserError(
                    f"--sample-every cannot load the VAE {vae_path} to decode its grids ({error})",
                    "pass --sample-every 0, or make the VAE folder the run was made with readable here",
                ) from None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 tensors by parameter name; every rank must call this (gathers shards under FSDP2)."""
        from dit_accel.distributed.fsdp import full_tensor

        ema = self.components.ema
        if ema is not None:
            return ema.state_dict()
        return {
            name: full_tensor(p.detach()).float() for name, p in self.components.raw_model.named_parameters()
        }

    @torch.no_grad()
    def write(self, step: int) -> Path | None:
        """Every rank calls this at the same step; the main process writes the grid, the others wait."""
        weights = self.weights()
        path = None
        if self.accelerator.is_main_process:
            path = self._sample(step, weights)
        del weights
        self.accelerator.wait_for_everyone()
        return path

    def _sample(self, step: int, weights: dict) -> Path:
        from dit_accel.images import make_grid, save_png
        from dit_accel.models.dit import build_model, set_timestep_freq_shift, timestep_freq_shift
        from dit_accel.sample.generate import label_rows, sample_images
        from dit_accel.train.trackers import log_image

        raw = self.components.raw_model
        model = build_model(self.spec, init="torch").to(self.components.device).eval()
        set_timestep_freq_shift(model, timestep_freq_shift(raw))
        params = dict(model.named_parameters())
        for name, tensor in weights.items():
            params[name].copy_(tensor.to(params[name].device))
        indices = range(len(self.labels))
        images = sample_images(
            model, self.spec, self.decoder, self.labels, indices, self.settings, device=self.components.device
        )
        grid = label_rows(make_grid(images, SAMPLES_PER_CLASS), self.row_names, images.shape[1])
        path = save_png(grid, self.folder / f"step_{step}.png")
        log_image(self.accelerator, "samples", grid, step)
        which = "EMA" if self.components.ema is not None else "raw"
        log.info(f"samples {path} ({which} weights, classes {', '.join(self.row_names)})")
        return path
