"""The remote executor's grouping and combining against LocalExpertExecutor and a float64
reference, over in-process expert workers. The expert side combines its own experts and the
dispatcher adds the per-worker float32 partials, so versus the local kernel only the association
of the float32 sum differs: fp32 within a few ulps, bf16 within one bf16 ulp."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
import torch

from moemesh import kernels
from moemesh.contracts.placement import Placement, make_placement
from moemesh.engine.errors import ExpertUnavailableError
from moemesh.engine.layers.expert_executor import ExpertPlacement, LocalExpertExecutor
from moemesh.expert.client.dispatch_plan import group_by_worker, reroute, sort_entries, split_by_worker
from moemesh.expert.client.remote_executor import RemoteExpertExecutor, RemotePlacement
from moemesh.expert.protocol.call import ExpertRequest, request_from_proto, request_to_proto
from moemesh.expert.protocol.wire import tensor_to_proto
from moemesh.expert.server.servicer import CallError, ExpertServicer, decode_request, parse_call
from moemesh.proto.v1 import expert_pb2

from .loopback import LoopbackTransport, random_experts

NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER, TOP_K = 2, 8, 32, 16, 3
WORKERS = ["w0", "w1", "w2", "w3"]


def routing(num_tokens: int, seed: int = 1, hot: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    if hot is not None:
        logits[:, hot] += 10.0  # every token picks the hot expert
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    return x, ids, weights.float()


def identity(workers: list[str], version: int = 1) -> Placement:
    return make_placement(version, np.tile(np.arange(NUM_EXPERTS), (NUM_LAYERS, 1)), workers, NUM_EXPERTS)


def hot_doubled(workers: list[str], hot: int, version: int = 2) -> Placement:
    """12 slots over 3 or 4 workers: every expert once, the hot one a second time far away."""
    row = [*range(NUM_EXPERTS), hot, (hot + 1) % NUM_EXPERTS, (hot + 2) % NUM_EXPERTS, (hot + 3) % NUM_EXPERTS]
    return make_placement(version, np.tile(row, (NUM_LAYERS, 1)), workers, NUM_EXPERTS)


def executors(placement: Placement, dtype=torch.float32, workers=WORKERS):
    experts = random_experts(NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER, dtype)
    transport = LoopbackTransport(experts, list(workers))
    transport.load(placement)
    local = LocalExpertExecutor(experts, ExpertPlacement.from_placement(placement))
    return local, RemoteExpertExecutor(transport, RemotePlacement(placement)), transport, experts


FP32 = dict(rtol=1e-6, atol=1e-7)  # a reassociated float32 sum of <= top_k terms
BF16 = dict(rtol=2**-7, atol=2**-14)  # one bf16 ulp: the float32 sums may round to neighbours


def close(dtype) -> dict:
    return FP32 if dtype == torch.float32 else BF16


@pytest.fixture(params=["C", "numpy"])
def dispatch_path(request, monkeypatch):
    """The dispatch plan and the worker's checks in C (kernels/csrc/moe_dispatch.c), or with numpy (no
    compiler: the front door answers None)."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "plan_expert_dispatch", lambda *a: None)
        monkeypatch.setattr(kernels, "check_expert_groups", lambda *a: None)
    elif not kernels.build_expert_dispatch_kernel():
        pytest.skip("no C compiler")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_workers_match_the_local_executor_within_reassociation_error(dtype, dispatch_path):
    local, remote, transport, _ = executors(identity(WORKERS[:2]), dtype, WORKERS[:2])
    x, ids, weights = routing(37)
    for layer in range(NUM_LAYERS):
        x_in = x.to(dtype)
        ours, theirs = remote.forward(layer, x_in, ids, weights), local.forward(layer, x_in, ids, weights)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours, theirs, **close(dtype))
    assert sorted(set(transport.calls)) == [("w0", 0), ("w0", 1), ("w1", 0), ("w1", 1)]  # one call per worker per layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_worker_holding_every_expert_equals_the_local_executor_bit_for_bit(dtype, dispatch_path):
    """A single worker sums every entry of a token in the local kernel's order: no reassociation.
    In bf16 it also rounds that sum itself (the sole partial): half the reply bytes, same bits."""
    local, remote, _, _ = executors(identity(WORKERS[:1]), dtype, workers=WORKERS[:1])
    x, ids, weights = routing(37)
    x = x.to(dtype)
    assert torch.equal(remote.forward(0, x, ids, weights), local.forward(0, x, ids, weights))
    assert remote.num_bytes_received == x.numel() * dtype.itemsize  # the reply came in x's dtype


@pytest.mark.parametrize("owned", [True, False])
def test_a_sole_partial_is_returned_without_a_copy_only_when_nothing_else_holds_its_memory(owned):
    """The socket transport's replies own their bytes (`owned`); others' may be a reused buffer."""
    _, remote, transport, _ = executors(identity(WORKERS[:1]), torch.bfloat16, WORKERS[:1])
    replies, submit = [], transport.submit

    class Answered:
        def __init__(self, reply):
            self.reply = reply

        def result(self):
            return self.reply

    def marking(worker_id, request, timeout_s):
        replies.append(dataclasses.replace(submit(worker_id, request, timeout_s).result(), owned=owned))
        return Answered(replies[-1])

    transport.submit = marking
    x, ids, weights = routing(5)
    out = remote.forward(0, x.to(torch.bfloat16), ids, weights)
    assert torch.equal(out, replies[0].outputs)
    assert (out.data_ptr() == replies[0].outputs.data_ptr()) == owned


def test_the_sole_partial_flag_survives_the_protobuf_transports():
    x, _, _ = routing(2)
    request = ExpertRequest(
        0,
        1,
        x.bfloat16(),
        *(np.array(v, dtype=np.int32) for v in ([0], [0], [2], [0, 1])),
        torch.ones(2),
        outputs_in_input_dtype=True,
    )
    assert request_from_proto(request_to_proto(request)).outputs_in_input_dtype
    request.outputs_in_input_dtype = False
    assert not request_from_proto(request_to_proto(request)).outputs_in_input_dtype


def float64_reference(experts, layer, x, ids, weights) -> torch.Tensor:  # [num_tokens, hidden] float64
    w13, w2 = experts[layer].w13.double(), experts[layer].w2.double()
    expected = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (w13[ids[t, j]] @ x[t].double()).chunk(2)
            expected[t] += weights[t, j].double() * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    return expected


def test_four_workers_are_as_close_to_float64_as_the_local_executor():
    local, remote, _, experts = executors(identity(WORKERS))
    x, ids, weights = routing(24)
    expected = float64_reference(experts, 0, x, ids, weights)
    remote_error = (remote.forward(0, x, ids, weights).double() - expected).abs().max()
    local_error = (local.forward(0, x, ids, weights).double() - expected).abs().max()
    assert remote_error <= 2 * local_error + 1e-7, (remote_error, local_error)


def test_remote_layer_matches_a_float64_reference():
    _, remote, _, experts = executors(identity(WORKERS[:2]), workers=WORKERS[:2])
    x, ids, weights = routing(9)
    w13, w2 = experts[1].w13.double(), experts[1].w2.double()
    expected = torch.zeros(9, HIDDEN, dtype=torch.float64)
    for t in range(9):
        for j in range(TOP_K):
            gate, up = (w13[ids[t, j]] @ x[t].double()).chunk(2)
            expected[t] += weights[t, j].double() * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(remote.forward(1, x, ids, weights).double(), expected, rtol=1e-5, atol=1e-5)


def test_a_hot_expert_with_two_replicas_splits_its_tokens_evenly_and_outputs_stay_identical(dispatch_path):
    hot = 5
    placement = hot_doubled(WORKERS[:3], hot)
    local, remote, transport, _ = executors(placement, workers=WORKERS[:3])
    x, ids, weights = routing(40, hot=hot)
    torch.testing.assert_close(remote.forward(0, x, ids, weights), local.forward(0, x, ids, weights), **FP32)
    slots = placement.log2phy[0, hot, :2]  # slot 5 on w1, slot 8 on w2
    counts = {}
    for store in transport.stores.values():
        hosted = store.get(placement.version)
        for local_index, slot in enumerate(hosted.slots):
            counts[int(slot)] = int(hosted.token_counts[0, local_index])
    assert [counts[int(s)] for s in slots] == [20, 20]
    identity_out = LocalExpertExecutor(transport_weights(transport)).forward(0, x, ids, weights)
    torch.testing.assert_close(remote.forward(0, x, ids, weights), identity_out, rtol=1e-6, atol=1e-6)


def transport_weights(transport):
    store = next(iter(transport.stores.values()))
    weights = store._read_weights({(0, e) for e in range(NUM_EXPERTS)})
    from .loopback import LayerWeights

    return [
        LayerWeights(
            torch.stack([weights[(0, e)][0] for e in range(NUM_EXPERTS)]),
            torch.stack([weights[(0, e)][1] for e in range(NUM_EXPERTS)]),
        )
    ]


def test_a_dead_worker_is_routed_around_when_its_experts_have_replicas_elsewhere(dispatch_path):
    placement = make_placement(3, np.tile(np.arange(NUM_EXPERTS).repeat(2), (NUM_LAYERS, 1)), WORKERS, NUM_EXPERTS)
    local, remote, transport, _ = executors(placement)  # each expert twice, on neighbouring slots
    # slots 2k, 2k+1 hold expert k: w0 owns 0..3 (experts 0, 1), w1 4..7 (2, 3), ...: no redundancy across workers
    redundant = Placement(
        version=4,
        num_experts=NUM_EXPERTS,
        worker_ids=tuple(WORKERS),
        slot_owner=np.tile(np.arange(4), 4),
        phy2log=placement.phy2log,
    )
    transport.load(redundant)
    remote.set_placement(RemotePlacement(redundant))
    x, ids, weights = routing(30)
    transport.dead.add("w1")
    out = remote.forward(0, x, ids, weights)
    torch.testing.assert_close(out, local.forward(0, x, ids, weights), rtol=1e-6, atol=1e-6)
    assert remote.num_rerouted_entries > 0
    calls_before = len(transport.calls)
    remote.forward(1, x, ids, weights)  # w1 is marked down: no failed call first
    assert "w1" not in {w for w, _ in transport.calls[calls_before:]}


def test_a_dead_worker_holding_the_only_replica_fails_the_layer_with_the_worker_and_experts_named():
    _, remote, transport, _ = executors(identity(WORKERS[:2]), workers=WORKERS[:2])
    transport.dead.add("w1")
    x, ids, weights = routing(16)
    with pytest.raises(ExpertUnavailableError, match=r"expert worker w1 .*UNAVAILABLE.*experts \[4, 5, 6, 7\]"):
        remote.forward(0, x, ids, weights)


def test_a_new_placement_is_adopted_at_the_first_moe_layer_only():
    _, remote, transport, _ = executors(identity(WORKERS[:2]), workers=WORKERS[:2])
    nxt = identity(WORKERS[:2], version=7)
    transport.load(nxt)
    x, ids, weights = routing(4)
    remote.set_placement(RemotePlacement(nxt))
    assert remote.placement.version == 1 and remote.version == 7
    remote.forward(1, x, ids, weights)
    assert remote.placement.version == 1  # mid-forward: unchanged
    remote.forward(0, x, ids, weights)
    assert remote.placement.version == 7


def test_the_rehearsal_a_layer_leaves_with_its_transport_plans_again_without_effects(dispatch_path):
    """A polling transport may run it any number of times while it waits for the replies."""
    _, remote, transport, _ = executors(hot_doubled(WORKERS, hot=2), workers=WORKERS)
    rehearsals = []
    transport.set_rehearsal = rehearsals.append
    x, ids, weights = routing(37, hot=2)
    out = remote.forward(0, x, ids, weights)
    calls, sent, counts = list(transport.calls), remote.num_bytes_sent, remote.compute_s
    for _ in range(3):
        rehearsals[-1]()
    assert transport.calls == calls and remote.num_bytes_sent == sent and remote.compute_s == counts
    assert torch.equal(remote.forward(0, x, ids, weights), out)
    assert len(rehearsals) == 2  # one per layer submitted


def test_reroute_spreads_moved_entries_over_the_live_replicas():
    replicas = np.array([0, 0, 0, 1])
    experts = np.array([0, 0, 0, 1])
    log2phy = np.array([[0, 2, 3], [1, -1, -1]])
    moved, stranded = reroute(replicas, experts, np.array([True, False, False, False]), log2phy, np.array([3, 1]))
    assert moved.tolist() == [2, 3, 2, 1] and stranded == []
    _, stranded = reroute(replicas, experts, np.array([False, True, False, False]), log2phy, np.array([3, 1]))
    assert stranded == [1]


def test_worker_batches_send_each_token_once_and_group_entries_by_replica():
    replica_ids = np.array([[0, 3], [3, 1], [2, 0]])  # 3 tokens, top-2; slots 0, 1 on worker 0, slots 2, 3 on worker 1
    owner = np.array([0, 0, 1, 1])
    entries = sort_entries(replica_ids, replica_ids, owner)
    for batches in (
        group_by_worker(entries.replicas, entries.experts, entries.tokens, np.arange(6), owner),
        split_by_worker(entries, owner, num_tokens=3),
    ):
        w0, w1 = batches
        assert w0.token_ids.tolist() == [0, 1, 2] and w0.slots.tolist() == [0, 1] and w0.group_sizes.tolist() == [2, 1]
        assert w0.token_ids[w0.row_ids].tolist() == [0, 2, 1]
        assert w1.token_ids.tolist() == [0, 1, 2] and w1.slots.tolist() == [2, 3]
        assert w1.token_ids[w1.row_ids].tolist() == [2, 0, 1]


@pytest.mark.parametrize("seed", range(20))
def test_the_presorted_split_equals_the_general_grouping_for_any_slot_ownership(seed):
    """split_by_worker (runs of the (worker, replica) sort, tokens by counting) against
    group_by_worker (its own sort and np.unique), with workers owning interleaved slots, tokens
    that reach only some workers, and workers that get nothing."""
    rng = np.random.default_rng(seed)
    num_tokens, top_k, num_slots = int(rng.integers(1, 40)), int(rng.integers(1, 9)), int(rng.integers(8, 40))
    num_workers = int(rng.integers(1, 6))
    owner = rng.integers(0, num_workers, num_slots)  # not contiguous
    replica_ids = np.stack([rng.choice(num_slots, top_k, replace=False) for _ in range(num_tokens)])
    experts = replica_ids % 7
    entries = sort_entries(replica_ids, experts, owner)
    assert np.array_equal(entries.replicas, replica_ids.reshape(-1)[entries.order])
    assert np.all(np.diff(owner[entries.replicas]) >= 0)  # worker-major
    expected = group_by_worker(
        entries.replicas, entries.experts, entries.tokens, np.arange(entries.replicas.size), owner
    )
    got = split_by_worker(entries, owner, num_tokens)
    assert [b.worker for b in got] == [b.worker for b in expected]
    for a, b in zip(got, expected, strict=True):
        for field in ("positions", "token_ids", "row_ids", "slots", "experts", "group_sizes"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_the_expert_worker_refuses_malformed_or_misrouted_calls_with_the_right_status(dispatch_path):
    _, _, transport, _ = executors(identity(WORKERS[:2]), workers=WORKERS[:2])
    store = transport.stores["w0"]
    x = tensor_to_proto(torch.zeros(2, HIDDEN))

    def call(**kw):
        fields = (
            dict(
                layer=0,
                placement_version=1,
                hidden_states=x,
                group_slots=[0],
                group_experts=[0],
                group_rows=[2],
                row_ids=[0, 1],
            )
            | kw
        )
        with pytest.raises(CallError) as info:
            parse_call(store, decode_request(expert_pb2.RunExpertsRequest(**fields)))  # the gRPC paths' check
        return info.value.code, str(info.value)

    assert call(placement_version=9)[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert call(layer=5)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert call(group_slots=[6], group_experts=[6]) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "slots [6] are not expert worker w0's in placement 1",
    )
    assert call(group_slots=[1], group_experts=[0])[0] == grpc.StatusCode.FAILED_PRECONDITION  # slot 1 holds 1
    assert call(group_rows=[2, 0]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "group_slots, group_experts and group_rows must have one value per group, got 1, 1 and 2",
    )
    assert call(row_ids=[0, 2])[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert call(group_slots=[-1])[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert call(group_slots=[0, 1], group_experts=[0, 1], group_rows=[3, -1], row_ids=[0, 1])[0] == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert call(hidden_states=expert_pb2.Tensor(dtype="float32", shape=[2, HIDDEN], data=b"\0" * 8))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_a_data_plane_gets_the_reply_before_the_worker_counts_its_tokens_and_they_count_even_if_sending_fails():
    _, _, transport, _ = executors(identity(WORKERS[:2]), workers=WORKERS[:2])
    servicer = ExpertServicer(transport.stores["w0"], status=lambda: None)
    x, _, _ = routing(3)
    request = ExpertRequest(
        1, 1, x, *(np.array(v, dtype=np.int32) for v in ([0, 2], [0, 2], [2, 1], [0, 2, 1])), torch.ones(3)
    )
    counts_at_delivery = []

    def deliver(reply):
        counts_at_delivery.append(servicer.total_counts.copy())
        raise ConnectionResetError("the attention worker went away")

    try:
        with pytest.raises(ConnectionResetError):
            servicer.answer_blocking(request, deliver)
        assert counts_at_delivery[0].sum() == 0  # counting came after the reply was handed over
        assert servicer.total_counts[1].tolist() == [2, 0, 1, 0, 0, 0, 0, 0]
        assert servicer.num_in_flight == 0
        reply = servicer.answer_blocking(request)  # no data plane: returned, counted the same
        assert reply.outputs.shape == (3, HIDDEN) and servicer.total_counts[1, 0] == 4
    finally:
        servicer.close()


def test_a_serving_worker_records_the_failure_and_the_forward_finishes_with_zeros():
    experts = random_experts(NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER)
    transport = LoopbackTransport(experts, WORKERS[:2])
    placement = identity(WORKERS[:2])
    transport.load(placement)
    remote = RemoteExpertExecutor(transport, RemotePlacement(placement), on_error="record")
    x, ids, weights = routing(8)
    transport.dead.add("w0")
    assert not remote.forward(0, x, ids, weights).any()
    calls = len(transport.calls)
    assert not remote.forward(1, x, ids, weights).any() and len(transport.calls) == calls  # rest of the forward skipped
    assert "expert worker w0" in str(remote.take_error()) and remote.take_error() is None
    transport.dead.clear()
    remote._down_until.clear()  # the retry delay has passed
    expected = LocalExpertExecutor(experts).forward(0, x, ids, weights)
    torch.testing.assert_close(remote.forward(0, x, ids, weights), expected, **FP32)
