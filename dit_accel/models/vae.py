"""The frozen VAE: loaded from a local folder (or a hub id already in the local Hugging Face cache: nothing
is downloaded at run time), identified by a hash of its weights so a latent cache can name the VAE it was
made with, and its posterior for a batch of pixels."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dit_accel.errors import UserError


def sha256_json(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_vae(source: str):
    """A diffusers AutoencoderKL from a local folder (its own, or a pipeline folder with vae/), or from a hub
    id already in the local Hugging Face cache. Returns (vae in eval mode on the CPU, identity dict)."""
    path = Path(source).expanduser()
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
    return vae, vae_identity(vae, source)


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
