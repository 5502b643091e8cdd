"""The SLURM script dit-plan writes, run by bash against fake `srun` and `scontrol` (tiny shell scripts on
PATH): the placeholders, the data flags of each plan mode, the signal forwarding and the requeue on exit 4."""

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from planner.slurm import PLACEHOLDERS, slurm_script


def _plan(latents: str = "precomputed", nodes: int = 2) -> dict:
    return {
        "cluster": {"nodes": nodes, "gpus_per_node": 8, "world_size": 8 * nodes, "main_process_port": 29500},
        "model": {"name": "DiT-XL/2", "resolution": 256},
        "decision": {"latents": latents},
    }


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fakes(tmp_path):
    """A plan folder with its script, and fake srun/scontrol that log their calls to tmp_path/calls."""
    bin_dir, plan_dir = tmp_path / "bin", tmp_path / "plan"
    bin_dir.mkdir()
    plan_dir.mkdir()
    script = _write(plan_dir, "launch.slurm", slurm_script(_plan()))
    calls = tmp_path / "calls"
    # srun: tell the test it started; on USR1, record it and exit like preempted ranks (4, or $SRUN_USR1_EXIT);
    # else exit $SRUN_EXIT, after writing the exit record $SRUN_RECORD (a rank's code) if asked.
    _write(
        bin_dir,
        "srun",
        """#!/bin/bash
trap 'echo "srun got USR1" >> "$CALLS"; exit "${SRUN_USR1_EXIT:-4}"' USR1
echo "srun $1" >> "$CALLS"
[ -n "${SRUN_RECORD:-}" ] && echo "{\\"rank\\": 0, \\"code\\": $SRUN_RECORD}" > "$DIT_ACCEL_EXIT_DIR/exit_rank0.json"
if [ -n "${SRUN_WAIT:-}" ]; then touch "$SRUN_WAIT"; for i in $(seq 600); do sleep 0.05; done; fi
exit "${SRUN_EXIT:-0}"
""",
    )
    _write(
        bin_dir,
        "scontrol",
        """#!/bin/bash
if [ "$1" = show ]; then echo node-0; echo node-1; else echo "scontrol $*" >> "$CALLS"; fi
""",
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        CALLS=str(calls),
        SLURM_SUBMIT_DIR=str(plan_dir),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node-[0-1]",
    )
    return {"script": script, "env": env, "calls": calls, "tmp": tmp_path}


def _calls(fakes) -> list[str]:
    return fakes["calls"].read_text().splitlines() if fakes["calls"].exists() else []


@pytest.mark.parametrize(
    "mode, flag",
    [("precomputed", "--latents /data/latents256"), ("online", "--data-path"), ("pixel", "--data-path")],
)
def test_the_script_parses_marks_its_placeholders_and_shows_the_plans_data_flag(mode, flag, tmp_path):
    for nodes in (1, 2):
        script = _write(tmp_path, f"{mode}{nodes}.slurm", slurm_script(_plan(mode, nodes)))
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
        text = script.read_text()
        sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH ")]
        for option, placeholder in zip(("--partition", "--time", "--cpus-per-task"), PLACEHOLDERS):
            assert f"#SBATCH {option}={placeholder}" in sbatch
        assert "#SBATCH --signal=B:USR1@300" in sbatch and "#SBATCH --requeue" in sbatch
        example = next(line for line in text.splitlines() if line.startswith("# Submit"))
        assert flag in example
        assert ("--data-path" in example) == (mode != "precomputed")
        assert ("--vae" in example) == (mode == "online")
        assert "--resume auto" in text


@pytest.mark.parametrize(
    "srun_exit, record, requeued, code",
    [(4, None, True, 0), (0, None, False, 0), (2, None, False, 2), (1, 4, True, 0), (1, 3, False, 1)],
)
def test_exit_4_requeues_the_job_and_nothing_else_does(fakes, srun_exit, record, requeued, code):
    """4 from the step, or (plain accelerate launch reports 1) from a rank's exit record."""
    env = dict(fakes["env"], SRUN_EXIT=str(srun_exit))
    if record is not None:
        env["SRUN_RECORD"] = str(record)
    result = subprocess.run(["bash", str(fakes["script"]), "--latents", "/x"], env=env, capture_output=True)
    assert result.returncode == code, result.stderr
    assert ("scontrol requeue 4242" in _calls(fakes)) == requeued
    assert _calls(fakes)[0] == "srun --ntasks=2"


@pytest.mark.parametrize(
    "step_exit, record, requeued",
    [("4", None, True), ("1", None, True), ("1", "2", False), ("1", "5", False), ("0", None, False)],
)
def test_usr1_to_the_batch_shell_reaches_the_step_and_requeues(fakes, step_exit, record, requeued):
    """A step the signal ended requeues when it exits 4, and also when it fails before any rank recorded a
    code (preempted while the launcher or the ranks were starting: plain accelerate launch says 1); not when
    a rank recorded bad input or a hang, nor when the step still ended well."""
    started = fakes["tmp"] / "started"
    env = dict(fakes["env"], SRUN_WAIT=str(started), SRUN_USR1_EXIT=step_exit)
    if record is not None:
        env["SRUN_RECORD"] = record
    shell = subprocess.Popen(["bash", str(fakes["script"])], env=env)
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started.exists()
    os.kill(shell.pid, signal.SIGUSR1)  # what `--signal=B:USR1@300` does
    assert shell.wait(timeout=20) == (0 if requeued else int(step_exit))
    assert _calls(fakes)[1:] == ["srun got USR1"] + ["scontrol requeue 4242"] * requeued
