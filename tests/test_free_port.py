"""shard_procs.free_port: ports a server binds a moment later, chosen where no outgoing connection can
take them first (CI once saw a metrics port taken in that moment)."""

from __future__ import annotations

import socket

from text_generation_server.launcher import shard_procs


def test_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    low, high = shard_procs.ephemeral_port_range()
    ports = [shard_procs.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not low <= port <= high, (port, low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        # The busy port is the only one outside the (pretended) ephemeral range: after trying it,
        # free_port falls back to a port the kernel picks.
        monkeypatch.setattr(shard_procs, "ephemeral_port_range", lambda: (taken + 1, 65535))
        monkeypatch.setattr(shard_procs, "_LOWEST_PORT", taken)
        port = shard_procs.free_port()
        assert port != taken


def test_without_room_outside_it_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(shard_procs, "ephemeral_port_range", lambda: (1, 65535))
    port = shard_procs.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
