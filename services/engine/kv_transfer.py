"""KV transfer between a prefill worker P and a decode worker D: the wire layout, the copy out of
and into the paged cache, and the transport interface.

Wire format of one transfer: for each cache tensor of each attention layer, in layer order, the
KV of tokens [start, end) as [num_tokens, *token_shape] contiguous in the cache dtype; the
tensors are concatenated into one byte buffer. Both sides must have the same `KVLayout` (same
model, dtype and per-token shapes); block size and block ids may differ, since the copy goes
through each side's own slot mapping (slot = block_table[t // P] * P + t % P).

Who calls what, when:
- P's engine thread calls `gather_kv` on a finished request whose blocks are held
  (`Request.kv_export_start`), right after the step that finished it, then frees the blocks.
- D's servicer calls `KVTransport.fetch` for each request the scheduler parked in
  WAITING_FOR_REMOTE_KV; D's engine thread then calls `scatter_kv` (via
  `LLMEngine.finish_remote_prefill`) to write the received bytes into the request's blocks.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

import torch

from moemesh.engine.request import Logprob


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


def cache_tensors(model) -> list[torch.Tensor]:
    """Every KV cache tensor of the model, in layer order: [num_blocks, block_size, *token_shape].
    (Attention layers bind `k_cache` and `v_cache`; MLA layers one `kv_cache`.)"""
    tensors = []
    for layer in model.attention_layers():
        tensors.extend([layer.k_cache, layer.v_cache] if hasattr(layer, "k_cache") else [layer.kv_cache])
    return tensors


def kv_layout(model, model_id: str) -> KVLayout:
    tensors = cache_tensors(model)
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    return KVLayout(model_id, dtype, tuple(tuple(t.shape[2:]) for t in tensors))


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
    pieces = [(kind, offset, torch.tensor(ids, dtype=torch.int64)) for kind, offset, ids in
              _pieces(block_ids, block_size, start, end)]  # fmt: skip
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


def scatter_kv(tensors: list[torch.Tensor], block_ids: list[int], block_size: int, start: int, end: int,
               buffer: torch.Tensor) -> None:  # fmt: skip
    """Write a flat byte buffer (the wire format) into the cache at tokens [start, end) of `block_ids`."""
    num_tokens = end - start
    pieces = [(kind, offset, torch.tensor(ids, dtype=torch.int64)) for kind, offset, ids in
              _pieces(block_ids, block_size, start, end)]  # fmt: skip
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


@dataclass
class ExportedKV:
    """What P's engine hands its servicer for one finished request."""

    request_id: str
    first_token_id: int
    first_logprob: Logprob | None
    num_tokens: int  # tokens of KV in `data`
    num_cached_tokens: int  # prompt tokens P served from its own prefix cache
    data: torch.Tensor  # [num_bytes] uint8, the wire format


@dataclass(frozen=True)
class RemotePrefillTask:
    """D asks P (at `endpoint`) to prefill `prompt_token_ids` and send the KV from token
    `num_computed_tokens` on (D already holds the tokens before)."""

    endpoint: str
    request_id: str
    prompt_token_ids: list[int]
    sampling: object  # the transport's wire form of the sampling parameters
    num_computed_tokens: int
    layout: KVLayout
    timeout_s: float
    metadata: tuple[tuple[str, str], ...] = field(default=())  # e.g. trace context


@dataclass
class RemoteKV:
    """The result of a transfer, handed to `LLMEngine.finish_remote_prefill`."""

    first_token_id: int
    first_logprob: Logprob | None
    num_tokens: int
    num_cached_tokens: int  # prompt tokens P did not recompute
    data: torch.Tensor  # [num_bytes] uint8, the wire format


class KVTransport(abc.ABC):
    """Moves KV from prefill workers to this decode worker. Called by the decode servicer (in
    its asyncio loop), once per request parked in WAITING_FOR_REMOTE_KV; cancelling the call
    must cancel the transfer and free the blocks on P. Implementations: `GrpcKVTransport`
    (moemesh.worker.kv_client, streaming over gRPC); RDMA/NIXL later."""

    @abc.abstractmethod
    async def fetch(self, task: RemotePrefillTask) -> RemoteKV:
        """Prefill on P and receive the KV plus the first token; raises KVTransferError."""

    async def close(self) -> None:  # noqa: B027 - optional hook; the default holds nothing
        """Release connections; called once at worker shutdown."""


class NullKVTransport(KVTransport):
    """No prefill workers: every fetch fails, so D prefills locally (aggregated serving)."""

    async def fetch(self, task: RemotePrefillTask) -> RemoteKV:
        raise KVTransferError("no KV transport configured")
