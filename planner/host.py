"""Host RAM per node: what kills ranks with `exitcode: -9` (the kernel's OOM killer) before a GPU ever fills.

Every rank on a node is its own process holding its own CPU copies while it starts or resumes, and each
spawns its own data-loader workers. The estimate is per rank, times the GPUs of a node, plus what the main
process alone holds once: the listing of an image folder, which it makes for every rank (the ranks map the
index it writes). A Hugging Face dataset (`--data-source dataset`) is an Arrow table that every rank maps:
its pages are the kernel's shared, reclaimable page cache, and what a rank holds resident is its row and
label arrays (`dataset_row_bytes` a row, as `dit-accel doctor` reports them).
"""

from __future__ import annotations

from planner import vae
from planner.activations import FP32_BYTES
from planner.decision import Cluster, Decision
from planner.hardware import Assumptions
from planner.spec import DiTSpec
from planner.units import count, format_bytes

WARN_FRACTION = 0.9  # warn when the estimate comes this close to --host-ram
IMAGENET_TRAIN_IMAGES = 1_281_167  # the rows a dataset is taken to have without --dataset-size
# --data-source: where the images of an online or pixel run come from (the trainer's --data-path)
DATA_SOURCES = {
    "folder": "an ImageNet-layout folder of image files, listed once by the main process",
    "dataset": "a Hugging Face dataset (save_to_disk or parquet), its Arrow table memory-mapped by every rank",
}


def sample_bytes(spec: DiTSpec, latents: str, repa: str = "") -> int:
    """One sample as a worker hands it over: an fp32 latent from the cache, or fp32 RGB pixels; REPA from a
    cache hands over both (the encoder sees the latent's source image)."""
    pixels = FP32_BYTES * 3 * spec.resolution**2
    if latents == "precomputed":
        return FP32_BYTES * spec.in_channels * spec.latent_size**2 + (pixels if repa else 0)
    return pixels


def _image_source_bytes(decision: Decision, assumptions: Assumptions, data_source: str, rows: int | None):
    """(a rank's share, the main process's once) of the image source: none when training reads latents."""
    if decision.latents == "precomputed" and not decision.repa:
        return 0, 0
    if data_source == "dataset":
        return assumptions.dataset_row_bytes * (rows or IMAGENET_TRAIN_IMAGES), 0
    if decision.latents == "precomputed":  # REPA: the cache's names of its images, no folder listing
        return assumptions.folder_index_bytes, 0
    return assumptions.folder_index_bytes, assumptions.folder_listing_bytes


def per_rank_bytes(
    spec: DiTSpec, decision: Decision, assumptions: Assumptions, data_source: str = "folder", rows=None
) -> dict[str, int]:
    """Host bytes of one rank at its worst moment (resuming), by part.

    model_states: on resume `load_state` reads the model, EMA and optimizer state dicts to the CPU
    (4 + 4 + 8 B/param); start-up holds less (the model is built on the GPU), so resume is the figure.
    vae: online latents load the VAE on the CPU first.
    """
    params = spec.params_trainable
    ema = FP32_BYTES * params if decision.ema else 0
    resume = FP32_BYTES * params + 2 * FP32_BYTES * params + ema
    batch = decision.micro_batch * sample_bytes(spec, decision.latents, decision.repa)
    return {
        "process": assumptions.host_process_bytes,
        "model_states": resume,
        "vae": vae.autoencoder_params(spec.tokenizer, assumptions.vae_params) * FP32_BYTES
        if decision.latents == "online"
        else 0,
        "loader_workers": assumptions.loader_workers * assumptions.loader_worker_bytes,
        "loader_prefetch": assumptions.loader_workers * assumptions.prefetch_factor * batch,
        "pinned_batches": assumptions.pinned_batches * batch,
        # an image folder's index (RUN/data_index), or a dataset's row and label arrays
        f"{data_source}_index": _image_source_bytes(decision, assumptions, data_source, rows)[0],
    }


def main_process_bytes(
    decision: Decision, assumptions: Assumptions, data_source: str = "folder", rows=None
) -> dict[str, int]:
    """What the main process holds beyond a rank's share, once per job (so on the first node): the listing of
    an image folder while it checks it and writes the index every rank reads (a dataset needs none)."""
    return {"folder_listing": _image_source_bytes(decision, assumptions, data_source, rows)[1]}


def host_estimate(
    spec: DiTSpec,
    decision: Decision,
    cluster: Cluster,
    assumptions: Assumptions,
    host_ram_bytes: int | None,
    data_source: str = "folder",
    rows: int | None = None,
) -> tuple[dict, list[str]]:
    """The plan's `host` section and its warnings (with the fix) when --host-ram is too small. `rows`: the
    dataset's size (--dataset-size), for a dataset's per-rank arrays."""
    parts = per_rank_bytes(spec, decision, assumptions, data_source, rows)
    rank_total = sum(parts.values())
    once = main_process_bytes(decision, assumptions, data_source, rows)
    node_total = rank_total * cluster.gpus_per_node + sum(once.values())  # the main process's node
    host = {
        "per_rank": parts,
        "per_rank_bytes": rank_total,
        "main_process_once": once,
        "ranks_per_node": cluster.gpus_per_node,
        "per_node_bytes": node_total,
        "host_ram_bytes": host_ram_bytes,
        "fits": None if host_ram_bytes is None else node_total <= host_ram_bytes,
        "loader_workers_per_rank": assumptions.loader_workers,
        "data_source": data_source,
    }
    warnings = []
    if host_ram_bytes is not None and node_total > WARN_FRACTION * host_ram_bytes:
        largest = max(parts, key=parts.get)
        verdict = "exceeds" if node_total > host_ram_bytes else "is close to"
        fixes = [
            f"fewer data-loader workers (now {assumptions.loader_workers} per rank: --assume loader_workers=N)",
            "loading the weights once per node instead of once per rank",
        ]
        if decision.latents != "precomputed":
            fixes.append("precomputed latents (dit-accel extract-latents)")
        ranks = count(cluster.gpus_per_node, "rank") + (" needs" if cluster.gpus_per_node == 1 else " need")
        warnings.append(
            f"host RAM: {ranks} about {format_bytes(node_total)} per node (largest part: "
            f"{largest.replace('_', ' ')}), which {verdict} --host-ram {format_bytes(host_ram_bytes)}; the kernel kills "
            f"ranks with exitcode -9 when it runs out. Fix: " + "; ".join(fixes)
        )
    return host, warnings
