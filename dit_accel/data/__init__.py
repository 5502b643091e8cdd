"""Data for dit-accel: ImageNet-layout image folders (`folder`), the latent cache (`latents`) and a
small demo folder (`demo`). See docs/data.md."""

from dit_accel.data.folder import (
    FolderListing, FolderSummary, ImageFolderData, center_crop_adm, list_image_folder, read_classes_json,
    validate_image_folder, write_classes_json,
)
from dit_accel.data.latents import (
    ExtractConfig, LatentCache, check_cache_matches, extract_latents, load_vae, read_manifest, verify_cache,
    vae_identity,
)

__all__ = [
    "FolderListing", "FolderSummary", "ImageFolderData", "center_crop_adm", "list_image_folder",
    "read_classes_json", "validate_image_folder", "write_classes_json",
    "ExtractConfig", "LatentCache", "check_cache_matches", "extract_latents", "load_vae", "read_manifest",
    "verify_cache", "vae_identity",
]
