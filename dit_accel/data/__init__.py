"""Data for dit-accel: ImageNet-layout image folders (`folder`) and Hugging Face datasets (`hf_source`,
`source_kind`), the latent cache (written by `latents` and `stream_latents`, read by `latent_cache`, its
source images by `cache_images`), a small demo folder (`demo`), and which samples each rank reads with each
sample's own randomness (`order`). See docs/data.md.

Imports: the foundations, `models` (the VAE that makes latents), `diffusion` (a sample's noise and time),
`run` (stop signals during extraction) and the planner; the trainer's DataLoader is `train.data`.

The names below are imported on first use, so `python -m dit_accel.data.latents` (what `accelerate
launch -m` runs) does not import its own module twice, and `import dit_accel.data` stays cheap."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "folder": [
        "FolderListing",
        "FolderSummary",
        "ImageFolderData",
        "center_crop_adm",
        "list_image_folder",
        "read_classes_json",
        "validate_image_folder",
        "write_classes_json",
    ],
    "latents": ["ExtractConfig", "extract_latents"],
    "latent_cache": ["LatentCache", "check_cache_matches", "read_manifest", "verify_cache"],
    "demo": ["write_demo_data"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
