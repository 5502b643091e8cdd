"""The host-RAM estimate counts an image folder's listing as the trainer now holds it: each rank maps the
index the main process writes (`folder_index`), and the main process alone lists the folder, once per job
(`main_process_once`), where every rank used to list it (benchmarks/folder_listing_scale.py)."""

from planner.hardware import Assumptions
from planner.plan import make_plan


def test_an_image_folder_costs_each_rank_its_mapped_index_and_the_main_process_the_listing():
    assumed = Assumptions()
    for latents in ("online", "pixel"):
        host = make_plan(gpus=8, vram="80G", global_batch=256, latents=latents)["host"]
        assert host["per_rank"]["folder_index"] == assumed.folder_index_bytes
        assert host["main_process_once"] == {"folder_listing": assumed.folder_listing_bytes}
        assert host["per_node_bytes"] == 8 * host["per_rank_bytes"] + assumed.folder_listing_bytes
    cached = make_plan(gpus=8, vram="80G", global_batch=256)["host"]  # precomputed latents: no folder
    assert cached["per_rank"]["folder_index"] == 0 and cached["main_process_once"] == {"folder_listing": 0}
    assert cached["per_node_bytes"] == 8 * cached["per_rank_bytes"]


def test_the_folder_figures_are_assumptions_a_user_can_change():
    host = make_plan(
        gpus=2,
        vram="80G",
        global_batch=16,
        latents="pixel",
        assumptions={"folder_index_bytes": 10 * 2**20, "folder_listing_bytes": 3 * 2**30},
    )["host"]
    assert host["per_rank"]["folder_index"] == 10 * 2**20
    assert host["per_node_bytes"] == 2 * host["per_rank_bytes"] + 3 * 2**30
