"""Ports handed to local processes come from below the kernel's ephemeral range, where no
outgoing connection can take them before the process binds them."""

from __future__ import annotations

import random
import socket

from moemesh.launcher import ports


def test_the_ephemeral_range_is_read_from_the_kernels_file(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    assert ports.ephemeral_range(path) == (32768, 60999)
    assert ports.ephemeral_range(tmp_path / "missing") is None
    path.write_text("garbage")
    assert ports.ephemeral_range(path) is None


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    for seed in range(20):
        port = ports.free_port("127.0.0.1", random.Random(seed))
        assert 10000 <= port < 32768
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_a_listener_holds_is_skipped(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    taken = ports.free_port("127.0.0.1", random.Random(7))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        assert ports.port_in_use("127.0.0.1", taken)
        assert ports.free_port("127.0.0.1", random.Random(7)) != taken  # the same draws, the held one passed over


def test_without_a_known_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: None)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
