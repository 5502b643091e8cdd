"""Distributed checks: can the ranks meet? On one node the rendezvous port must be free; on several,
the main process address must resolve and answer, and on the main node the port must be free.

Only the configured address and port are ever touched, with a short timeout: no scanning.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import yaml

from dit_accel.doctor.checks import Check, failed, passed, warned
from dit_accel.doctor.plan import PlanFacts
from planner.units import count

GROUP = "distributed"
DEFAULT_PORT = 29500  # torch.distributed's and accelerate's default rendezvous port
CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Rendezvous:
    address: str | None
    port: int


def read_rendezvous(
    config_path: Path, plan: PlanFacts | None = None, address: str | None = None, port: int | None = None
) -> Rendezvous:
    """Where the ranks meet, as the launch will see it: the launch flags, else MAIN_PROCESS_IP/PORT (which
    dit-plan's SLURM script exports and passes as flags), else the Accelerate YAML, else plan.json's
    cluster section, else torch's default port."""
    try:
        config = yaml.safe_load(config_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    ports = [
        port,
        os.environ.get("MAIN_PROCESS_PORT"),
        config.get("main_process_port"),
        plan.main_process_port if plan else None,
        DEFAULT_PORT,
    ]
    addresses = [
        address,
        os.environ.get("MAIN_PROCESS_IP"),
        config.get("main_process_ip"),
        plan.main_process_ip if plan else None,
    ]
    return Rendezvous(
        address=next((a for a in addresses if a), None),
        port=int(next(p for p in ports if isinstance(p, int) or str(p).isdigit())),
    )


def _bind(address: str, port: int) -> OSError | None:
    """Bind briefly (no SO_REUSEADDR, so a listener on the wildcard address counts as taken)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError as error:
            return error
    return None


def check_port_free(port: int, address: str = "127.0.0.1") -> Check:
    name = "rendezvous port"
    if port == 0:
        return passed(GROUP, name, "main_process_port 0: the launcher picks a free port")
    error = _bind(address, port)
    if error is None:
        return passed(GROUP, name, f"port {port} is free on {address}")
    if error.errno == errno.EADDRINUSE:
        return failed(
            GROUP,
            name,
            f"port {port} is already in use on this node (a previous run still alive?)",
            f"find the holder with `ss -ltnp 'sport = :{port}'` and stop it, or pass --main_process_port to accelerate launch",
        )
    return failed(
        GROUP,
        name,
        f"cannot bind port {port} on {address}: {error.strerror or error}",
        "pick another --main_process_port (ports below 1024 need root)",
    )


def check_reachable(address: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> Check:
    """From a worker node: does the main node's address resolve, and does it answer on the port?"""
    name = "main process address"
    fix_net = (
        f"check main_process_ip in the Accelerate config and that nodes can reach {address}:{port} "
        "(same network, firewall open for the port)"
    )
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return failed(
            GROUP,
            name,
            f"main_process_ip {address!r} does not resolve: {error.strerror}",
            "use the main node's IP address or a hostname every node resolves",
        )
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout_s)
        try:
            probe.connect(sockaddr)
        except ConnectionRefusedError:
            return passed(
                GROUP,
                name,
                f"{address} ({sockaddr[0]}) answers; nothing listens on port {port} yet, "
                "as expected before the main node starts",
            )
        except TimeoutError:
            return warned(
                GROUP,
                name,
                f"no answer from {address}:{port} within {timeout_s:.0f} s: a firewall drops the "
                "packets, or the address is wrong",
                fix_net,
            )
        except OSError as error:
            return failed(GROUP, name, f"cannot reach {address}:{port}: {error.strerror or error}", fix_net)
    return passed(
        GROUP,
        name,
        f"{address}:{port} accepts connections (the main process is up, or a stale run holds the port)",
    )


def check_distributed(
    plan: PlanFacts, rendezvous: Rendezvous, timeout_s: float = CONNECT_TIMEOUT_S
) -> list[Check]:
    if plan.nodes <= 1:
        return [check_port_free(rendezvous.port)]
    if not rendezvous.address:
        return [
            failed(
                GROUP,
                "main process address",
                f"the plan has {plan.nodes} nodes and no main process address is known "
                "(no --main-process-ip, MAIN_PROCESS_IP, or main_process_ip in the config or plan)",
                "pass --main-process-ip ADDRESS as the launch will (the SLURM script exports MAIN_PROCESS_IP: run "
                "the doctor inside the job), or set it with dit-plan --main-process-ip",
            )
        ]
    try:
        resolved = socket.getaddrinfo(rendezvous.address, rendezvous.port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror:
        resolved = None
    if resolved is not None and ipaddress.ip_address(resolved).is_loopback:
        return [
            failed(
                GROUP,
                "main process address",
                f"main_process_ip {rendezvous.address} is a loopback address: the "
                f"other {count(plan.nodes - 1, 'node')} cannot reach it",
                "set main_process_ip to the main node's address on the network the nodes share",
            )
        ]
    if resolved is not None:
        error = _bind(resolved, rendezvous.port)
        if error is None or error.errno == errno.EADDRINUSE:
            # the address is this machine's: this is the main node, where the port must be free
            return [
                passed(GROUP, "main process address", f"{rendezvous.address} is this node (the main node)"),
                check_port_free(rendezvous.port, resolved),
            ]
    return [check_reachable(rendezvous.address, rendezvous.port, timeout_s)]
