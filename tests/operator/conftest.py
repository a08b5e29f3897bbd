"""Fixtures for operator tests: a real redis-server, and the operator inside kopf.operator()
against KMock (an in-memory Kubernetes API emulator)."""

import asyncio
import contextlib

import kmock
import kopf
import pytest
import pytest_asyncio

from moemesh.operator.config import OperatorConfig
from moemesh.operator.handlers import register


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def kubeconfig(tmp_path, monkeypatch, kmock):
    path = tmp_path / "kubeconfig"
    path.write_text(
        "kind: Config\ncurrent-context: mock\n"
        f"clusters: [{{name: mock, cluster: {{server: '{kmock.url!s}'}}}}]\n"
        "users: [{name: mock, user: {}}]\n"
        "contexts: [{name: mock, context: {cluster: mock, user: mock}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


def declare_resources(emulator) -> None:
    emulator.resources.load_bundled()
    emulator.resources["moemesh.io/v1alpha1/inferencemeshes"] = kmock.ResourceInfo(
        kind="InferenceMesh",
        singular="inferencemesh",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )
    emulator.resources["v1/namespaces"].namespaced = False


@pytest_asyncio.fixture()
async def operator(kmock, kubeconfig, redis_port):
    """Runs the operator (tick every 0.1 s) until the test ends; yields its fake clock."""
    declare_resources(kmock)
    registry = kopf.OperatorRegistry()
    register(registry, OperatorConfig(redis_url=f"redis://127.0.0.1:{redis_port}/0", tick_seconds=0.1))
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.persistence.consistency_timeout = 0
    settings.posting.enabled = False
    settings.watching.reconnect_backoff = 0.1
    settings.queueing.exit_timeout = 0.1  # the emulator never ends watch streams: stop fast
    clock = FakeClock()
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=settings,
            namespaces=["ns1"],
            standalone=True,
            ready_flag=ready,
            memo=kopf.Memo(clock=clock),
        )
    )
    await asyncio.wait_for(ready.wait(), timeout=120)
    yield clock
    # Cancel rather than set the stop flag: a graceful stop waits 5 s for "hung" tasks, and the
    # emulator's never-ending watch streams are such tasks. The stop is normally well under a
    # second, but on a loaded 2-core CI box it once took more than 10 s (not reproduced under
    # load here): the bound only catches an operator that never stops.
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=120)


async def eventually(predicate, timeout: float = 20.0, message: str = "condition"):
    """Poll ``predicate`` (short interval) until it returns a truthy value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {message}")
        await asyncio.sleep(0.05)
