"""Prefix identity of KV-cache blocks, shared by engines and the router.

A full block of P tokens has the key

    K_i = sha256(K_{i-1} || token_ids_i || extra)        (K_{-1} = b"")

where `token_ids_i` are the block's P token ids written as little-endian int64 and `extra` is the
canonical encoding of what else changes the KV content: the model id and an optional cache salt
(and later an adapter id). Two requests share block i iff they share every token of blocks
0..i and the same extra. The function is pure and deterministic across processes and machines
(no Python `hash()`), so a router can compute the chain an engine will cache.

Only full blocks have keys; a prompt of n tokens has n // P of them.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

BlockHash = bytes  # 32-byte sha256 digest


@dataclass(frozen=True)
class HashExtra:
    """What besides the tokens identifies cached KV: the model and an optional salt."""

    model_id: str
    cache_salt: str = ""

    def encode(self) -> bytes:
        model = self.model_id.encode("utf-8")
        salt = self.cache_salt.encode("utf-8")
        return struct.pack("<I", len(model)) + model + struct.pack("<I", len(salt)) + salt


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes) -> BlockHash:
    """Key of one full block given its parent's key (None for the first block)."""
    h = hashlib.sha256()
    h.update(parent or b"")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


def hash_block_chain(
    token_ids: list[int],
    block_size: int,
    extra: HashExtra,
    parent: BlockHash | None = None,
    start: int = 0,
) -> list[BlockHash]:
    """Keys of every full block of `token_ids`, starting at token `start` (a multiple of
    block_size) whose parent key is `parent`. Extending a chain: pass the last key and its end."""
    assert start % block_size == 0, "chains start at block boundaries"
    encoded_extra = extra.encode()
    keys: list[BlockHash] = []
    for block_start in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[block_start : block_start + block_size], encoded_extra)
        keys.append(parent)
    return keys
