"""The frozen VAE: loaded from a local folder (or a hub id already in the local Hugging Face cache: nothing
is downloaded at run time; or a released VA-VAE `.pt`, `models.vavae`), identified by a hash of its weights
so a latent cache can name the VAE it was made with, its posterior for a batch of pixels, and how its latents
are normalised for the network (`LatentNorm`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dit_accel.errors import UserError


def sha256_json(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class LatentNorm:
    """What the network sees of a posterior sample z, per channel: (z - shift) * scale. The Stable Diffusion
    VAE has one factor for every channel (`kind` "scale": its config's scaling and shift factors); VA-VAE
    normalises each channel by the data set's mean and std (`kind` "channel": shift = mean, scale = 1 / std,
    LightningDiT's latent_norm with multiplier 1). Recorded in a latent cache's manifest and beside every
    checkpoint's weights, so sampling decodes with what the model was trained on."""

    shift: tuple[float, ...]
    scale: tuple[float, ...]
    kind: str = "scale"

    @classmethod
    def of_factors(cls, scaling_factor: float, shift_factor: float, channels: int) -> LatentNorm:
        return cls((float(shift_factor),) * channels, (float(scaling_factor),) * channels, "scale")

    @classmethod
    def of_vae_config(cls, config, channels: int | None = None) -> LatentNorm:
        channels = channels or int(config.latent_channels)
        shift = float(getattr(config, "shift_factor", None) or 0.0)
        return cls.of_factors(float(config.scaling_factor), shift, channels)

    @classmethod
    def of_statistics(cls, mean, std) -> LatentNorm:
        mean, std = (
            [float(v) for v in torch.as_tensor(mean).flatten()],
            [float(v) for v in torch.as_tensor(std).flatten()],
        )
        if (
            len(mean) != len(std)
            or not all(s > 0 and math.isfinite(s) for s in std)
            or not all(map(math.isfinite, mean))
        ):
            raise UserError(
                f"latent statistics need one finite mean and one positive std per channel, got {len(mean)} means "
                f"and {len(std)} stds",
                "use the latents_stats.pt that came with the latents, or extract-latents' own",
            )
        return cls(tuple(mean), tuple(1.0 / s for s in std), "channel")

    @classmethod
    def from_json(cls, data: dict) -> LatentNorm:
        return cls(
            tuple(map(float, data["shift"])), tuple(map(float, data["scale"])), data.get("kind", "scale")
        )

    def to_json(self) -> dict:
        return {"kind": self.kind, "shift": list(self.shift), "scale": list(self.scale)}

    @property
    def channels(self) -> int:
        return len(self.shift)

    def _shaped(self, values, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=like.device).view(-1, 1, 1)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """Posterior samples (..., C, h, w) to what the network sees."""
        return (z - self._shaped(self.shift, z)) * self._shaped(self.scale, z)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """What the network made back to the VAE's latent space, for decoding."""
        return x / self._shaped(self.scale, x) + self._shaped(self.shift, x)


def read_latent_statistics(path: str | Path) -> LatentNorm:
    """Per-channel statistics from a file: LightningDiT's latents_stats.pt ({"mean", "std"} tensors, read
    weights-only) or a JSON {"mean": [...], "std": [...]} (or a LatentNorm's own JSON)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(
            f"latent statistics {path} do not exist", "pass the latents_stats.pt that came with the latents"
        )
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a pickle with a payload, a truncated file: all one refusal
        raise UserError(
            f"latent statistics {path} cannot be read as plain data ({type(error).__name__}): refused, since a "
            "received file never runs code when read",
            'pass the latents_stats.pt that came with the latents, or a JSON {"mean": [...], "std": [...]}',
        ) from None
    if isinstance(data, dict) and "shift" in data and "scale" in data:
        return LatentNorm.from_json(data)
    if not isinstance(data, dict) or "mean" not in data or "std" not in data:
        raise UserError(
            f"latent statistics {path} hold no mean and std", "pass LightningDiT's latents_stats.pt"
        )
    return LatentNorm.of_statistics(data["mean"], data["std"])


def online_latent_norm(vae, identity: dict, latent_stats: str | None) -> LatentNorm:
    """How online latents are normalised: the config's factors (the Stable Diffusion VAE), or a VA-VAE's
    per-channel statistics, from `latent_stats` or those its folder stores; none is one line."""
    channels = int(vae.config.latent_channels)
    if identity.get("latent_norm") != "channel":
        return LatentNorm.of_vae_config(vae.config, channels)
    if latent_stats:
        norm = read_latent_statistics(latent_stats)
    elif identity.get("statistics"):
        norm = LatentNorm.of_statistics(identity["statistics"]["mean"], identity["statistics"]["std"])
    else:
        raise UserError(
            f"{identity['source']} is a VA-VAE, whose latents are normalised per channel by the data set's "
            "statistics, and none are given",
            "pass --latent-stats latents_stats.pt (LightningDiT's; to the trainer, to sample, or to "
            "import-lightningdit), or extract a latent cache, which computes them",
        )
    if norm.channels != channels:
        raise UserError(f"the latent statistics have {norm.channels} channels, the VAE {channels}")
    return norm


def read_tokenizer_record(folder: Path) -> dict:
    """A VAE folder's `dit_accel_vae.json` ({} for a plain diffusers folder: the Stable Diffusion VAE's kind)."""
    from dit_accel.models.vavae import TOKENIZER_FILE, TOKENIZER_FORMAT

    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return {}
    fix = "pass the released VA-VAE .pt itself as --vae (this dit-accel reads it directly), or a folder it wrote"
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not JSON ({str(error)[:100]})", fix) from None
    if not isinstance(record, dict):
        raise UserError(f"{path} holds a JSON {type(record).__name__}, not an object", fix)
    if record.get("format") != TOKENIZER_FORMAT:
        raise UserError(
            f"{path} has format {record.get('format')!r}", f"this dit-accel reads {TOKENIZER_FORMAT!r}"
        )
    if record.get("latent_norm", "scale") not in ("scale", "channel") or not isinstance(
        record.get("tokenizer", ""), str
    ):
        raise UserError(
            f"{path}: latent_norm {record.get('latent_norm')!r} is neither 'scale' nor 'channel'", fix
        )
    statistics = record.get("statistics")
    if statistics is not None:
        try:
            LatentNorm.of_statistics(
                statistics["mean"], statistics["std"]
            )  # finite, positive, one per channel
        except (KeyError, TypeError, ValueError, UserError) as error:
            raise UserError(
                f"{path}: its statistics are not a mean and std per channel ({error})", fix
            ) from None
    return record


def load_vae(source: str):
    """A diffusers AutoencoderKL from a local folder (its own, or a pipeline folder with vae/), a released
    VA-VAE `.pt`, or a hub id already in the local Hugging Face cache. Returns (vae in eval mode on the CPU,
    identity dict); the identity's "tokenizer" and "latent_norm" say whether the latents are normalised by
    the config's factor ("scale") or per channel ("channel": VA-VAE), and a VA-VAE folder's stored
    statistics ("statistics"), if any."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix in (".pt", ".pth", ".ckpt"):
        from dit_accel.models.vavae import load_vavae_checkpoint

        vae, _notes = load_vavae_checkpoint(path)
        return vae, dict(vae_identity(vae, str(path.absolute())), tokenizer="va-vae", latent_norm="channel")
    looks_local = path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1
    if not looks_local:
        _refuse_uncached_hub_id(source)  # before diffusers is imported: a missing path fails at once
    from diffusers import AutoencoderKL  # imported here: reading a cache does not need diffusers

    if looks_local:
        if not path.is_dir():
            raise UserError(
                f"--vae {path} {'is a file, not a folder' if path.exists() else 'does not exist'}",
                "pass a folder written by AutoencoderKL.save_pretrained (config.json + weights)",
            )
        subfolder = (
            "vae"
            if not (path / "config.json").is_file() and (path / "vae" / "config.json").is_file()
            else None
        )
        if subfolder is None and not (path / "config.json").is_file():
            raise UserError(
                f"VAE folder {path} has no config.json",
                "pass a folder written by "
                "AutoencoderKL.save_pretrained, or a pipeline folder with a vae/ sub-folder",
            )
        try:
            vae = AutoencoderKL.from_pretrained(path, subfolder=subfolder, local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise UserError(
                f"cannot load the VAE from {path}: {str(error).splitlines()[0]}",
                "re-save it with AutoencoderKL.save_pretrained",
            ) from None
        source = str(path.absolute())
    else:
        try:  # the local cache only: no network at run time, so no retries against an unreachable hub
            vae = AutoencoderKL.from_pretrained(source, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - hub failures come as many types; all mean the same here
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UserError(
                f"cannot load the VAE {source!r} from the local Hugging Face cache ({reason})",
                "pass a local folder written by AutoencoderKL.save_pretrained",
            ) from None
    vae.eval().requires_grad_(False)
    identity = vae_identity(vae, source)
    record = (
        read_tokenizer_record(Path(source) / ("vae" if (Path(source) / "vae").is_dir() else ""))
        if looks_local
        else {}
    )
    identity.update(
        tokenizer=record.get("tokenizer", "sd-vae"), latent_norm=record.get("latent_norm", "scale")
    )
    if record.get("statistics"):
        identity["statistics"] = record["statistics"]
    return vae, identity


def _refuse_uncached_hub_id(source: str) -> None:
    """`--vae NAME` that is no folder here may be a hub id; one that the local cache does not hold is one
    line now, naming the path it is not and the cache it is not in (the hub is never asked)."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(source, "config.json")
    except ValueError:  # not a valid repo id either
        cached = None
    if not isinstance(cached, str):
        raise UserError(
            f"--vae {source}: no folder {Path(source).expanduser().absolute()} and no hub model {source!r} "
            f"in the local Hugging Face cache {constants.HF_HUB_CACHE}",
            "pass a folder written by AutoencoderKL.save_pretrained (or a pipeline folder with vae/), or "
            f"download the model once where there is a network: `huggingface-cli download {source}`",
        )


def vae_identity(vae, source: str) -> dict:
    """What makes two VAEs the same for a cache: a hash of the config (private `_` keys excluded) and
    of the weights (names, dtypes, shapes, bytes). The path is recorded but not compared, so a moved
    folder still matches."""
    config = {key: value for key, value in dict(vae.config).items() if not key.startswith("_")}
    weights = hashlib.sha256()
    for name, tensor in sorted(vae.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        weights.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        weights.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {
        "source": source,
        "class": type(vae).__name__,
        "config_sha256": sha256_json(config),
        "weights_sha256": weights.hexdigest(),
    }


@torch.inference_mode()
def encode_posterior(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's diagonal Gaussian posterior for pixels in [-1, 1]: (mean, std), unscaled."""
    posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    return posterior.mean.float(), posterior.std.float()
