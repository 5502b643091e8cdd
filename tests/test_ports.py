"""The launched tests' rendezvous ports: outside the range outgoing connections draw from, free, never twice."""

import socket

import ports
from ports import launch_port


def test_launch_ports_are_free_distinct_and_below_the_ephemeral_range():
    handed = [int(launch_port()) for _ in range(50)]
    assert len(set(handed)) == len(handed)
    assert all(1024 <= port < ports._ephemeral_low() for port in handed)
    for port in handed[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("", port))  # free when handed out: a store can listen on it


def test_a_port_something_listens_on_is_skipped():
    drawn = next(ports._next)  # the helper's next candidate is the one after this
    taken = ports._LOWEST_PORT + (drawn + 1) % ports._SPAN
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("", taken))
        holder.listen()
        assert int(launch_port()) != taken
