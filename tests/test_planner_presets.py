"""Cluster presets (`dit-plan --config FILE`) and configs/README.md, the table that re-plans every one."""

import importlib.util
import json
from pathlib import Path

import pytest

from planner import cli
from planner.plan import make_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = sorted((CONFIGS / "clusters").glob("*.yaml"))

# what each preset must plan: (nodes, GPUs per node, GPU, resolution, global batch)
EXPECTED = {
    "rtx4090-1x": (1, 1, "rtx4090", 256, 256),
    "rtx4090-1x-512": (1, 1, "rtx4090", 512, 256),
    "a100-40g-8x": (1, 8, "a100-40g", 256, 256),
    "a100-40g-8x-512": (1, 8, "a100-40g", 512, 256),
    "a100-80g-8x": (1, 8, "a100-80g", 256, 256),
    "a100-80g-8x-512": (1, 8, "a100-80g", 512, 256),
    "h100-80g-8x": (1, 8, "h100-80g", 256, 256),
    "h100-80g-8x-512": (1, 8, "h100-80g", 512, 256),
    "h100-80g-2x8-ib": (2, 8, "h100-80g", 256, 256),
    "h200-4x8": (4, 8, "h200", 256, 1024),
    "h200-4x8-512": (4, 8, "h200", 512, 1024),
    "h200-8x": (1, 8, "h200", 256, 256),
    "a100-80g-2x8-ib": (2, 8, "a100-80g", 256, 256),
    "l40s-8x": (1, 8, "l40s", 256, 256),
    "h100-pcie-8x": (1, 8, "h100-pcie", 256, 256),
}


def _make_readme():
    spec = importlib.util.spec_from_file_location("make_readme", CONFIGS / "make_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(argv: list[str]) -> dict:
    _, [combo], kwargs = cli.plan_arguments(argv)
    return make_plan(**combo, **kwargs)


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_every_preset_has_its_expected_cluster():
    assert sorted(p.stem for p in PRESETS) == sorted(EXPECTED)  # a new preset needs its row here
    for path in PRESETS:
        plan = _plan(["--config", str(path)])
        c = plan["cluster"]
        got = (c["nodes"], c["gpus_per_node"], c["gpu"], plan["model"]["resolution"], plan["global_batch"])
        assert got == EXPECTED[path.stem], path.name


def test_configs_readme_is_up_to_date():
    """Re-plans every preset and lists every recipe: regenerate with `python configs/make_readme.py`."""
    text = _make_readme().readme_text()
    assert (CONFIGS / "README.md").read_text() == text, "run: python configs/make_readme.py"
    for path in PRESETS:
        assert f"[{path.stem}](clusters/{path.name})" in text and "cannot be planned" not in text
    for path in sorted((CONFIGS / "recipes").glob("*.yaml")):
        assert f"[{path.stem}](recipes/{path.name})" in text


def test_the_readme_lists_whatever_recipes_exist(tmp_path):
    make_readme = _make_readme()
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "one.yaml").write_text("gpu: a100-80g\ngpus: 8\n")
    (tmp_path / "recipes").mkdir()
    assert "None yet." in make_readme.readme_text(tmp_path)
    (tmp_path / "recipes" / "short.yaml").write_text(
        "description: a short test run\nmax-steps: 10\nlr: 1.0e-4\n"
    )
    text = make_readme.readme_text(tmp_path)
    assert "| [short](recipes/short.yaml) | a short test run" in text.replace("  ", " ").replace("  ", " ")
    assert "`max-steps: 10`" in text and "None yet." not in text
    assert "400,000 steps" in text and "1 x 8 a100-80g" in text


def test_flags_on_the_command_line_override_the_file(tmp_path, capsys):
    ib = str(CONFIGS / "clusters" / "h100-80g-2x8-ib.yaml")
    plan = _plan(["--config", ib])
    assert plan["assumptions"]["inter_node_busbw_bytes_per_s"] == 50e9  # the file's fabric
    plan = _plan(["--config", ib, "--global-batch", "512", "--assume", "inter_node_busbw_bytes_per_s=25e9"])
    assert plan["global_batch"] == 512 and plan["assumptions"]["inter_node_busbw_bytes_per_s"] == 25e9
    # any shape flag replaces the file's whole shape
    plan = _plan(
        ["--config", str(CONFIGS / "clusters" / "h200-4x8.yaml"), "--gpus", "8", "--global-batch", "256"]
    )
    assert (plan["cluster"]["nodes"], plan["cluster"]["gpus_per_node"]) == (1, 8)
    code, out, err = run(["--config", ib, "--out", str(tmp_path / "p")], capsys)
    assert code == 0, err
    written = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert written["cluster"]["world_size"] == 16 and (tmp_path / "p" / "launch.slurm").exists()
    assert f"--config {ib}" in (tmp_path / "p" / "plan.md").read_text()  # the exact command line


def test_a_global_batch_above_the_recipes_says_what_it_does_to_the_lr():
    """The recipes keep lr 1e-4 (scale-lr: false); a preset at another global batch must say so, and count
    its steps over the same images as the paper's 400K x 256."""
    import yaml

    for path in PRESETS:
        data = yaml.safe_load(path.read_text())
        if data.get("global_batch", 256) != 256:
            assert "not scaled" in data["description"] and "--scale-lr" in path.read_text(), path.name
            assert data["steps"] * data["global_batch"] == 400_000 * 256, path.name


def test_a_preset_says_how_many_gpus_its_nodes_hold(tmp_path):
    preset = tmp_path / "quad.yaml"
    preset.write_text("gpu: l40s\ngpus_per_node: 4\nnodes: 1\nglobal_batch: 256\n")
    plan = _plan(["--config", str(preset), "--gpus", "16"])  # split into the preset's nodes of 4
    assert (plan["cluster"]["nodes"], plan["cluster"]["gpus_per_node"]) == (4, 4)


BAD_FILES = [
    ("gpu: a100-80g\ngpus: 8\nwarp: 9\n", "warp is not a dit-plan flag"),
    ("gpu: a100-80g\ngpus: 8\nout: plan\n", "out is not a dit-plan flag"),
    ("gpu: a100-80g\ngpus: 8\nprecision: bf17\n", "precision must be one of"),
    ("gpu: a100-80g\ngpus: 0\n", "--gpus must be positive"),
    ("gpu: a100-80g\ngpus: 12\n", "does not split into nodes of 8"),
    ("gpu: a100-80g\ngpus: 8\nema: maybe\n", "ema must be true or false"),
    ("gpu: a100-80g\ngpus: 8\nassume: 3\n", "assume must be a mapping"),
    ("gpu: a100-80g\ngpus: 8\nassume:\n  warp: 1\n", "--assume 'warp=1'"),
    ("gpu: a100-80g\ngpus: {a: 1}\n", "gpus must be a single value"),
    ("vram: 40\ngpus: 8\n", "no unit"),
    ("gpu: a100-80g\ngpus: 8\ncheckpointing: some\n", "--checkpointing must be"),
    ("- gpu\n- a100\n", "holds no `flag: value` mapping"),
    ("gpu: [a100\n", "is not valid YAML"),
]


@pytest.mark.parametrize("text, fragment", BAD_FILES, ids=[f for _, f in BAD_FILES])
def test_a_bad_preset_is_one_line_naming_the_file_exit_2_no_files(
    tmp_path, capsys, monkeypatch, text, fragment
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(text)
    code, out, err = run(["--config", "bad.yaml"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("dit-plan: error: --config bad.yaml") and fragment in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_a_missing_preset_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["--config", "nowhere.yaml"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--config nowhere.yaml: no such file" in err
    assert list(tmp_path.iterdir()) == []


def test_a_shipped_preset_plans_by_name_from_any_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    by_path = _plan(["--config", str(CONFIGS / "clusters" / "h100-80g-8x.yaml")])
    assert _plan(["--config", "h100-80g-8x"]) == by_path == _plan(["--config", "h100-80g-8x.yaml"])
    # the path the docs show, from a folder without it: the same file ships by name
    code, out, err = run(["--config", "configs/clusters/h100-80g-8x.yaml"], capsys)
    assert (
        code == 2
        and err.count("\n") == 1
        and "the shipped cluster preset of that name is --config h100-80g-8x" in err
    )
    code, out, err = run(["--config", "h100-80g-9x"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--config h100-80g-9x: no cluster preset of that name" in err
    assert all(path.stem in err for path in PRESETS) and "dit-plan --list-configs" in err
    assert list(tmp_path.iterdir()) == []
    code, out, _ = run(["--list-configs"], capsys)
    assert code == 0 and all(f"\n{path.stem} " in out for path in PRESETS)
    assert "h100-80g-2x8-ib  2 x 8" in out and "rtx4090-1x       1 GPU " in out
