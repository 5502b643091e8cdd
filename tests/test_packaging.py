"""The package as a user installs it: `python -m build` makes an sdist and a wheel (from the sdist), the wheel
installs into a fresh venv, and its `dit-plan` and `dit-accel --version` run from there, with the cluster
presets and training recipes it ships found by name from a folder without configs/.

The fresh venv sees this venv's site-packages through a .pth file placed after its own, so torch and the
other dependencies are not downloaded again; the test asserts that `planner` and `dit_accel` are the
fresh venv's copies, not this checkout's. No network: the build runs without isolation.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "planner", "dit_accel", "configs")


def _run(*command, cwd) -> subprocess.CompletedProcess:
    """In `cwd`, away from the checkout: `python -c` puts its working folder first on sys.path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.launched
def test_the_wheel_installs_into_a_fresh_venv_and_runs_dit_plan(tmp_path):
    source = tmp_path / "src"  # a copy: the build's own folders never land in the working tree
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp_path / "dist", source, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("dit_accel-*.whl"))
    sdist = next((tmp_path / "dist").glob("dit_accel-*.tar.gz"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = [f"planner/clusters/{p.name}" for p in (ROOT / "configs" / "clusters").glob("*.yaml")]
    shipped += [f"dit_accel/recipes/{p.name}" for p in (ROOT / "configs" / "recipes").glob("*.yaml")]
    for expected in ("planner/presets/gpus.yaml", "planner/cli.py", "dit_accel/cli.py", *shipped):
        assert expected in names, expected
    assert not any("make_readme" in name for name in names)  # configs/' script stays in the repository
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    metadata = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    )
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Dist: tensorboard" in metadata
    assert 'Requires-Dist: wandb>=0.17; extra == "wandb"' in metadata
    members = tarfile.open(sdist).getnames()
    top = members[0].split("/")[0]
    assert f"{top}/LICENSE" in members and f"{top}/planner/presets/gpus.yaml" in members
    assert f"{top}/configs/clusters/h100-80g-8x.yaml" in members
    assert f"{top}/configs/recipes/dit-xl2-256.yaml" in members

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        wheel,
        cwd=tmp_path,
    )
    own = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).stdout.strip()
    )
    (own / "zz_parent_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run(
        python,
        "-c",
        "import planner, dit_accel; print(planner.__file__); print(dit_accel.__file__)",
        cwd=tmp_path,
    )
    planner_file, dit_accel_file = map(Path, where.stdout.split())
    assert planner_file.is_relative_to(own) and dit_accel_file.is_relative_to(own), where.stdout
    plan = _run(
        venv / "bin" / "dit-plan", "--gpus", "8", "--vram", "40G", "--global-batch", "256", cwd=tmp_path
    )
    assert "DiT-XL/2 @ 256 px (674,834,720 params)" in plan.stdout and "Decision" in plan.stdout
    presets = _run(
        venv / "bin" / "dit-plan",
        "--gpu",
        "h100-80g",
        "--gpus",
        "8",
        "--global-batch",
        "256",
        "--format",
        "json",
        cwd=tmp_path,
    )
    assert '"h100' in presets.stdout.lower()
    version = _run(venv / "bin" / "dit-accel", "--version", cwd=tmp_path)
    assert version.stdout.strip() == "dit-accel 0.1.0"

    elsewhere = tmp_path / "elsewhere"  # a user's folder: no configs/ in it or above it
    elsewhere.mkdir()
    preset = _run(venv / "bin" / "dit-plan", "--config", "h100-80g-8x", "--format", "json", cwd=elsewhere)
    plan = json.loads(preset.stdout)
    assert (plan["cluster"]["gpu"], plan["cluster"]["world_size"]) == ("h100-80g", 8)
    listed = _run(venv / "bin" / "dit-plan", "--list-configs", cwd=elsewhere).stdout
    assert "h100-80g-8x " in listed and "h200-8x " in listed
    recipe = _run(
        python,
        "-c",
        "from dit_accel.train.recipe import recipe_file; from dit_accel.train.flags import parse_config;"
        "print(recipe_file('dit-xl2-256')); print(parse_config(['--plan', 'p.json', '--latents', 'l',"
        " '--output-dir', 'r', '--config', 'dit-xl2-256']).max_steps)",
        cwd=elsewhere,
    )
    recipe_path, steps = recipe.stdout.split()
    assert Path(recipe_path).is_relative_to(own / "dit_accel" / "recipes") and steps == "400000"
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # a document format writes nothing


def test_the_wheel_lists_every_package_of_the_source_tree():
    """pyproject.toml lists its packages (two are configs/ folders mapped in): a new subpackage needs its line."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for package in ("planner", "dit_accel")
        for path in (ROOT / package).rglob("*.py")
    }
    mapped = set(setuptools["package-dir"])
    assert set(setuptools["packages"]) == found | mapped
    for name, folder in setuptools["package-dir"].items():
        assert list((ROOT / folder).glob("*.yaml")) and not list((ROOT / folder).glob("*.py")), name


def test_version_is_the_installed_metadata(capsys):
    from importlib.metadata import version

    from dit_accel.cli import main, usage

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dit-accel {version('dit-accel')}"
    assert "--version" in usage()
