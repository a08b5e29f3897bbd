"""Free loopback ports for local processes.

A port handed to a process that binds it later must not be taken meanwhile. The kernel gives
every outgoing connection (to Redis, between workers) a port from its ephemeral range, so a port
chosen inside that range (`bind(("", 0))`) can be taken by some client's connection before the
process that was given it binds it, and that process then fails with EADDRINUSE. So ports are
drawn at random below the ephemeral range, where only explicit listeners bind, and each is
checked free; the kernel's choice is the fallback when no range is known or none is free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000  # below: well-known and registered services' ports
_ATTEMPTS = 64


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' ports, or None where it cannot be read."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on `host` that no listener holds, outside the ephemeral range where possible."""
    span = ephemeral_range()
    rng = rng or random.SystemRandom()
    if span is not None and span[0] - 1 > _LOWEST:
        for _ in range(_ATTEMPTS):
            port = rng.randint(_LOWEST, span[0] - 1)
            if not port_in_use(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when `port` on `host` cannot be bound (another process listens there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not "in use"
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
