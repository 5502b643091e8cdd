"""`dit-accel doctor --log`: failed-run logs composed here in the formats torchrun / accelerate launch
print (torch.distributed.elastic's ChildFailedError table, PyTorch's CUDA OOM and NCCL watchdog
messages), and what the doctor makes of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ports import launch_port

from dit_accel.doctor import run
from dit_accel.doctor.checks import Status
from dit_accel.doctor.logs import diagnose, last_exception_line, parse_failures
from dit_accel.doctor.plan import load_plan
from planner.plan import make_plan

LAUNCHER_TRACEBACK = """Traceback (most recent call last):
  File "/opt/conda/bin/accelerate", line 8, in <module>
    sys.exit(main())
  File "/opt/conda/lib/python3.11/site-packages/accelerate/commands/launch.py", line 1190, in launch_command
    multi_gpu_launcher(args)
  File "/opt/conda/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 284, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: """


def failure_entry(
    index,
    rank,
    exitcode,
    pid,
    host="gpu-node-07.cluster.local",
    time="2026-03-02_10:14:05",
    traceback=None,
    signal_suffix=True,
):
    import signal

    suffix = f" ({signal.Signals(-exitcode).name})" if exitcode < 0 and signal_suffix else ""
    if traceback is None:
        traceback = (
            f"Signal {-exitcode} ({signal.Signals(-exitcode).name}) received by PID {pid}"
            if exitcode < 0
            else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        )
    return (
        f"[{index}]:\n  time      : {time}\n  host      : {host}\n  rank      : {rank} (local_rank: {rank % 8})\n"
        f"  exitcode  : {exitcode} (pid: {pid}){suffix}\n  error_file: <N/A>\n  traceback : {traceback}"
    )


def failure_block(root: str, others: list[str] = ()) -> str:
    rule, line = "=" * 56, "-" * 56
    other_text = "\n".join(others) if others else "  <NO_OTHER_FAILURES>"
    return (
        f"{LAUNCHER_TRACEBACK}\n{rule}\ndit_accel.train FAILED\n{line}\nFailures:\n{other_text}\n{line}\n"
        f"Root Cause (first observed failure):\n{root}\n{rule}\n"
    )


PREAMBLE = """The following values were not passed to `accelerate launch` and had defaults used instead:
\t`--dynamo_backend` was set to a value of `'no'`
2026-03-02 10:13:40,112 rank0 INFO DiT-XL/2: 674834720 parameters; world size 8
W0302 10:14:05.903000 88121 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 88124 closing signal SIGTERM
W0302 10:14:05.904000 88121 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 88125 closing signal SIGTERM
E0302 10:14:06.532000 88121 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -9) local_rank: 3 (pid: 88127) of binary: /opt/conda/bin/python
"""

SIGKILL_LOG = PREAMBLE + failure_block(failure_entry(0, 3, -9, 88127))


XL_PLAN = make_plan(gpus=8, vram="40G", global_batch=256)  # DiT-XL/2 on 8 x 40 GB, by the real planner


def write(tmp_path: Path, text: str, name="launch.log") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_parses_the_torchrun_sigkill_block():
    [failure] = parse_failures(SIGKILL_LOG)
    assert (failure.rank, failure.local_rank, failure.exitcode, failure.pid) == (3, 3, -9, 88127)
    assert failure.host == "gpu-node-07.cluster.local" and failure.time == "2026-03-02_10:14:05"
    assert failure.root_cause and failure.signal_name == "SIGKILL"


def test_exitcode_9_names_the_oom_killer_the_plan_estimate_and_the_fixes(tmp_path):
    plan = load_plan(write(tmp_path, json.dumps(XL_PLAN), "plan.json"))
    checks = diagnose(SIGKILL_LOG, plan, tmp_path / "runs" / "xl2")
    assert (
        checks[0].name == "failed ranks"
        and "rank 3 (local_rank 3, pid 88127) on gpu-node-07" in checks[0].reason
    )
    [kill] = [c for c in checks if c.name == "exitcode -9 (SIGKILL)"]
    assert kill.status is Status.FAIL
    estimate = f"{XL_PLAN['host']['per_node_bytes'] / 2**30:.1f} GiB of host RAM per node"
    for expected in (
        "OOM killer",
        "scheduler",
        "dmesg",
        "journalctl -k",
        "pid 88127",
        estimate,
        str(tmp_path / "runs" / "xl2" / "logs" / "rank3.log"),
    ):
        assert expected in kill.reason, expected
    for fix in (
        "fewer data-loader workers",
        "precomputed latents",
        "loading weights once per node",
        "more host RAM",
    ):
        assert fix in kill.fix


def test_older_torch_format_prefixed_lines_several_failures_and_kernel_evidence():
    others = [
        failure_entry(1, 5, -6, 90211, host="gpu-node-08", time="2026-03-02_10:24:01", signal_suffix=False)
    ]
    root = failure_entry(0, 2, -9, 90100, host="gpu-node-08", time="2026-03-02_10:14:05", signal_suffix=False)
    kernel = "[Mon Mar  2 10:14:05 2026] Out of memory: Killed process 90100 (python) total-vm:91234567kB, anon-rss:60123456kB\n"
    text = (
        "\n".join("[rank2]: " + line for line in "hello\nworld".splitlines())
        + "\n"
        + kernel
        + failure_block(root, others)
    )
    failures = parse_failures(text)
    assert [(f.rank, f.exitcode, f.root_cause) for f in failures] == [(2, -9, True), (5, -6, False)]
    checks = diagnose(text)
    assert "also failed: rank 5 on gpu-node-08 (exitcode -6, SIGABRT)" in checks[0].reason
    kill = next(c for c in checks if c.name.startswith("exitcode -9"))
    assert "confirms it: the OOM killer killed pid 90100" in kill.reason
    assert any(c.name == "exitcode -6 (SIGABRT)" for c in checks)


CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.25 GiB. GPU 1 has a total capacity of "
    "39.38 GiB of which 1.91 GiB is free. Process 5521 has 37.46 GiB memory in use. Of the allocated memory "
    "35.12 GiB is allocated by PyTorch, and 1.71 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
RANK_TRACEBACK = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/dit_accel/train/loop.py", line 712, in train
[rank1]:     loss = train_micro_step(components, batch, loss_multiplier)
[rank1]:   File "/opt/conda/lib/python3.11/site-packages/torch/_tensor.py", line 648, in backward
[rank1]:     torch.autograd.backward(
[rank1]: {error}
"""


def test_cuda_oom_at_step_1_says_replan(tmp_path):
    text = PREAMBLE + RANK_TRACEBACK.format(error=CUDA_OOM) + failure_block(failure_entry(0, 1, 1, 77001))
    checks = diagnose(text)
    [oom] = [c for c in checks if c.name.startswith("CUDA out of memory")]
    assert oom.name == "CUDA out of memory at step 1" and oom.status is Status.FAIL
    assert "tried to allocate 2.25 GiB on GPU 1 (39.38 GiB total, 1.91 GiB free)" in oom.reason
    assert "pid 5521 (37.46 GiB)" in oom.reason
    assert (
        "dit-plan --vram" in oom.fix and "--max-micro-batch" in oom.fix and "checkpointed blocks" in oom.fix
    )
    assert not any(c.name == "exitcode 1" for c in checks)  # the OOM row already explains the exit


def test_cuda_oom_after_steps_points_at_fragmentation(tmp_path):
    steps = "".join(
        f"2026-03-02 11:{m:02d}:00,000 rank0 INFO step {m * 100}/400000 | loss 0.1500 | lr 0.0001\n"
        for m in range(1, 4)
    )
    checks = diagnose(
        steps + RANK_TRACEBACK.format(error=CUDA_OOM) + failure_block(failure_entry(0, 1, 1, 77001))
    )
    [oom] = [c for c in checks if c.name.startswith("CUDA out of memory")]
    assert (
        oom.name == "CUDA out of memory"
        and "after step 300" in oom.reason
        and "expandable_segments" in oom.fix
    )


NCCL_TIMEOUT = """[rank2]:[E302 11:02:13.441207 ProcessGroupNCCL.cpp:632] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1843, OpType=ALLREDUCE, NumelIn=674834720, NumelOut=674834720, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.
[rank2]:[E302 11:02:13.452139 ProcessGroupNCCL.cpp:667] [Rank 2] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank6]:[E302 11:02:14.011532 ProcessGroupNCCL.cpp:1702] [PG ID 0 PG GUID 0(default_pg) Rank 6] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1843, OpType=ALLREDUCE, NumelIn=674834720, NumelOut=674834720, Timeout(ms)=600000) ran for 600877 milliseconds before timing out.
terminate called after throwing an instance of 'c10::DistBackendError'
"""


def test_nccl_timeout_points_at_the_first_failing_rank():
    text = NCCL_TIMEOUT + failure_block(failure_entry(0, 2, -6, 66002), [failure_entry(1, 6, -6, 66006)])
    checks = diagnose(text)
    [nccl] = [c for c in checks if c.name == "NCCL timeout"]
    assert "ranks 2, 6 waited 600 s in ALLREDUCE (collective #1843)" in nccl.reason
    assert (
        "first rank that failed" in nccl.fix
        and "NCCL_DEBUG=INFO" in nccl.fix
        and "NCCL_SOCKET_IFNAME" in nccl.fix
    )
    abort = next(c for c in checks if c.name == "exitcode -6 (SIGABRT)")
    assert "watchdog aborted the process" in abort.reason


def test_missing_data_path():
    error = "FileNotFoundError: [Errno 2] No such file or directory: '/data/imagenet/train/n01440764'"
    checks = diagnose(RANK_TRACEBACK.format(error=error) + failure_block(failure_entry(0, 0, 1, 1234)))
    [missing] = [c for c in checks if c.name == "path not found"]
    assert "/data/imagenet/train/n01440764 does not exist" in missing.reason
    assert "every node" in missing.fix and "--data-path" in missing.fix


def test_exitcode_1_shows_the_ranks_exception_not_the_launchers():
    error = "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
    text = RANK_TRACEBACK.format(error=error) + failure_block(failure_entry(0, 1, 1, 4321))
    assert last_exception_line(text) == error
    [row] = [c for c in diagnose(text) if c.name == "exitcode 1"]
    assert error in row.reason and "rank 1 (local_rank 1, pid 4321)" in row.reason


def test_exitcode_2_is_dit_accel_refusing_its_input():
    text = (
        "dit_accel.train: error: the plan trains on precomputed latents: pass --latents DIR\n"
        + failure_block(failure_entry(0, 0, 2, 999))
    )
    [row] = [c for c in diagnose(text) if c.name == "exitcode 2"]
    assert "refused its input: dit_accel.train: error: the plan trains on precomputed latents" in row.reason


@pytest.mark.parametrize(
    "exitcode, name, words",
    [
        (-11, "exitcode -11 (SIGSEGV)", ("native code", "PYTHONFAULTHANDLER=1")),
        (-6, "exitcode -6 (SIGABRT)", ("c10::Error", "CUDA_LAUNCH_BLOCKING=1")),
        (-7, "exitcode -7 (SIGBUS)", ("/dev/shm", "--shm-size")),
    ],
)
def test_signals(exitcode, name, words):
    [row] = [c for c in diagnose(failure_block(failure_entry(0, 4, exitcode, 5150))) if c.name == name]
    text = row.reason + " " + row.fix
    assert "rank 4 (local_rank 4, pid 5150)" in row.reason and all(word in text for word in words)


def test_single_process_accelerate_launch_dies_without_a_table():
    text = (
        'Traceback (most recent call last):\n  File "/opt/conda/bin/accelerate", line 8, in <module>\n'
        "subprocess.CalledProcessError: Command '['/opt/conda/bin/python', '-m', 'dit_accel.train']' died with <Signals.SIGKILL: 9>.\n"
    )
    checks = diagnose(text)
    assert any(c.name == "exitcode -9 (SIGKILL)" for c in checks)
    assert last_exception_line(text) is None  # the launcher's exception is not the rank's


def test_the_command_reads_a_log_and_the_per_rank_logs(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "xl2"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank1.log").write_text(
        "2026-03-02 11:01:00,000 rank1 INFO step 500/400000 | loss 0.15\n"
    )
    log = write(
        tmp_path, RANK_TRACEBACK.format(error=CUDA_OOM) + failure_block(failure_entry(0, 1, 1, 77001))
    )
    assert run(["--log", str(log), "--output-dir", str(run_dir), "--format", "json"]) == 2
    report = json.loads(capsys.readouterr().out)
    names = [row["name"] for row in report["checks"]]
    assert "CUDA out of memory" in names  # after step 500, read from rank1.log
    clean = write(
        tmp_path,
        "2026-03-02 11:01:00,000 rank0 INFO step 100/100 | loss 0.15\n2026-03-02 rank0 INFO done\n",
        "ok.log",
    )
    assert run(["--log", str(clean)]) == 0
    assert "no failure found" in capsys.readouterr().out
    unknown = write(
        tmp_path,
        "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'latent'\n",
        "odd.log",
    )
    assert run(["--log", str(unknown)]) == 0
    capsys.readouterr()
    assert run(["--log", str(unknown), "--strict", "--format", "json"]) == 1
    [row] = json.loads(capsys.readouterr().out)["checks"]
    assert row["status"] == "WARN" and "KeyError: 'latent'" in row["reason"]


def test_the_table_fits_the_terminal(tmp_path, capsys, monkeypatch):
    log = write(tmp_path, SIGKILL_LOG)
    for columns in (100, 160):
        monkeypatch.setenv("COLUMNS", str(columns))
        assert run(["--log", str(log)]) == 2
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= columns and "exitcode -9" in "".join(lines)


def test_an_unreadable_log_is_one_line_and_exit_2(tmp_path, capsys):
    from dit_accel.doctor import main

    assert main(["--log", str(tmp_path / "missing.log")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read --log" in err


DYING_RANK = """import os, signal, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} pid {os.getpid()}", flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
time.sleep(120)
"""


@pytest.mark.launched
def test_a_real_accelerate_launch_killed_by_sigkill(tmp_path, capsys):
    """The real launcher's failure block (this torch's format), not a composed one."""
    import os
    import re
    import subprocess
    import sys

    from planner.outputs import write_plan_dir

    write_plan_dir(
        make_plan(
            gpus=2,
            vram="8G",
            global_batch=8,
            model="DiT-S/2",
            depth=2,
            hidden=32,
            heads=2,
            resolution=32,
            num_classes=3,
        ),
        tmp_path / "plan",
    )
    (tmp_path / "die.py").write_text(DYING_RANK)
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(tmp_path / "plan" / "accelerate_config.yaml"),
            "--main_process_port",
            launch_port(),
            str(tmp_path / "die.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert launch.returncode != 0
    log = write(tmp_path, launch.stdout + launch.stderr)
    killed_pid = int(re.search(r"rank 1 pid (\d+)", log.read_text())[1])
    assert run(["--log", str(log), "--plan", str(tmp_path / "plan" / "plan.json"), "--format", "json"]) == 2
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["checks"]}
    assert f"root cause rank 1 (local_rank 1, pid {killed_pid})" in rows["failed ranks"]["reason"]
    assert (
        "rank 0" in rows["failed ranks"]["reason"]
        and "SIGTERM: stopped by the launcher" in rows["failed ranks"]["reason"]
    )
    assert (
        "OOM killer" in rows["exitcode -9 (SIGKILL)"]["reason"]
        and "of host RAM per node" in rows["exitcode -9 (SIGKILL)"]["reason"]
    )


# --- the run's own stops, and what stopped it from outside ---------------------------------------------

LOGS = Path(__file__).parent / "logs"  # real `accelerate launch` output (2 processes over gloo on a CPU)


def test_a_raw_enospc_wins_over_the_gloo_error_of_the_other_rank():
    """Real log: rank 1 raised OSError ENOSPC, rank 0 then lost its peer in a gloo barrier."""
    text = (LOGS / "launch_gloo_enospc.log").read_text()
    assert "Connection closed by peer" in text and last_exception_line(text).startswith("RuntimeError: [")
    checks = diagnose(text)
    assert [c.name for c in checks] == ["failed ranks", "disk full"]
    assert "OSError: [Errno 28] No space left on device" in checks[1].reason
    assert "--resume auto" in checks[1].fix and "gloo" not in checks[1].fix
    assert not any("Connection closed" in c.reason for c in checks)


def test_the_trainers_enospc_line_is_the_reason_and_nccl_errors_are_its_consequence():
    line = (
        "dit_accel.train: error: no space left on /scratch while saving checkpoint step_5000: needs about "
        "12.4 GiB, 3.1 GiB free; free space or lower --keep-last, then resume with --resume auto"
    )
    timeout = (
        "[rank0]:[E302 10:24:07.000000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=9001, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=600000) ran for "
        "600043 milliseconds before timing out.\n"
    )
    text = f"[rank1]: {line}\n{timeout}" + failure_block(
        failure_entry(0, 0, -6, 4000), [failure_entry(1, 1, 2, 4001)]
    )
    checks = diagnose(text)
    assert checks[1].name == "disk full" and line in checks[1].reason
    nccl = [c for c in checks if c.name == "NCCL timeout"]
    assert nccl and "consequence of the first row" in nccl[0].reason
    assert not any(c.name.startswith("exitcode -6") for c in checks)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_the_trainers_preemption_line_says_requeue_and_resume(signal_name):
    line = (
        f"dit_accel.train: preempted by {signal_name} at step 41000: saved checkpoint "
        f"runs/xl2/checkpoints/step_0041000; exit 4 (requeue and resume with --resume auto)"
    )
    text = f"[rank0]: {line}\n" + failure_block(failure_entry(0, 0, 4, 71), [failure_entry(1, 1, 4, 72)])
    checks = diagnose(text)
    assert checks[1].name == f"preempted ({signal_name})"
    assert "step 41000" in checks[1].reason and "runs/xl2/checkpoints/step_0041000" in checks[1].reason
    assert "--resume auto" in checks[1].fix and "requeue" in checks[1].fix
    assert [c.name for c in checks] == ["failed ranks", f"preempted ({signal_name})"]


def test_the_launchers_own_sigterm_real_and_newer_format():
    real = (
        LOGS / "launch_sigterm.log"
    ).read_text()  # torch 2.x: 'Received 15 death signal' + SignalException
    newer = (
        "W0302 10:14:05.123000 140 torch/distributed/elastic/agent/server/api.py:704] Received "
        "Signals.SIGTERM death signal, shutting down workers\n"
    )
    for text in (real, newer):
        [row] = diagnose(text)
        assert row.name == "launcher stopped by SIGTERM" and "--resume auto" in row.fix, row
    assert last_exception_line(real) is None  # the launcher's SignalException is not a rank's exception


def test_the_trainers_nan_stop():
    line = (
        "non-finite loss or gradient at step 731 (loss nan, grad norm inf); the step was not applied and the "
        "run stopped; lower --lr or set --grad-clip, or pass --nan-policy skip; last good checkpoint: "
        "runs/xl2/checkpoints/step_0000500 (resume with --resume auto)"
    )
    text = f"[rank0]: dit_accel.train: stopped: {line}\n" + failure_block(failure_entry(0, 0, 3, 99))
    checks = diagnose(text)
    assert checks[1].name == "stopped: non-finite loss" and line in checks[1].reason
    assert "exit code 3" in checks[1].reason and "--resume auto" in checks[1].fix
    assert not any(c.name == "exitcode 3" for c in checks)


def test_a_hung_rank_named_by_the_watchdog_is_the_root_cause_not_the_gloo_timeouts():
    """The watchdog's line (dit_accel.run.watchdog) wins over the collective errors it leaves on other ranks."""
    line = (
        "rank 1 stuck at step 2 for 4 s before a collective (micro-step 1 of 2); other ranks are at step 2, "
        "waiting for it in the collective (rank 0); ended after --collective-timeout-s 4; exit 5 (check that "
        "rank's node and log; resume with --resume auto)"
    )
    text = (
        f"dit_accel.train: [rank 0] {line}\n"
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
        + failure_block(failure_entry(0, 0, 5, 99), failure_entry(1, 1, 5, 100))
    )
    checks = diagnose(text)
    assert checks[1].name == "rank 1 hung" and "stuck at step 2" in checks[1].reason, checks
    assert "exit code 5" in checks[1].reason and "logs/rank1.log" in checks[1].fix
    assert [c.name for c in checks] == ["failed ranks", "rank 1 hung"]  # nothing blames the lost gloo peer


def test_a_bad_image_in_a_ranks_own_log_names_the_rank_and_the_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.log").write_text("2026-03-02 11:00:00,000 rank0 INFO step 10/100 | loss 0.2\n")
    (run_dir / "logs" / "rank3.log").write_text(
        "2026-03-02 11:00:00,000 rank3 INFO step 10/100 | loss 0.2\n"
        "2026-03-02 11:00:02,000 rank3 ERROR cannot decode image /data/train/n01440764/x_17.JPEG: image file "
        "is truncated (7 bytes not processed); replace or delete the file, or pass --skip-bad-images to skip "
        "such files\n"
    )
    log = write(tmp_path, failure_block(failure_entry(0, 3, 2, 555)))
    assert run(["--log", str(log), "--output-dir", str(run_dir), "--format", "json"]) == 2
    rows = json.loads(capsys.readouterr().out)["checks"]
    [row] = [r for r in rows if r["name"] == "undecodable image"]
    assert "/data/train/n01440764/x_17.JPEG on rank 3: image file is truncated" in row["reason"]
    assert "--skip-bad-images" in row["fix"] and "--full" in row["fix"]


def test_a_user_error_in_a_rank_without_a_failure_table_is_shown_as_it_was_printed():
    line = "dit_accel.train: error: --latents /data/lat256 is incomplete (no manifest.json); re-run it"
    [row] = diagnose(f"[rank1]: {line}\n")
    assert row.name == "bad input" and row.reason == line
