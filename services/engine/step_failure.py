"""What a worker's engine thread does when a step's expert executor recorded an error (a remote
expert worker is gone and some expert it held has no other replica): that round's outputs and
the KV it wrote are garbage.

The executor records instead of raising, so every round completes and the engine's state stays
consistent (with execution overlap the next round is already in flight). The thread then drops
the step's outputs, fails every unfinished request (they all need the missing experts, or will
at their next step) and the requests those outputs belonged to, and forgets every prefix-cache
key, also of blocks still held for a KV export (blocks are keyed when allocated, so the failed
round's blocks were keyed; none of them may be a prefix hit later). The engine then
serves new requests as usual; they fail fast until the expert worker is back (or a new placement
routes around it).
"""

from __future__ import annotations

import logging

from moemesh.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def take_expert_error(engine: LLMEngine) -> Exception | None:
    """The error the model's expert executor recorded during the step, if any (cleared)."""
    runtime = getattr(engine.model, "moe_runtime", None)
    return None if runtime is None else runtime.executor.take_error()


def fail_unfinished_requests(engine: LLMEngine) -> list[str]:
    """Abort every unfinished request (freeing its blocks), forget the prefix cache; returns the
    aborted request ids. Called by AsyncEngine's thread right after the failed `step()`."""
    request_ids = [rid for rid, request in engine.scheduler.requests.items() if not request.is_finished]
    engine.abort_request(request_ids)
    held = engine.kv_cache_manager.num_used_blocks  # e.g. finished prefills waiting for their KV export
    engine.kv_cache_manager.pool.reset_prefix_cache(even_in_use=True)  # the index resyncs ("cleared")
    if held:
        logger.info("prefix cache forgotten after a failed step, also the keys of %d blocks still held", held)
    return request_ids
