"""`dit-plan` end to end: files, the plan.json contract, formats, sweeps, bad input, atomic writes."""

import json
import os
from pathlib import Path

import pytest

from planner import cli
from planner.plan import make_plan
from planner.spec import model_spec

BASE = ["--gpus", "8", "--vram", "40G", "--global-batch", "256"]


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_headline_command_writes_the_plan_files(tmp_path, capsys):
    code, out, err = run(BASE + ["--out", str(tmp_path / "plan")], capsys)
    assert code == 0 and err == ""
    files = sorted(p.name for p in (tmp_path / "plan").iterdir())
    assert files == ["accelerate_config.yaml", "memory.png", "plan.json", "plan.md"]
    assert "G/GB = 10^9 bytes, GiB = 2^30 bytes" in out  # the unit convention, said
    assert "37.25 GiB = 40.00 GB" in out
    for heading in ("Decision", "Memory per GPU at its peak", "Alternatives", "Warnings"):
        assert heading in out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan == json.loads(json.dumps(make_plan(gpus=8, vram="40G", global_batch=256)))


def test_the_plan_folder_and_the_plot_get_the_modes_a_plain_open_would_give(tmp_path, capsys):
    """Staged in mkdtemp (0700) and mkstemp (0600) for atomicity, they must not stay private: a plan is
    read by other users of the cluster (the launcher, a teammate), as every other file of it is."""
    umask = os.umask(0o022)
    try:
        code, _, _ = run(
            BASE + ["--out", str(tmp_path / "plan"), "--plot", str(tmp_path / "chart.png")], capsys
        )
    finally:
        os.umask(umask)
    assert code == 0
    mode = lambda path: path.stat().st_mode & 0o777
    assert mode(tmp_path / "plan") == 0o755 and mode(tmp_path / "chart.png") == 0o644
    assert {mode(path) for path in (tmp_path / "plan").iterdir()} == {0o644}


def test_plan_json_contract(tmp_path, capsys):
    run(BASE + ["--out", str(tmp_path)], capsys)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schema"] == "dit-plan/1"
    assert {
        "schema",
        "inputs",
        "model",
        "cluster",
        "global_batch",
        "decision",
        "memory",
        "throughput",
        "host",
        "alternatives",
        "warnings",
    } <= set(plan)
    spec = model_spec("DiT-XL/2", 256)
    assert {
        k: plan["model"][k]
        for k in (
            "name",
            "resolution",
            "latent_size",
            "in_channels",
            "tokens",
            "params_trainable",
            "fwd_flops_per_image",
        )
    } == {
        "name": "DiT-XL/2",
        "resolution": 256,
        "latent_size": 32,
        "in_channels": 4,
        "tokens": 256,
        "params_trainable": spec.params_trainable,
        "fwd_flops_per_image": spec.fwd_flops_per_image,
    }
    c = plan["cluster"]
    assert (c["nodes"], c["gpus_per_node"], c["world_size"], c["vram_bytes"], c["gpu"]) == (
        1,
        8,
        8,
        40 * 10**9,
        None,
    )
    d = plan["decision"]
    assert d["micro_batch"] * d["grad_accum"] * c["world_size"] == plan["global_batch"] == 256
    assert 0 <= d["checkpointed_blocks"] <= 28 and d["precision"] in ("bf16", "fp16", "fp32")
    assert d["sharding"] in ("ddp", "zero2", "zero3") and d["latents"] == "precomputed" and d["ema"] is True
    m = plan["memory"]
    parts = (
        "weights",
        "grads",
        "optimizer",
        "ema",
        "activations",
        "autocast_cache",
        "vae",
        "temporaries",
        "allocator",
        "overhead",
    )
    assert sum(m[k] for k in parts) == m["peak_bytes"] <= m["budget_bytes"] == 38 * 10**9  # 5% headroom
    # the budget holds the caching allocator's reserved peak and the memory outside it
    assert m["peak_bytes"] == m["reserved_peak_bytes"] + m["overhead"]
    assert m["allocated_peak_bytes"] <= m["reserved_peak_bytes"] and m["allocator_segments"] == "expandable"
    assert {"step_flops", "est_images_per_s", "assumed_mfu"} <= set(plan["throughput"])
    assert plan["host"]["per_node_bytes"] == 8 * plan["host"]["per_rank_bytes"]
    for alternative in plan["alternatives"]:
        assert {
            "micro_batch",
            "grad_accum",
            "checkpointed_blocks",
            "precision",
            "sharding",
            "latents",
            "ema",
            "peak_bytes",
            "est_images_per_s",
        } <= set(alternative)
    assert isinstance(plan["warnings"], list)
    assert plan["inputs"]["vram"] == "40G" and plan["inputs"]["gpus"] == 8


def test_plan_md_explains_its_arithmetic(tmp_path, capsys):
    run(BASE + ["--out", str(tmp_path)], capsys)
    text = (tmp_path / "plan.md").read_text()
    for section in (
        "## Inputs",
        "## Decision",
        "## Memory per GPU",
        "### The arithmetic",
        "## Alternatives",
        "## Assumptions",
        "## Throughput estimate",
        "## How the decision was made",
    ):
        assert section in text
    assert "32 x 1 x 8 = 256" in text and "674,834,720" in text and "B per token x hidden" in text


def test_tiny_custom_model_for_other_tests(tmp_path, capsys):
    argv = [
        "--model",
        "DiT-S/2",
        "--depth",
        "2",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--resolution",
        "64",
        "--num-classes",
        "4",
        "--gpus",
        "2",
        "--vram",
        "8G",
        "--global-batch",
        "8",
        "--out",
        str(tmp_path),
    ]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    m = plan["model"]
    assert (m["depth"], m["hidden"], m["heads"], m["patch"], m["num_classes"], m["latent_size"]) == (
        2,
        32,
        2,
        2,
        4,
        8,
    )
    assert (
        m["params_trainable"]
        == model_spec("DiT-S/2", 64, depth=2, hidden=32, heads=2, num_classes=4).params_trainable
    )
    d = plan["decision"]
    assert d["micro_batch"] * d["grad_accum"] * 2 == 8


@pytest.mark.parametrize(
    "fmt, marker",
    [("markdown", "|:--"), ("github", "|----"), ("latex", "\\begin{tabular}"), ("table", "-----")],
)
def test_formats(tmp_path, capsys, fmt, marker):
    code, out, _ = run(BASE + ["--format", fmt, "--out", str(tmp_path)], capsys)
    assert code == 0 and marker in out


def test_json_format_prints_the_plan_only(tmp_path, capsys):
    code, out, err = run(BASE + ["--format", "json", "--out", str(tmp_path)], capsys)
    assert code == 0
    assert json.loads(out) == json.loads((tmp_path / "plan.json").read_text())
    assert out.endswith("}\n") and "wrote" in err


def test_sweep_gives_one_row_per_combination_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(
        ["--gpu", "a100-40g,a100-80g,h100-80g", "--gpus", "8,16", "--global-batch", "256"], capsys
    )
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith(("1 x 8 ", "2 x 8 "))]
    assert len(rows) == 6
    assert list(tmp_path.iterdir()) == []
    code, out, _ = run(
        ["--vram", "24G,80G", "--gpus", "7,8", "--global-batch", "256", "--format", "json"], capsys
    )
    rows = json.loads(out)
    assert len(rows) == 4
    for row in rows:
        if row["gpus"] == 7:
            assert "does not divide" in row["note"] and "micro_batch" not in row
        else:
            assert row["micro_batch"] * row["grad_accum"] * row["gpus"] == 256 and row["peak_bytes"] > 0
    assert list(tmp_path.iterdir()) == []


BAD = [
    (["--gpus", "0", "--vram", "40G"], "--gpus must be positive"),
    (["--gpus", "eight", "--vram", "40G"], "--gpus 'eight' is not a whole number"),
    (["--gpus", "-2", "--vram", "40G"], "--gpus must be positive"),
    (["--gpus", "8"], "give the GPU memory"),
    (["--vram", "40G"], "give --gpus"),
    (["--gpus", "8", "--vram", "40"], "no unit"),
    (["--gpus", "8", "--vram", "40XB"], "unknown unit"),
    (["--gpus", "8", "--gpu", "a100-4g"], "did you mean a100-40g"),
    (["--gpus", "8", "--gpu", "a100"], "--gpu a100 is ambiguous: the a100-40g and a100-80g differ in memory"),
    (["--gpus", "8", "--gpu", "A100"], "pass --gpu a100-40g or --gpu a100-80g"),
    (["--gpus", "8", "--gpu", "v100"], "--gpu v100 is ambiguous"),
    (
        ["--gpus", "8", "--gpu", "mi300x"],
        "--gpu mi300x has no preset: dit-plan's presets and MFU table are NVIDIA",
    ),
    (["--gpus", "8", "--gpu", "MI250"], "plan by memory alone with --vram SIZE"),
    (["--gpus", "8", "--vram", "40G", "--model", "DiT-XXL/2"], "did you mean DiT-XL/2"),
    (["--gpus", "8", "--vram", "40G", "--resolution", "260"], "multiple of 16"),
    (["--gpus", "8", "--vram", "40G", "--global-batch", "255"], "use 248 or 256"),
    (["--gpus", "8", "--vram", "40G", "--global-batch", "0"], "--global-batch must be positive"),
    (["--gpus", "8", "--gpu", "v100-16g", "--precision", "bf16"], "no bf16"),
    (["--gpus", "8", "--gpu", "a100-40g", "--vram", "80G"], "more than a100-40g"),
    (["--gpus", "8", "--vram", "40G", "--main-process-ip", "10.0.0.1"], "only matters with --nodes"),
    (["--gpus", "8", "--vram", "40G", "--checkpointing", "29"], "outside 0..28"),
    (["--gpus", "8", "--vram", "40G", "--checkpointing", "some"], "--checkpointing must be"),
    (
        ["--gpus", "1", "--vram", "40G", "--sharding", "zero2", "--global-batch", "32"],
        "needs more than one GPU",
    ),
    (["--gpus", "8", "--vram", "40G", "--headroom", "150%"], "--headroom"),
    (["--gpus", "8", "--vram", "40G", "--bogus"], "unrecognized arguments: --bogus"),
    (["--gpus", "8", "--vram", "40G", "--precision", "bf17"], "invalid choice: 'bf17'"),
    (["--gpus", "8", "--vram", "40G", "--assume", "warp=1"], "--assume 'warp=1'"),
    (["--gpus", "8", "--vram", "40G", "--assume", "fragmentation=2"], "fragmentation must be a fraction"),
    (["--gpus", "8", "--vram", "40G", "--nodes", "0"], "--nodes must be positive"),
    (["--gpus", "12", "--vram", "40G"], "does not split into nodes of 8"),
    (["--gpus", "9", "--nodes", "2", "--vram", "40G"], "--gpus 9 (the total) does not divide into --nodes 2"),
    (["--gpus", "16", "--gpus-per-node", "4", "--nodes", "2", "--vram", "40G"], "contradicts --nodes 2"),
    (["--gpus", "12", "--gpus-per-node", "8", "--vram", "40G"], "not a whole number of nodes"),
    (["--nodes", "2", "--vram", "40G"], "give --gpus N, the total"),
    (["--gpus-per-node", "0", "--vram", "40G"], "--gpus-per-node must be positive"),
    (["--gpus", "8", "--vram", "40G", "--plot", "chart.txt"], "must end in .png, .svg or .pdf"),
    (["--gpus", "8", "--vram", "40G", "--depth", "0"], "--depth must be positive"),
    (["--gpus", "8", "--vram", "40G", "--hidden", "30", "--heads", "4"], "does not divide into 4 heads"),
    (["--gpus", "8", "--vram", "40G", "--max-micro-batch", "x"], "--max-micro-batch 'x'"),
    (["--gpus", "1", "--vram", "12G", "--resolution", "512"], "needs at least"),
    (["--gpus", "8,16", "--vram", "40G", "--out", "somewhere"], "a sweep prints one table"),
    (["--gpus", "8", "--vram", "40G,80G", "--gpu", "a100-80g"], "sweep either --vram or --gpu"),
]


@pytest.mark.parametrize("argv, fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_no_files(tmp_path, capsys, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dit-plan: error: "), err
    assert fragment in lines[0]
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # not even ./plan or a staging directory


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("mine")
    code, _, err = run(BASE + ["--out", str(target)], capsys)
    assert code == 2 and "is a file" in err and target.read_text() == "mine"


def test_a_write_that_fails_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    calls = []
    real = Path.write_text

    def failing(self, text, *args, **kwargs):
        calls.append(self.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    with pytest.raises(OSError):
        cli.main(BASE + ["--out", str(tmp_path / "plan")])
    assert list(tmp_path.iterdir()) == []


def test_replanning_replaces_our_files_and_keeps_the_users(tmp_path, capsys):
    out = tmp_path / "plan"
    assert run(BASE[2:] + ["--gpus", "16", "--out", str(out)], capsys)[0] == 0
    assert (out / "launch.slurm").exists()
    (out / "notes.txt").write_text("keep me")
    assert run(BASE + ["--gpus", "4", "--out", str(out)], capsys)[0] == 0
    assert not (out / "launch.slurm").exists()  # a single-node plan must not leave a stale multi-node script
    assert (out / "notes.txt").read_text() == "keep me"
    assert json.loads((out / "plan.json").read_text())["cluster"]["world_size"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["plan"]  # no staging directory left


def test_host_ram_warning_names_the_fix(tmp_path, capsys):
    code, out, _ = run(BASE + ["--host-ram", "64GiB", "--latents", "online", "--out", str(tmp_path)], capsys)
    assert code == 0
    out = " ".join(out.split("\n  "))  # warnings wrap to 100 columns
    assert "exitcode -9" in out and "fewer data-loader workers" in out and "precomputed latents" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["host"]["fits"] is False and plan["host"]["host_ram_bytes"] == 64 * 2**30


def test_assumptions_override_and_list(tmp_path, capsys):
    code, _, _ = run(
        BASE + ["--assume", "cuda_context_bytes=1GiB", "--assume", "mfu_mixed=0.5", "--out", str(tmp_path)],
        capsys,
    )
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert code == 0 and plan["assumptions"]["cuda_context_bytes"] == 2**30
    assert plan["throughput"]["assumed_mfu"] == 0.5
    code, out, _ = run(["--list-assumptions"], capsys)
    assert code == 0 and "half_efficiency_tokens" in out and "fragmentation" in out


def test_console_script_is_installed():
    import shutil

    assert shutil.which("dit-plan") or os.path.exists(
        os.path.join(os.path.dirname(os.sys.executable), "dit-plan")
    )


def test_the_planner_never_imports_torch():
    """dit-plan must answer on a laptop without a GPU stack: the whole planner runs without torch,
    accelerate or diffusers being imported."""
    import subprocess
    import sys

    code = (
        "import sys; from planner.cli import main; import planner.plan, planner.report, planner.outputs;"
        "import planner.report.planmd;"
        "plan = planner.plan.make_plan(gpus=8, vram='40G', global_batch=256); planner.report.render(plan);"
        "planner.report.planmd.plan_markdown(plan); planner.outputs.render_files(plan, chart=False);"
        "heavy = {'torch', 'accelerate', 'diffusers', 'numpy'} & set(sys.modules); assert not heavy, heavy;"
        # the memory chart loads Pillow when it is drawn: neither matplotlib (--plot's) nor numpy, no GPU stack
        "planner.outputs.render_files(plan); assert 'PIL.Image' in sys.modules;"
        "heavy = {'torch', 'accelerate', 'diffusers', 'numpy', 'matplotlib'} & set(sys.modules);"
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_communication_bound_plan_warns_why_and_how_to_fix_it(tmp_path, capsys):
    """2 x 8 H100 at global batch 256: micro-batch 16 per GPU, and the exposed inter-node gradient all-reduce
    outweighs its compute, so 2 nodes estimate fewer images/s than 1; the plan says why, in all three outputs."""
    # pinned to DDP: left to itself the planner shards here (zero2 sends bf16, and is estimated faster)
    two_nodes = ["--gpu", "h100-80g", "--gpus-per-node", "8", "--global-batch", "256", "--sharding", "ddp"]
    code, out, _ = run(
        two_nodes + ["--nodes", "2", "--main-process-ip", "10.0.0.1", "--out", str(tmp_path / "two")], capsys
    )
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["cluster"]["world_size"] == 16
    assert code == 0
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    t = plan["throughput"]
    share = t["exposed_comm_time_s"] / t["step_time_s"]
    assert share > 0.25
    [warning] = [w for w in plan["warnings"] if w.startswith("exposed communication")]
    assert f"{share:.0%} of the estimated step time" in warning
    assert f"{t['comm_bytes_per_gpu'] / 1e9:.2f} GB" in warning and "25 GB/s inter-node" in warning
    assert (
        "--global-batch" in warning
        and "--assume inter_node_busbw_bytes_per_s=" in warning
        and "50e9" in warning
    )
    assert f"! {warning}" in " ".join(out.split("\n  "))  # the terminal, wrapped to 100 columns
    assert warning in (tmp_path / "two" / "plan.md").read_text()

    # the warning's own fix: the real fabric's bandwidth halves the exposed share and raises the estimate
    run(
        two_nodes
        + [
            "--nodes",
            "2",
            "--main-process-ip",
            "10.0.0.1",
            "--assume",
            "inter_node_busbw_bytes_per_s=50e9",
            "--out",
            str(tmp_path / "ndr"),
        ],
        capsys,
    )
    ndr = json.loads((tmp_path / "ndr" / "plan.json").read_text())["throughput"]
    assert ndr["exposed_comm_time_s"] == pytest.approx(t["exposed_comm_time_s"] / 2)
    assert ndr["est_images_per_s"] > t["est_images_per_s"]

    one_node = json.loads(json.dumps(make_plan(gpu="h100-80g", gpus=8, global_batch=256)))
    assert one_node["throughput"]["est_images_per_s"] > t["est_images_per_s"]  # what the warning explains
    assert not [w for w in one_node["warnings"] if "exposed communication" in w]


def test_one_node_of_a100_40g_has_no_communication_warning(tmp_path, capsys):
    code, out, _ = run(
        ["--gpu", "a100-40g", "--gpus", "8", "--global-batch", "256", "--out", str(tmp_path)], capsys
    )
    plan = json.loads((tmp_path / "plan.json").read_text())
    t = plan["throughput"]
    assert code == 0 and 0 < t["exposed_comm_time_s"] / t["step_time_s"] <= 0.25
    assert "exposed communication" not in out and not any(
        "exposed communication" in w for w in plan["warnings"]
    )
    assert "exposed communication is" not in (tmp_path / "plan.md").read_text()


SHAPES = [
    (["--gpus", "8"], [(1, 8)]),  # the README's command: one node of 8
    (["--gpus", "4"], [(1, 4)]),
    (["--gpus", "16"], [(2, 8)]),  # more than a node holds: nodes of 8
    (["--gpus", "32", "--nodes", "4"], [(4, 8)]),
    (["--gpus", "8", "--nodes", "2"], [(2, 4)]),  # the total, as Accelerate's num_processes: 2 x 4
    (["--gpus-per-node", "4", "--nodes", "2"], [(2, 4)]),
    (["--gpus", "16", "--gpus-per-node", "4"], [(4, 4)]),
    (["--gpus", "16", "--gpus-per-node", "8", "--nodes", "2"], [(2, 8)]),
    (["--gpus", "8,16,32"], [(1, 8), (2, 8), (4, 8)]),  # a sweep over the total
]


@pytest.mark.parametrize("argv, shapes", SHAPES, ids=[" ".join(a) for a, _ in SHAPES])
def test_gpus_is_the_total_and_splits_into_nodes_of_8(argv, shapes):
    args, node_size = cli.parse(argv + ["--vram", "80G"])
    assert [(c["nodes"], c["gpus"]) for c in cli.combinations(args, node_size)] == shapes


def test_a_sweep_over_the_total_shows_nodes_x_gpus(capsys):
    code, out, _ = run(["--gpu", "h100-80g", "--gpus", "8,16", "--format", "json"], capsys)
    rows = json.loads(out)
    assert code == 0 and [(r["nodes"], r["gpus"], r["world_size"]) for r in rows] == [(1, 8, 8), (2, 8, 16)]
    assert out.endswith("]\n")
    code, out, _ = run(["--gpu", "h100-80g", "--gpus", "8,16"], capsys)
    assert "1 x 8" in out and "2 x 8" in out and "1 x 16" not in out


def test_version_comes_from_the_package_metadata_or_the_source(capsys, monkeypatch):
    import importlib.metadata
    import re

    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out == f"dit-plan (dit-accel) {importlib.metadata.version('dit-accel')}\n"
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    source = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out == f"dit-plan (dit-accel) {source}\n"


def test_counts_of_one_read_in_the_singular(tmp_path, capsys):
    """One GPU per node, one rank, one image per micro-batch: never "1 GPUs" or "1 processes"."""
    import re

    argv = ["--gpus-per-node", "1", "--nodes", "2", "--vram", "80G", "--global-batch", "2"]
    code, out, _ = run(argv + ["--host-ram", "8GiB", "--steps", "10", "--out", str(tmp_path)], capsys)
    assert code == 0
    text = out + "".join((tmp_path / name).read_text() for name in ("plan.md", "launch.slurm"))
    assert (
        "on 2 nodes x 1 GPU of" in text and "each starts 1 process." in text and "1 rank needs about" in text
    )
    assert not re.findall(r"\b1 (GPUs|nodes|ranks|processes|images)\b|node\(s\)", text)


def test_every_flag_has_help_that_says_its_default(capsys):
    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
        takes_value = action.nargs != 0 and action.dest != "help"
        if takes_value:  # what happens without it: the default, or "required" / "not shown" / ...
            assert "default" in action.help or "required" in action.help, action.option_strings
    with pytest.raises(SystemExit) as leaving:
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert leaving.value.code == 0 and "(default: auto)" in out and "(default: 5%)" in out
    assert (
        "zero3: FSDP2 shards" in out and "online: images encoded by the VAE" in out and "--list-gpus" in out
    )


def test_list_gpus_names_every_preset_with_its_memory(capsys):
    from planner.hardware import gpu_presets

    code, out, _ = run(["--list-gpus"], capsys)
    assert code == 0 and "h200       140.40 GiB" in out and "l40s       44.99 GiB" in out
    for name in gpu_presets():
        assert f"\n{name} " in out
    code, out, _ = run(["--list-gpus", "--format", "json"], capsys)
    assert {row["--gpu"] for row in json.loads(out)} == set(gpu_presets())


def test_the_no_tf32_advice_is_for_a_named_gpu_only(tmp_path, capsys):
    """`--precision fp32` on a plan made by --vram alone (the CPU tour's) told the user to train with
    --no-tf32, which a CPU has no use for; with a GPU named it still says so."""
    from planner.cli import main

    base = ["--gpus", "2", "--global-batch", "32", "--precision", "fp32", "--model", "DiT-S/2"]
    assert main([*base, "--vram", "8G", "--out", str(tmp_path / "cpu")]) == 0
    assert "--no-tf32" not in capsys.readouterr().out
    assert main([*base, "--gpu", "a100-80g", "--out", str(tmp_path / "gpu")]) == 0
    assert "train with --no-tf32" in capsys.readouterr().out
