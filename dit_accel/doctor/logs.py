"""`dit-accel doctor --log FILE`: read a failed run's log and say what happened, what it usually means,
and what to do.

The anchor is torch.distributed.elastic's ChildFailedError block, which torchrun and `accelerate launch`
print when a rank dies:

    Failures:
      <NO_OTHER_FAILURES>            (or more [i]: entries)
    Root Cause (first observed failure):
    [0]:
      time      : 2025-03-02_10:14:07
      host      : node-a
      rank      : 3 (local_rank: 3)
      exitcode  : -9 (pid: 4242) (SIGKILL)      (older torch omits the signal name)
      error_file: <N/A>
      traceback : Signal 9 (SIGKILL) received by PID 4242

Around it, the ranks' own output holds the classic messages (CUDA out of memory, NCCL watchdog
timeouts, FileNotFoundError, tracebacks), often prefixed with `[rankN]:`.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from dit_accel.doctor.checks import Check, failed, gib, passed, warned
from dit_accel.doctor.plan import PlanFacts
from planner.units import plural

GROUP = "log"

_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?", re.MULTILINE)
_ENTRY = re.compile(
    r"\[(?P<index>\d+)\]:\s*\n"
    r"\s*time\s*:\s*(?P<time>\S+)\s*\n"
    r"\s*host\s*:\s*(?P<host>\S+)\s*\n"
    r"\s*rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local_rank>-?\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<exitcode>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<error_file>[^\n]*)\n"
    r"\s*traceback\s*:\s*(?P<traceback>[^\n]*)"
)
_ROOT_CAUSE = "Root Cause (first observed failure):"


@dataclass(frozen=True)
class RankFailure:
    """One entry of the ChildFailedError table."""

    time: str
    host: str
    rank: int
    local_rank: int
    exitcode: int
    pid: int
    error_file: str
    traceback: str
    root_cause: bool

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return None

    @property
    def who(self) -> str:
        exit_text = f"exitcode {self.exitcode}" + (f" ({self.signal_name})" if self.signal_name else "")
        where = [f"local_rank {self.local_rank}"] + ([f"pid {self.pid}"] if self.pid else [])
        place = f" on {self.host} at {self.time}" if self.host != "?" else ""
        return f"rank {self.rank} ({', '.join(where)}){place}: {exit_text}"


def clean(text: str) -> str:
    """Drop the `[rank3]:` prefixes torchrun adds, so every rank's lines read like one program's."""
    return _RANK_PREFIX.sub("", text.replace("\r\n", "\n"))


def parse_failures(text: str) -> list[RankFailure]:
    """Every failure entry of every ChildFailedError block, the root causes first."""
    text = clean(text)
    failures = []
    for block_start in [match.start() for match in re.finditer(r"^Failures:\s*$", text, re.MULTILINE)] or [0]:
        block_end = text.find("\n===", text.find(_ROOT_CAUSE, block_start) + 1)
        block = text[block_start : block_end if block_end > 0 else len(text)]
        root_at = block.find(_ROOT_CAUSE)
        for match in _ENTRY.finditer(block):
            failures.append(
                RankFailure(
                    time=match["time"],
                    host=match["host"],
                    rank=int(match["rank"]),
                    local_rank=int(match["local_rank"]),
                    exitcode=int(match["exitcode"]),
                    pid=int(match["pid"]),
                    error_file=match["error_file"].strip(),
                    traceback=match["traceback"].strip(),
                    root_cause=root_at >= 0 and match.start() > root_at,
                )
            )
    unique = list({(f.host, f.rank, f.pid, f.exitcode): f for f in failures}.values())
    return sorted(unique, key=lambda f: (not f.root_cause, f.time, f.rank))


# the launcher's own traceback that reports a rank's death: never the rank's exception
_LAUNCHER_EXCEPTIONS = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    "torch.distributed.elastic.multiprocessing.api.SignalException",
    "subprocess.CalledProcessError",
)


_AGENT_LINE = re.compile(
    r"failed \(exitcode: (?P<exitcode>-?\d+)\) local_rank: (?P<local_rank>\d+) \(pid: (?P<pid>\d+)\)"
)
_SIMPLE_LAUNCHER = re.compile(
    r"subprocess\.CalledProcessError: Command .* (?:died with <Signals\.(?P<signal>\w+): (?P<number>\d+)>"
    r"|returned non-zero exit status (?P<status>\d+))"
)


def parse_fallback_failures(text: str) -> list[RankFailure]:
    """Without a failure table (a cut log, or `accelerate launch` of one process, which runs the script
    as a plain subprocess): the elastic agent's error line, or subprocess.CalledProcessError."""
    unknown = "?"
    agent = _AGENT_LINE.search(text)
    if agent:
        return [
            RankFailure(
                unknown,
                unknown,
                int(agent["local_rank"]),
                int(agent["local_rank"]),
                int(agent["exitcode"]),
                int(agent["pid"]),
                unknown,
                unknown,
                root_cause=True,
            )
        ]
    simple = _SIMPLE_LAUNCHER.search(text)
    if simple:
        exitcode = -int(simple["number"]) if simple["number"] else int(simple["status"])
        return [RankFailure(unknown, unknown, 0, 0, exitcode, 0, unknown, unknown, root_cause=True)]
    return []


def last_exception_line(text: str) -> str | None:
    """The line naming the exception of the last traceback a rank printed: what a reader wants first."""
    lines = clean(text).splitlines()
    found = None
    for start, line in enumerate(lines):
        if line.strip() != "Traceback (most recent call last):":
            continue
        for candidate in lines[start + 1 :]:
            if candidate and not candidate[0].isspace() and not candidate.startswith("Traceback"):
                if not candidate.startswith(_LAUNCHER_EXCEPTIONS):
                    found = candidate.strip()
                break
    return found


# --- the classic messages ------------------------------------------------------------------------------

_CUDA_OOM = re.compile(r"CUDA out of memory\. Tried to allocate (?P<tried>[\d.]+ [KMGT]?i?B)")
_CUDA_OOM_CAPACITY = re.compile(
    r"GPU (?P<gpu>\d+) has a total capacity of (?P<total>[\d.]+ [KMGT]i?B) of which (?P<free>[\d.]+ [KMGT]?i?B) is free"
)
_CUDA_OOM_OLD = re.compile(
    r"\(GPU (?P<gpu>\d+); (?P<total>[\d.]+ [KMGT]i?B) total capacity; "
    r"(?P<allocated>[\d.]+ [KMGT]i?B) already allocated; (?P<free>[\d.]+ [KMGT]?i?B) free"
)
_OTHER_PROCESS = re.compile(r"Process (?P<pid>\d+) has (?P<used>[\d.]+ [KMGT]i?B) memory in use")
_STEP = re.compile(r"\bstep[\s=:]+(?P<step>\d+)", re.IGNORECASE)
# '[Rank 2] Watchdog ...', '[PG ID 0 PG GUID 0(default_pg) Rank 2] Watchdog ...' (newer torch), '[rank2] Watchdog ...'
_NCCL_TIMEOUT = re.compile(
    r"(?:[Rr]ank ?(?P<rank>\d+)\]:?\s*)?Watchdog caught collective operation timeout:\s*WorkNCCL\("
    r"SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)[^)]*?Timeout\(ms\)=(?P<timeout_ms>\d+)\)"
)
_NCCL_ERROR = re.compile(
    r"(ncclSystemError|ncclInternalError|ncclRemoteError|ncclUnhandledCudaError|ncclInvalidUsage)[^\n]*"
)
_FILE_NOT_FOUND = re.compile(r"FileNotFoundError: \[Errno 2\] No such file or directory: '(?P<path>[^']+)'")
_KERNEL_OOM_KILL = re.compile(
    r"(?:Out of memory|Memory cgroup out of memory): Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)"
)
_SCHEDULER_OOM = re.compile(
    r"(slurmstepd: error: Detected \d+ oom[-_]kill event[^\n]*|oom_kill event[^\n]*|OOMKilled)"
)
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: (?P<what>[^.\n]+)")


def _oom_kill_hint(text: str, failure: RankFailure | None) -> str:
    """Evidence of a kernel or scheduler OOM kill pasted into the same log, if any."""
    kills = list(_KERNEL_OOM_KILL.finditer(text))
    if kills:
        pids = {int(kill["pid"]) for kill in kills}
        if failure is not None and failure.pid in pids:
            return f" The kernel log in this file confirms it: the OOM killer killed pid {failure.pid}."
        return f" The kernel log in this file shows the OOM killer at work (killed pid {', '.join(map(str, sorted(pids)))})."
    scheduler = _SCHEDULER_OOM.search(text)
    if scheduler:
        return f" The scheduler reports it: {scheduler.group(0).strip()!r}."
    return ""


def _host_estimate(plan: PlanFacts | None) -> str:
    if plan is None or plan.host_bytes is None:
        return "Compare the node's RAM with the plan's host estimate (`dit-accel doctor --plan plan/plan.json ...` checks it)."
    return (
        f"The plan ({plan.path}) estimates {gib(plan.host_bytes)} of host RAM per node; "
        "`dit-accel doctor --plan ...` compares it with the node's."
    )


RANK_LOG = (
    "logs/rank{rank}.log"  # the trainer's per-rank log, relative to the run folder (train.setup_logging)
)


def _rank_logs(output_dir: Path | None, rank: int | None = None) -> str:
    if output_dir is None:
        return f"the run's per-rank logs (RUN/{RANK_LOG.format(rank='N')})"
    if rank is None:
        return f"the per-rank logs {output_dir / RANK_LOG.format(rank='N')}"
    return f"{output_dir / RANK_LOG.format(rank=rank)} (that rank's own log)"


def explain_signal_kill(
    failure: RankFailure, text: str, plan: PlanFacts | None, output_dir: Path | None
) -> Check:
    confirm = _oom_kill_hint(text, failure)
    reason = (
        f"{failure.who}. SIGKILL is sent from outside the process: usually the host kernel's OOM killer "
        "(host RAM, not GPU memory, ran out) or the job scheduler killing a job over its memory limit."
        + confirm
        + f" Check `dmesg -T | grep -i 'killed process'` or `journalctl -k | grep -i 'out of memory'` on {failure.host} "
        f"(look for pid {failure.pid}), or the scheduler's job record (e.g. `sacct -j JOBID -o State,MaxRSS`). "
        + _host_estimate(plan)
        + f" See also {_rank_logs(output_dir, failure.rank)}."
    )
    fix = (
        "fewer data-loader workers per rank (--num-workers), precomputed latents (dit-accel extract-latents), loading "
        "weights once per node, or more host RAM (or a larger job memory request); `dit-plan --host-ram SIZE` "
        "checks the estimate against your nodes"
    )
    return failed(GROUP, "exitcode -9 (SIGKILL)", reason, fix)


def explain_exit(
    failure: RankFailure, text: str, plan: PlanFacts | None, output_dir: Path | None
) -> Check | None:
    """What one rank's exit code says, beyond what the classic messages already explained."""
    if failure.exitcode == -signal.SIGKILL:
        return explain_signal_kill(failure, text, plan, output_dir)
    if failure.exitcode == -signal.SIGSEGV:
        return failed(
            GROUP,
            "exitcode -11 (SIGSEGV)",
            f"{failure.who}. A segmentation fault is a crash in native code: a data-loader worker's image "
            "decoder, mismatched CUDA/NCCL libraries (LD_LIBRARY_PATH), or a torch/driver mismatch.",
            "re-run with PYTHONFAULTHANDLER=1 to print where it crashed, try 0 data-loader workers, and run "
            "`dit-accel doctor` to check the versions",
        )
    if failure.exitcode == -signal.SIGABRT:
        watchdog = bool(_NCCL_TIMEOUT.search(clean(text)))
        meaning = (
            "here NCCL's watchdog aborted the process after a collective timed out (see the NCCL row): "
            "the real cause is the rank that stopped first"
            if watchdog
            else "a C++ abort: an uncaught c10::Error ('terminate called after throwing ...'), NCCL's watchdog tearing "
            "the process down after a timeout, or a failed CUDA assertion"
        )
        return failed(
            GROUP,
            "exitcode -6 (SIGABRT)",
            f"{failure.who}. SIGABRT is {meaning}.",
            "read the lines just before the abort in this rank's log; for CUDA asserts re-run with "
            "CUDA_LAUNCH_BLOCKING=1",
        )
    if failure.exitcode == -signal.SIGBUS:
        return failed(
            GROUP,
            "exitcode -7 (SIGBUS)",
            f"{failure.who}. A bus error in a training job is nearly always /dev/shm too small for the "
            "data-loader workers' shared batches.",
            "enlarge /dev/shm (docker --shm-size=16g) or use fewer data-loader workers; `dit-accel doctor` checks it",
        )
    if failure.exitcode > 0:
        last = last_exception_line(text)
        error_line = next(
            (
                line.strip()
                for line in clean(text).splitlines()
                if re.search(r"^[\w.-]+: error: ", line.strip())
            ),
            None,
        )
        if failure.exitcode == 2 and error_line:
            return failed(
                GROUP,
                f"exitcode {failure.exitcode}",
                f"{failure.who}. The program refused its input: {error_line}",
                "fix what that line names, then run `dit-accel doctor` on every node before relaunching",
            )
        if last:
            return failed(
                GROUP,
                f"exitcode {failure.exitcode}",
                f"{failure.who}. Python exception: {last}",
                f"read the full traceback above it (and {_rank_logs(output_dir, failure.rank)})",
            )
        return failed(
            GROUP,
            f"exitcode {failure.exitcode}",
            f"{failure.who}. The rank's traceback is not in this log (error_file: {failure.error_file})",
            f"read {_rank_logs(output_dir, failure.rank)}; decorate the entry point with "
            "torch.distributed.elastic's @record to get it here",
        )
    return None


def find_cuda_oom(text: str) -> Check | None:
    match = _CUDA_OOM.search(text)
    if not match:
        return None
    capacity = _CUDA_OOM_CAPACITY.search(text, match.start()) or _CUDA_OOM_OLD.search(text, match.start())
    figures = f"tried to allocate {match['tried']}"
    if capacity:
        figures += f" on GPU {capacity['gpu']} ({capacity['total']} total, {capacity['free']} free)"
    holders = [
        f"pid {m['pid']} ({m['used']})"
        for m in _OTHER_PROCESS.finditer(text, match.start(), match.start() + 2000)
    ]
    if holders:  # PyTorch lists every process NVML sees on the GPU, this one included
        figures += "; processes holding the GPU: " + ", ".join(holders)
    steps = [int(m["step"]) for m in _STEP.finditer(text, 0, match.start())]
    last_step = max(steps, default=0)
    if last_step <= 1:
        return failed(
            GROUP,
            "CUDA out of memory at step 1",
            f"{figures}, before any training step finished: the planned step does not fit this GPU "
            "(the plan's VRAM is larger than the real free memory, or its estimate is too low)",
            "re-plan with dit-plan --vram set to the GPU's real free memory, a lower --max-micro-batch, or more "
            "checkpointed blocks (--checkpointing); check free memory with `dit-accel doctor`",
        )
    return failed(
        GROUP,
        "CUDA out of memory",
        f"{figures}, after step {last_step} ran: memory grew or fragmented during training",
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, re-plan with more headroom (a smaller --vram), and "
        "look for tensors kept across steps (e.g. summing losses without .item())",
    )


def find_nccl(text: str) -> list[Check]:
    checks = []
    timeout = _NCCL_TIMEOUT.search(text)
    if timeout:
        ranks = sorted({int(m["rank"]) for m in _NCCL_TIMEOUT.finditer(text) if m["rank"] is not None})
        who = f"{plural(len(ranks), 'rank')} {', '.join(map(str, ranks))}" if ranks else "a rank"
        checks.append(
            failed(
                GROUP,
                "NCCL timeout",
                f"{who} waited {int(timeout['timeout_ms']) / 1000:.0f} s in {timeout['op']} (collective #{timeout['seq']}) "
                "for a rank that never joined: a rank died or hung first, the ranks ran different numbers "
                "of steps, or the network between nodes failed",
                "find the first rank that failed (the Root Cause entry, its own log) and fix that; re-run with "
                "NCCL_DEBUG=INFO and check NCCL_SOCKET_IFNAME names the right network interface; raise the "
                "timeout only if one rank is legitimately slow (e.g. rank 0 building a cache)",
            )
        )
    error = _NCCL_ERROR.search(text)
    if error:
        checks.append(
            failed(
                GROUP,
                "NCCL error",
                f"{error.group(0).strip()[:200]}",
                "re-run with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME (and NCCL_IB_DISABLE=1 to rule out "
                "InfiniBand), and that every node has the same torch/NCCL versions",
            )
        )
    return checks


def find_missing_path(text: str) -> Check | None:
    match = _FILE_NOT_FOUND.search(text)
    if not match:
        return None
    return failed(
        GROUP,
        "path not found",
        f"{match['path']} does not exist on the node that read it (a wrong --data-path, a relative path "
        "resolved from another working directory, or a disk mounted on only some nodes)",
        "pass an absolute path that exists on every node; `dit-accel doctor --data-path DIR` on each node checks it",
    )


def find_worker_killed(text: str) -> Check | None:
    match = _WORKER_KILLED.search(text)
    if not match:
        return None
    if "bus" in match["what"].lower():
        return failed(
            GROUP,
            "data-loader worker killed",
            f"a worker died of {match['what']}: /dev/shm is too small",
            "enlarge /dev/shm (docker --shm-size=16g) or use fewer data-loader workers",
        )
    return failed(
        GROUP,
        "data-loader worker killed",
        f"a worker was killed by signal {match['what']}: usually the host's OOM killer",
        "fewer data-loader workers, precomputed latents, or more host RAM; `dit-accel doctor` compares the plan's host estimate",
    )


# --- the run's own stops, and what stopped it from outside ------------------------------------------------

_PREEMPTED = re.compile(
    r"dit_accel\.train: preempted by (?P<signal>SIG\w+) at step (?P<step>\d+): "
    r"saved checkpoint (?P<path>\S+?);"
)
# torch elastic's agent: 'Received Signals.SIGTERM death signal' (newer), 'Received 15 death signal' (older)
_LAUNCHER_SIGNAL = re.compile(
    r"Received (?:Signals\.)?(?P<signal>SIG\w+|\d+) death signal, shutting down workers"
    r"|SignalException: Process \d+ got signal: (?P<number>\d+)"
)
_DISK_FULL = re.compile(
    r"(?P<line>dit_accel\.train: error: no space left on [^\n]*)"
    r"|(?P<raw>\w*Error: \[Errno 28\] No space left on device[^\n]*)"
)
_HUNG = re.compile(
    r"dit_accel\.train: \[rank \d+\] (?P<line>rank (?P<rank>\d+) stuck at step (?P<step>\d+) [^\n]*"
    r"--collective-timeout-s[^\n]*)"
)
_NAN_STOP = re.compile(r"dit_accel\.train: stopped: (?P<line>[^\n]*non-finite loss or gradient[^\n]*)")
_USER_ERROR = re.compile(
    r"^(?P<line>(?:dit_accel\.train|dit-accel [\w-]+|dit-plan): error: [^\n]*)", re.MULTILINE
)
_BAD_IMAGE = re.compile(r"cannot decode image (?P<path>.+?): (?P<why>[^\n;]*)")
_LINE_RANK = re.compile(
    r"\[rank(?P<prefix>\d+)\]:|\S+ \S+ rank(?P<log>\d+) [A-Z]+ "
)  # matched at a line start


def _signal_name(text: str) -> str:
    if not text.isdigit():
        return text
    try:
        return signal.Signals(int(text)).name
    except ValueError:
        return f"signal {text}"


def find_preemption(text: str) -> Check | None:
    """The trainer's own preemption line, else the launcher's: the job was stopped from outside."""
    own = _PREEMPTED.search(text)
    resume = (
        "requeue the job (or let the scheduler requeue it) and start it again with --resume auto: it "
        "continues from the newest complete checkpoint"
    )
    if own:
        return failed(
            GROUP,
            f"preempted ({own['signal']})",
            f"the run was stopped by {own['signal']} at step {own['step']} and saved checkpoint "
            f"{own['path']} first (exit code 4): a scheduler preemption, cancellation or time limit, "
            "not a crash",
            resume,
        )
    launcher = _LAUNCHER_SIGNAL.search(text)
    if launcher:
        name = _signal_name(launcher["signal"] or launcher["number"])
        return failed(
            GROUP,
            f"launcher stopped by {name}",
            f"the launcher itself received {name} and shut the ranks down: the scheduler preempted or "
            "cancelled the job, or its time limit ran out; no rank failed on its own",
            resume + "; on SLURM, --signal=TERM@120 gives the ranks time to save a checkpoint",
        )
    return None


def find_disk_full(text: str) -> Check | None:
    match = _DISK_FULL.search(text)
    if not match:
        return None
    line = (match["line"] or match["raw"]).strip()
    return failed(
        GROUP,
        "disk full",
        f"{line[:300]}; the errors of the other ranks (gloo/NCCL connection closed, timeouts) follow from it",
        "free space on the run folder's disk (or lower --keep-last), then resume with --resume auto; "
        "`dit-accel doctor --output-dir DIR` checks the space a checkpoint needs",
    )


def find_hang(text: str) -> Check | None:
    """The trainer's watchdog ended a rank stuck in (or before) a collective: that rank is the story."""
    match = _HUNG.search(text)
    if not match:
        return None
    return failed(
        GROUP,
        f"rank {match['rank']} hung",
        f"the watchdog ended the run (exit code 5): {match['line'].strip()[:300]}",
        f"read logs/rank{match['rank']}.log and that node's health (a stuck GPU, a slow file system, a "
        "dead NIC), then resume with --resume auto; raise --collective-timeout-s if its steps are just slow",
    )


def find_nan_stop(text: str) -> Check | None:
    match = _NAN_STOP.search(text)
    if not match:
        return None
    return failed(
        GROUP,
        "stopped: non-finite loss",
        f"the trainer stopped itself (exit code 3): {match['line'].strip()[:300]}",
        "resume from the last good checkpoint with --resume auto after lowering --lr or setting --grad-clip, "
        "or pass --nan-policy skip",
    )


def _rank_of(raw: str, position: int) -> int | None:
    """The rank a line belongs to: torchrun's `[rankN]:` prefix or the per-rank log's `rankN LEVEL`."""
    start = raw.rfind("\n", 0, position) + 1
    match = _LINE_RANK.match(raw, start)
    return int(match["prefix"] or match["log"]) if match else None


def find_bad_image(raw: str) -> Check | None:
    match = _BAD_IMAGE.search(raw)
    if not match:
        return None
    rank = _rank_of(raw, match.start())
    where = f" on rank {rank}" if rank is not None else ""
    return failed(
        GROUP,
        "undecodable image",
        f"cannot decode image {match['path']}{where}: {match['why'].strip()[:200]}",
        "replace or delete that file (`dit-accel doctor --data-path DIR --full` finds every such file), or "
        "pass --skip-bad-images to skip and count them",
    )


def find_user_error(text: str) -> Check | None:
    """A rank refused its input: the one line it printed is the reason."""
    match = _USER_ERROR.search(text)
    if not match:
        return None
    return failed(
        GROUP,
        "bad input",
        match["line"].strip()[:400],
        "fix what that line names, then run `dit-accel doctor` on every node before relaunching",
    )


def find_causes(raw: str, text: str, failures: list[RankFailure]) -> list[Check]:
    """The run's own explanation of why it stopped: these win over every rank's collateral errors."""
    first = find_disk_full(text) or find_preemption(text) or find_hang(text) or find_nan_stop(text)
    causes = [found for found in (first, find_bad_image(raw)) if found]
    if not causes and not any(f.exitcode == 2 for f in failures):  # exit 2 rows quote the line themselves
        causes = [found for found in (find_user_error(text),) if found]
    return causes


def _consequence(failure: RankFailure) -> str:
    line = f"rank {failure.rank} on {failure.host} (exitcode {failure.exitcode}"
    if failure.exitcode == -signal.SIGTERM:
        return line + ", SIGTERM: stopped by the launcher after the root cause)"
    return line + (f", {failure.signal_name})" if failure.signal_name else ")")


def diagnose(text: str, plan: PlanFacts | None = None, output_dir: Path | None = None) -> list[Check]:
    """Every recognised failure in a log, the root cause first; a PASS row when the log shows none."""
    raw, text = text.replace("\r\n", "\n"), clean(text)
    failures = parse_failures(text) or parse_fallback_failures(text)
    checks: list[Check] = []
    if failures:
        root = failures[0]
        others = failures[1:]
        summary = f"root cause {root.who}"
        if others:
            summary += "; also failed: " + "; ".join(_consequence(f) for f in others[:8])
        checks.append(
            failed(
                GROUP,
                "failed ranks",
                summary,
                "fix the root cause first: later failures are often its consequence",
            )
        )
    causes = find_causes(raw, text, failures)
    classic = causes + [
        found for found in (find_cuda_oom(text), find_missing_path(text), find_worker_killed(text)) if found
    ]
    collateral = find_nccl(text)
    if causes:  # a rank stopped for a known reason: the others' timeouts and lost peers follow from it
        collateral = [
            failed(c.group, c.name, f"{c.reason} (most likely a consequence of the first row)", c.fix)
            for c in collateral
        ]
    classic += collateral
    checks[1:1] = causes  # right after the failed ranks' summary, or first
    checks += classic[len(causes) :]
    explained = set()
    for failure in failures:
        if (failure.exitcode > 0 or causes) and classic:
            continue  # its exception (or the launcher's SIGTERM) is one a row above already explains
        check = explain_exit(failure, text, plan, output_dir)
        if check is not None and check.name not in explained:
            checks.append(check)
            explained.add(check.name)
    if not checks:
        last = last_exception_line(text)
        if last:
            return [
                warned(
                    GROUP,
                    "unrecognised failure",
                    f"no known failure pattern; the last Python exception is: {last}",
                    "read the traceback above it",
                )
            ]
        return [passed(GROUP, "log", "no failure block, traceback or known error message found")]
    return checks
