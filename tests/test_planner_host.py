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


def test_a_dataset_costs_each_rank_its_row_and_label_arrays_and_no_listing():
    """--data-source dataset: the Arrow table is mapped (shared page cache); a rank holds 16 B a row, as
    doctor measures it (dit_accel.data.hf_source.resident_bytes: two int64 arrays)."""
    folder = make_plan(gpus=8, vram="80G", global_batch=256, latents="online")["host"]
    plan = make_plan(gpus=8, vram="80G", global_batch=256, latents="online", data_source="dataset")
    host = plan["host"]
    assert host["per_rank"]["dataset_index"] == 16 * 1_281_167  # ImageNet's train split, by default
    assert "folder_index" not in host["per_rank"] and host["main_process_once"] == {"folder_listing": 0}
    assert host["per_node_bytes"] == 8 * host["per_rank_bytes"] < folder["per_node_bytes"]
    assert plan["inputs"]["data_source"] == "dataset" and host["data_source"] == "dataset"
    sized = make_plan(
        gpus=8,
        vram="80G",
        global_batch=256,
        latents="pixel",
        data_source="dataset",
        dataset_size=1000,
        epochs=1,
    )
    assert sized["host"]["per_rank"]["dataset_index"] == 16 * 1000
    cached = make_plan(gpus=8, vram="80G", global_batch=256, data_source="dataset")["host"]
    assert cached["per_rank"]["dataset_index"] == 0  # training reads latents: the dataset is not opened


def test_dit_plan_data_source_reaches_the_plan_and_refuses_another_name(tmp_path, capsys):
    from planner.cli import main

    out = tmp_path / "plan"
    argv = ["--gpus", "2", "--vram", "80G", "--global-batch", "16", "--latents", "online", "--out", str(out)]
    assert main([*argv, "--data-source", "dataset"]) == 0
    import json

    assert json.loads((out / "plan.json").read_text())["host"]["data_source"] == "dataset"
    capsys.readouterr()
    try:
        code = main([*argv, "--data-source", "arrow", "--out", str(tmp_path / "other")])
    except SystemExit as stop:
        code = stop.code
    assert code == 2 and "--data-source" in capsys.readouterr().err and not (tmp_path / "other").exists()
