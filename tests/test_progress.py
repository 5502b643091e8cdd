"""dit_accel.progress: tqdm on a terminal; whole lines, every 10%, in a pipe or a log file."""

import io
import os
import subprocess
import sys

import pytest
from tqdm import tqdm

from dit_accel.progress import PlainProgress, progress_bar

SCRIPT = """
from dit_accel.progress import progress_bar
bar = progress_bar(total=1000, desc="encoding", unit="img")
for _ in range(1000):
    bar.update(1)
    bar.set_postfix(loss="0.5", refresh=False)
bar.close()
for _ in progress_bar(range(7), desc="sampling", unit="step", leave=False):
    pass
"""


@pytest.mark.launched  # a real process whose stderr is a pipe, as under SLURM or `| tee`
def test_a_pipe_gets_a_plain_line_every_ten_percent():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    encoding = [line for line in lines if line.startswith("encoding: ")]
    assert [line.split()[1] for line in encoding] == [f"{n}/1000" for n in range(0, 1001, 100)]
    assert encoding[-1].startswith("encoding: 1000/1000 img (100%), ") and encoding[-1].endswith("loss=0.5")
    sampling = [line for line in lines if line.startswith("sampling: ")]
    assert [line.split()[1] for line in sampling] == ["0/7", "1/7", "2/7", "3/7", "4/7", "5/7", "6/7", "7/7"]
    assert max(map(len, lines)) < 120 and len(lines) == len(encoding) + len(sampling)


def test_a_terminal_gets_tqdm_and_a_file_gets_plain_lines(monkeypatch):
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stdout", terminal)  # the log lines on the same terminal
        bar = progress_bar(total=3, file=terminal)
        assert isinstance(bar, tqdm)
        bar.close()
        # the log lines piped (`dit-accel train ... | tee run.log`) while the bar's stream is the terminal: a
        # bar there was redrawn before tee printed a log line, which then stuck to its end
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        assert isinstance(progress_bar(total=3, file=terminal), PlainProgress)
        monkeypatch.undo()
    os.close(leader)
    stream = io.StringIO()
    bar = progress_bar(total=4, desc="train", unit="step", initial=2, file=stream)
    assert isinstance(bar, PlainProgress)
    bar.update(1)
    bar.update(1)
    bar.close()
    assert [line.split(",")[0] for line in stream.getvalue().splitlines()] == [
        "train: 2/4 step (50%)",
        "train: 3/4 step (75%)",
        "train: 4/4 step (100%)",
    ]
    silent = io.StringIO()
    for _ in progress_bar(range(5), file=silent, disable=True):
        pass
    assert silent.getvalue() == ""
