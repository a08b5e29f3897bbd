"""A fixed pool of KV blocks: ref counts, an LRU free queue, and the prefix-cache map.

Block 0 is the reserved null block: never handed out, used to pad block tables. A freed block
keeps its key and stays findable until it is taken again from the head of the free queue
(eviction), so the least recently freed cached block is evicted first.
"""

from __future__ import annotations

from moemesh.contracts.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and remove anywhere
    (a cached free block that gets a prefix hit leaves the queue from the middle)."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail, "no free block"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        assert num_blocks >= 2
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request (the null block excluded)."""
        return len(self.blocks) - 1 - self.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= self.num_free_blocks, f"asked for {num_blocks}, {self.num_free_blocks} free"
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict its cached content
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a full block's key. If another block already holds the same content, this one
        stays unkeyed (it is freed as an ordinary block)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail in the given
        order (callers pass a request's blocks tail-first so its prefix is evicted last)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0 and block is not self.null_block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self, even_in_use: bool = False) -> bool:
        """Forget every cached key; only when no block is in use, unless `even_in_use` (a failed
        round's KV: blocks still held, e.g. for a KV export, stay allocated but unfindable and
        return to the free queue unkeyed)."""
        if self.num_used_blocks and not even_in_use:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True
