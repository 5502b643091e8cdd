"""A rendezvous port for each launched test run, chosen so that concurrent runs cannot take it from each other.

`--main_process_port 0` makes accelerate bind port 0, read the port the kernel gave, close it, and hand it
to torchrun. That port comes from the kernel's ephemeral range, the same range every outgoing connection
draws from: while several launches run at once (a second writer, the launch-translation cases), one
run's gloo connections can take the port another run's store is about to listen on (EADDRINUSE, seen
once in CI). Ports below the ephemeral range are never handed out for outgoing connections, so a port
picked there, free when picked and never picked twice in this session, stays free for its run.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

_LOWEST_PORT = 10000  # below Linux's default ephemeral range (32768-60999) by far


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


_SPAN = max(_ephemeral_low(), _LOWEST_PORT + 1000) - _LOWEST_PORT
_next = itertools.count(os.getpid() * 97)  # concurrent pytest sessions start at different places


def launch_port() -> str:
    """A free port below the ephemeral range that no earlier call in this session returned."""
    for _ in range(_SPAN):
        port = _LOWEST_PORT + next(_next) % _SPAN
        if _is_free(port):
            return str(port)
    raise RuntimeError(f"no free port in {_LOWEST_PORT}..{_LOWEST_PORT + _SPAN - 1} for a launched test run")
