"""In-process expert workers for executor unit tests: each is a ReplicaStore answered through
the servicer's own parse_call / run_call, with a switch that makes a worker unreachable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.contracts.placement import Placement
from moemesh.expert.server.replicas import ReplicaStore
from moemesh.expert.server.servicer import parse_call, run_call
from moemesh.expert.server.weights import MoEShape
from moemesh.expert.transports.base import ExpertCallError, ExpertTransport


@dataclass
class LayerWeights:
    w13: torch.Tensor  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor  # [num_experts, hidden, intermediate]


def random_experts(num_layers: int, num_experts: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [
        LayerWeights(
            (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype),
            (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype),
        )
        for _ in range(num_layers)
    ]


class _Done:
    def __init__(self, reply):
        self._reply = reply

    def result(self):
        return self._reply


class _Failed:
    def __init__(self, error):
        self._error = error

    def result(self):
        raise self._error


class LoopbackTransport(ExpertTransport):
    def __init__(self, experts: list[LayerWeights], worker_ids: list[str]):
        num_experts, rows, hidden = experts[0].w13.shape
        shape = MoEShape("test", tuple(range(len(experts))), num_experts, hidden, rows // 2)

        def read(wanted):
            return {(layer, e): (experts[layer].w13[e].clone(), experts[layer].w2[e].clone()) for layer, e in wanted}

        self.stores = {w: ReplicaStore(w, shape, read) for w in worker_ids}
        self.dead: set[str] = set()
        self.calls: list[tuple[str, int]] = []  # (worker id, layer)

    def load(self, placement: Placement) -> None:
        for store in self.stores.values():
            store.load(placement)

    def submit(self, worker_id, request, timeout_s):
        if worker_id in self.dead:
            return _Failed(ExpertCallError(worker_id, "loopback", "UNAVAILABLE", "connection refused"))
        self.calls.append((worker_id, request.layer))
        call = parse_call(self.stores[worker_id], request)
        call.hosted.token_counts[call.layer] += call.local_counts
        return _Done(run_call(call))

    def set_endpoints(self, endpoints):
        pass
