"""KV transfer between a prefill worker P and a decode worker D: the wire layout, the copy out of
and into the paged cache, and the transport interface.

Wire format of one transfer: for each cache tensor of each attention layer, in layer order, the
KV of tokens [start, end) as [num_tokens, *token_shape] contiguous in the cache dtype; the
tensors are concatenated into one byte buffer. Both sides must have the same `KVLayout` (same
model, dtype and per-token shapes); block size and block ids may differ, since the copy goes
through each side's own slot mapping (slot = block_table[t // P] * P + t % P).

The layout is tensor-major, so a prefix of a transfer's bytes is not a prefix of its tokens: a
transfer moves as `KVPiece`s, each the wire format of its own token range [start, end); the pieces
of one transfer are contiguous and in token order, and a piece never splits a token.

Who calls what, when (the connector is remote_prefill.py):
- P's engine thread (the connector's `save_kv`, after each round) calls `gather_kv` for the tokens
  of an exporting request that round completed (whole blocks; the tail once the request finished,
  then its blocks are freed). P's servicer cuts each piece to the message size (`split_kv`) and
  streams it at once; the first token (`FirstToken`) comes last.
- D's connector calls `KVTransport.fetch` (in the worker's event loop) for each request it parked
  for remote KV and adds what arrives to a `RemoteKV`; D's engine thread then calls `scatter_kv`
  per piece it keeps (the connector's `get_finished`): all of them when the transfer completed,
  the whole pieces before the last prompt token when it failed (the rest is prefilled locally).
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import torch

from moemesh.engine.connectors.base import FirstToken, KVCaches, KVConnectorEvent


class KVTransferError(Exception):
    """A transfer failed (peer gone, timeout, layout mismatch); D falls back to a local prefill."""


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # 'float32' | 'bfloat16' | 'float16'
    token_shapes: tuple[tuple[int, ...], ...]  # per cache tensor, in layer order

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def bytes_per_token(self) -> int:
        return sum(math.prod(shape) for shape in self.token_shapes) * self.element_size


def kv_layout(caches: KVCaches) -> KVLayout:
    """The wire layout of the engine's paged KV (a transfer moves its one cache group)."""
    (group,) = caches.groups
    dtype = str(group.tensors[0].dtype).removeprefix("torch.")
    return KVLayout(caches.model_id, dtype, tuple(tuple(t.shape[2:]) for t in group.tensors))


def _pieces(block_ids: list[int], block_size: int, start: int, end: int):
    """Split tokens [start, end) into per-token head/tail slots and whole blocks in between:
    yields (offset in the transfer, slot ids) for single tokens and (offset, block ids) for runs
    of full blocks, so most of the copy moves whole blocks (block_size tokens per row)."""
    first_full = min(-(-start // block_size) * block_size, end)
    last_full = max(end // block_size * block_size, first_full)

    def slots(a: int, b: int) -> list[int]:
        return [block_ids[t // block_size] * block_size + t % block_size for t in range(a, b)]

    if first_full > start:
        yield "tokens", 0, slots(start, first_full)
    if last_full > first_full:
        yield "blocks", first_full - start, block_ids[first_full // block_size : last_full // block_size]
    if end > last_full:
        yield "tokens", last_full - start, slots(last_full, end)


def gather_kv(tensors: list[torch.Tensor], block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Copy the KV of tokens [start, end) (in blocks `block_ids`) into one flat byte buffer (the wire format)."""
    num_tokens = end - start
    sizes = [num_tokens * math.prod(t.shape[2:]) * t.element_size() for t in tensors]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8)  # [num_bytes]
    pieces = [
        (kind, offset, torch.tensor(ids, dtype=torch.int64))
        for kind, offset, ids in _pieces(block_ids, block_size, start, end)
    ]
    offset = 0
    for tensor, size in zip(tensors, sizes):
        shape = tensor.shape[2:]
        out = buffer[offset : offset + size].view(tensor.dtype).view(num_tokens, *shape)  # [num_tokens, *token_shape]
        for kind, at, ids in pieces:
            if kind == "blocks":
                dst = out[at : at + len(ids) * block_size].view(len(ids), block_size, *shape)
                torch.index_select(tensor, 0, ids, out=dst)
            else:
                torch.index_select(tensor.view(-1, *shape), 0, ids, out=out[at : at + len(ids)])
        offset += size
    return buffer


def scatter_kv(
    tensors: list[torch.Tensor], block_ids: list[int], block_size: int, start: int, end: int, buffer: torch.Tensor
) -> None:
    """Write a flat byte buffer (the wire format) into the cache at tokens [start, end) of `block_ids`."""
    num_tokens = end - start
    pieces = [
        (kind, offset, torch.tensor(ids, dtype=torch.int64))
        for kind, offset, ids in _pieces(block_ids, block_size, start, end)
    ]
    offset = 0
    for tensor in tensors:
        shape = tensor.shape[2:]
        size = num_tokens * math.prod(shape) * tensor.element_size()
        src = buffer[offset : offset + size].view(tensor.dtype).view(num_tokens, *shape)  # [num_tokens, *token_shape]
        for kind, at, ids in pieces:
            if kind == "blocks":
                tensor.index_copy_(0, ids, src[at : at + len(ids) * block_size].view(len(ids), block_size, *shape))
            else:
                tensor.view(-1, *shape).index_copy_(0, ids, src[at : at + len(ids)])
        offset += size
    assert offset == buffer.numel(), f"buffer has {buffer.numel()} bytes, the tokens take {offset}"


def split_kv(data: torch.Tensor, layout: KVLayout, start: int, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """Cut the wire format of tokens [start, start + n) into the wire formats of consecutive
    token ranges of at most `max_bytes` each (at least one token): yields (first token, bytes)."""
    token_bytes = [math.prod(shape) * layout.element_size for shape in layout.token_shapes]
    num_tokens = data.numel() // layout.bytes_per_token
    assert num_tokens * layout.bytes_per_token == data.numel(), "a transfer holds whole tokens"
    step = max(1, max_bytes // layout.bytes_per_token)
    view = memoryview(data.numpy())
    for a in range(0, num_tokens, step):
        b = min(a + step, num_tokens)
        parts, offset = [], 0
        for size in token_bytes:  # each cache tensor's section, then the range's rows within it
            parts.append(view[offset + a * size : offset + b * size])
            offset += num_tokens * size
        yield start + a, b"".join(parts)


@dataclass
class KVPiece:
    """The KV of tokens [start, start + num_tokens) in the wire format."""

    start: int
    num_tokens: int
    data: torch.Tensor  # [num_tokens * bytes_per_token] uint8

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class ExportedKV(KVConnectorEvent):
    """What P's connector hands its servicer (through the request's stream) for an exporting
    request, after each round that completed some of its tokens; the last one carries the first
    token (its blocks are freed then)."""

    piece: KVPiece  # may be empty (0 tokens) on the last one
    first_token: FirstToken | None = None


class RemoteKV:
    """D's record of one transfer for tokens [start, end): the pieces received so far (contiguous
    from `start`), and the first token once P finished. `add` rejects anything out of order."""

    def __init__(self, start: int, end: int, bytes_per_token: int):
        self.start = start
        self.end = end
        self.bytes_per_token = bytes_per_token
        self.pieces: list[KVPiece] = []
        self.first_token: FirstToken | None = None

    @property
    def num_received_tokens(self) -> int:
        return (self.pieces[-1].end if self.pieces else self.start) - self.start

    @property
    def complete(self) -> bool:
        return self.first_token is not None

    def add(self, item: KVPiece | FirstToken) -> None:
        """Raises KVTransferError on a piece that does not continue the received ones, a wrong
        size, anything after the first token, or a first token before all the KV."""
        received = self.start + self.num_received_tokens
        if self.complete:
            raise KVTransferError("data after the first token")
        if isinstance(item, FirstToken):
            if received != self.end:
                raise KVTransferError(f"first token after {received - self.start} of {self.end - self.start} tokens")
            self.first_token = item
            return
        if item.start != received or item.end > self.end or item.num_tokens <= 0:
            raise KVTransferError(f"KV of tokens [{item.start}, {item.end}) after [{self.start}, {received})")
        if item.data.numel() != item.num_tokens * self.bytes_per_token:
            raise KVTransferError(f"KV of {item.num_tokens} tokens in {item.data.numel()} bytes")
        self.pieces.append(item)

    def pieces_before(self, token: int) -> list[KVPiece]:
        """The received pieces that end at or before `token` (a prefix of them)."""
        return [p for p in self.pieces if p.end <= token]


@dataclass(frozen=True)
class RemotePrefillTask:
    """D asks P (at `endpoint`) to prefill `prompt_token_ids` and send the KV from token
    `num_computed_tokens` on (D already holds the tokens before). The transfer fails when
    nothing arrives for `idle_timeout_s`, or when it is not done after `timeout_s` in all."""

    endpoint: str
    request_id: str
    prompt_token_ids: list[int]
    sampling: object  # the transport's wire form of the sampling parameters
    num_computed_tokens: int
    layout: KVLayout
    timeout_s: float
    idle_timeout_s: float
    metadata: tuple[tuple[str, str], ...] = field(default=())  # e.g. trace context


class KVTransport(abc.ABC):
    """Moves KV from prefill workers to this decode worker. Called by the remote-prefill
    connector (in the worker's event loop), once per request it parked for remote KV; closing the
    iterator must cancel the transfer and free the blocks on P. Implementations: `GrpcKVTransport`
    (moemesh.worker.kv_client, streaming over gRPC); RDMA/NIXL later."""

    @abc.abstractmethod
    def fetch(self, task: RemotePrefillTask) -> AsyncIterator[KVPiece | FirstToken]:
        """Prefill on P, yielding the KV as it arrives (contiguous pieces in token order from
        `task.num_computed_tokens`), then the first token; raises KVTransferError on a failure
        (what was yielded before stays valid). Closing the iterator early cancels the transfer."""

    async def close(self) -> None:  # noqa: B027 - optional hook; the default holds nothing
        """Release connections; called once at worker shutdown."""


class NullKVTransport(KVTransport):
    """No prefill workers: every fetch fails, so D prefills locally (aggregated serving)."""

    async def fetch(self, task: RemotePrefillTask) -> AsyncIterator[KVPiece | FirstToken]:
        raise KVTransferError("no KV transport configured")
        yield  # an async generator that fails at once
