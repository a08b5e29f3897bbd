"""Expert-worker autoscaling through the operator: kopf.operator() against KMock, a real
redis-server, and the operator's fake clock. The expert StatefulSet's pods are simulated in Redis
as the real expert workers behave there: a pod per ordinal registers, loads each placement that
names it and marks it ready, and holds a retired placement's weights until it releases them."""

from __future__ import annotations

import asyncio
import contextlib
import copy

import numpy as np
import pytest
import pytest_asyncio
from conftest import eventually
from test_operator import BASE, MESH, create, live, status

from moemesh.contracts.expert_load_records import publish_expert_load
from moemesh.contracts.placement import PlacementStore
from moemesh.contracts.registry import WorkerRecord, deregister, heartbeat

pytestmark = pytest.mark.asyncio

NUM_LAYERS, NUM_EXPERTS = 2, 8
WINDOW_S = 10.0
UNIFORM = np.full((NUM_LAYERS, NUM_EXPERTS), 1.0 / (NUM_LAYERS * NUM_EXPERTS))
SKEWED = np.array([[0.5] + [0.5 / 7] * 7, [0.5 / 7] * 7 + [0.5]]) / 2  # expert 0 / 7 hot in each layer


def scaling_mesh(replicas: int, redundant_slots: int, min_replicas: int = 2, max_replicas: int = 4):
    body = copy.deepcopy(BASE)
    body["spec"]["expert"] = {"replicas": replicas, "minReplicas": min_replicas, "maxReplicas": max_replicas}
    # the EPLB step only publishes layout changes here (a 99 % improvement is never reached)
    body["spec"]["eplb"] = {
        "enabled": True,
        "redundantSlots": redundant_slots,
        "intervalSeconds": 1e6,
        "imbalanceThreshold": 0.99,
    }
    body["spec"]["autoscaling"] = {
        "expert": {
            "enabled": True,
            "targetTokensPerSecond": 1000,
            "scaleDownWindowSeconds": 60,
            "scaleUpPeriodSeconds": 10,
            "scaleDownPeriodSeconds": 30,
            "maxStepUp": 2,
            "maxStepDown": 1,
        }
    }
    return body


class ExpertPods:
    """The expert StatefulSet's pods as Redis sees them, one poll at a time (``sync``):
    - a pod per ordinal below spec.replicas registers (while ``start_pods``), and deregisters
      when the StatefulSet shrinks below its ordinal: the pod was deleted. It records a
      violation if it still held weights or a slot of the active placement then;
    - a registered pod loads the active and the pending placement when they name it and marks
      the pending one ready; it holds the weights of every version it loaded and releases a
      version that is neither active nor pending only while ``release`` is set;
    - pod 0 publishes ``counts`` as its load window of ``WINDOW_S``."""

    def __init__(self, kmock, client) -> None:
        self.kmock, self.client, self.store = kmock, client, PlacementStore(client, MESH)
        self.start_pods, self.release = True, True
        self.counts = np.zeros((NUM_LAYERS, NUM_EXPERTS), dtype=np.int64)  # pod 0's load window
        self.held: dict[str, dict[int, int]] = {}  # worker -> version -> (layer, expert) weights held
        self.violations: list[str] = []
        self.replica_history: list[int] = []

    def replicas(self) -> int:
        statefulset = live(self.kmock, "apps/v1/statefulsets", "m1-expert") or {}
        return int((statefulset.get("spec") or {}).get("replicas", 0))

    def sync(self) -> None:
        replicas = self.replicas()
        if replicas and (not self.replica_history or self.replica_history[-1] != replicas):  # 0: not created yet
            self.replica_history.append(replicas)
        current, latest = self.store.current_version(), self.store.latest_version()
        active = self.store.get(current) if current else None
        for worker_id in [w for w in self.held if int(w.rsplit("-", 1)[1]) >= replicas]:
            if sum(self.held[worker_id].values()) or (active is not None and worker_id in active.worker_ids):
                self.violations.append(f"{worker_id} deleted holding {self.held[worker_id]} (active {current})")
            deregister(self.client, MESH, worker_id)
            del self.held[worker_id]
        if self.start_pods:
            for ordinal in range(replicas):
                self.held.setdefault(f"m1-expert-{ordinal}", {})
        for worker_id, held in self.held.items():
            for version in sorted({current, latest} - {0}):
                placement = self.store.get(version)
                if placement is None or version in held:
                    continue
                slots = placement.slots_of(worker_id) if worker_id in placement.worker_ids else []
                held[version] = len(
                    {(layer, int(e)) for layer in range(NUM_LAYERS) for e in placement.phy2log[layer, slots]}
                )
                if version > current and worker_id in placement.worker_ids:
                    self.store.mark_ready(worker_id, version)
            if self.release:
                for version in [v for v in held if v not in (current, latest)]:
                    del held[version]
            record = WorkerRecord(
                worker_id=worker_id,
                role="expert",
                endpoint=f"{worker_id}:50051",
                model="tiny-moe",
                num_experts_held=sum(held.values()),
            )
            heartbeat(self.client, MESH, record)
        publish_expert_load(self.client, MESH, "m1-expert-0", self.counts, window_s=WINDOW_S)

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sync)
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture()
async def pods(kmock, operator, redis_client):
    pods = ExpertPods(kmock, redis_client)
    task = asyncio.create_task(pods.run())
    yield pods
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert pods.violations == []


def scaling_status(kmock) -> dict:
    return status(kmock).get("expertScaling") or {}


async def seen(kmock, pods, tokens_per_second: float, shape=UNIFORM) -> None:
    """Publish a load window and wait until a tick of the operator read it."""
    pods.counts = np.rint(shape * tokens_per_second * WINDOW_S).astype(np.int64)
    published = round(float(pods.counts.sum()) / WINDOW_S, 1)
    await eventually(
        lambda: scaling_status(kmock).get("routedTokensPerSecond") == published,
        message=f"a tick that saw {published} tokens/s",
    )


async def active_placement(kmock, store, num_workers: int):
    def active():
        placement = store.current()
        return placement if placement is not None and placement.num_workers == num_workers else None

    placement = await eventually(active, message=f"a placement over {num_workers} workers active")
    await eventually(lambda: status(kmock).get("placementVersion") == placement.version, message="status version")
    return placement


async def test_load_grows_the_statefulset_then_the_placement_spreads_over_the_new_workers(kmock, operator, pods):
    clock = operator
    await create(kmock, scaling_mesh(replicas=2, redundant_slots=0))  # 4 slots per worker
    first = await active_placement(kmock, pods.store, 2)
    pods.start_pods = False  # the next pods stay unscheduled for now
    clock.now += 1  # (the scale-up window is 0 s: the idle recommendations of the last tick's second are gone)
    await seen(kmock, pods, 3500.0, SKEWED)  # 3.5 workers' worth, within maxStepUp 2
    await eventually(lambda: pods.replicas() == 4, message="the StatefulSet grown to 4")
    await eventually(lambda: "not registered" in scaling_status(kmock).get("action", ""), message="waiting for pods")
    assert pods.store.latest_version() == first.version  # no placement names pods that are not up
    assert scaling_status(kmock)["desiredWorkers"] == 4

    pods.start_pods = True
    spread = await active_placement(kmock, pods.store, 4)
    assert spread.worker_ids == tuple(f"m1-expert-{i}" for i in range(4))
    assert spread.num_slots == 16  # every new pod brought its 4 slots
    counts = spread.replica_counts
    assert counts[0, 0] > counts[0, 1] and counts[1, 7] > counts[1, 6]  # planned from the load it saw
    assert (counts >= 1).all() and (counts.sum(axis=1) == 16).all()
    await eventually(lambda: pods.replica_history == [2, 4], message="the pods saw 2, 4")
    assert (
        scaling_status(kmock)["placementWorkers"],
        live(kmock, "apps/v1/statefulsets", "m1-expert")["spec"]["replicas"],
    ) == (4, 4)


async def test_scale_down_moves_replicas_off_the_last_pods_and_waits_for_their_release(kmock, operator, pods):
    clock = operator
    await create(kmock, scaling_mesh(replicas=4, redundant_slots=8))  # 16 slots, 4 per worker
    await active_placement(kmock, pods.store, 4)
    await seen(kmock, pods, 3900.0)
    await seen(kmock, pods, 1500.0)  # 2 workers' worth; the 60 s window still holds the 3900
    assert pods.replicas() == 4 and pods.store.latest_version() == 1

    pods.release = False  # the leaving pod keeps serving calls of the old placement for a while
    clock.now += 61
    three = await active_placement(kmock, pods.store, 3)
    assert three.num_slots == 12 and "m1-expert-3" not in three.worker_ids
    await eventually(lambda: "draining" in scaling_status(kmock).get("action", ""), message="draining")
    assert pods.replicas() == 4  # the pod holds replicas: it stays
    pods.release = True
    await eventually(lambda: pods.replicas() == 3, message="the StatefulSet shrunk to 3 after the release")

    await seen(kmock, pods, 1400.0)
    assert pods.store.latest_version() == three.version  # scaleDownPeriodSeconds: one step per 30 s
    pods.release = False
    clock.now += 31
    two = await active_placement(kmock, pods.store, 2)
    assert two.num_slots == 8 and (two.replica_counts == 1).all()  # memory floor: every expert once
    await eventually(lambda: "draining" in scaling_status(kmock).get("action", ""), message="draining")
    assert pods.replicas() == 3
    pods.release = True
    await eventually(lambda: pods.replicas() == 2, message="the StatefulSet shrunk to 2")
    await eventually(lambda: pods.replica_history == [4, 3, 2], message="the pods saw 4, 3, 2")

    clock.now += 200  # at minReplicas and the memory floor: nothing below
    await seen(kmock, pods, 10.0)
    assert pods.replicas() == 2 and pods.store.latest_version() == two.version


async def test_load_that_swings_inside_the_scale_down_window_neither_scales_nor_replaces(kmock, operator, pods):
    clock = operator
    await create(kmock, scaling_mesh(replicas=4, redundant_slots=8))
    first = await active_placement(kmock, pods.store, 4)
    for phase in range(12):  # 120 s (two scale-down windows) of load swinging between 4 and 1 workers' worth every 10 s
        await seen(kmock, pods, 3900.0 if phase % 2 == 0 else 1000.0 + phase)
        clock.now += 10
    assert pods.replica_history == [4]
    assert pods.store.latest_version() == first.version
    assert scaling_status(kmock)["action"] == "steady"
