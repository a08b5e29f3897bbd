"""Engine configuration: defined once in `moemesh.runtime.engine_config` (torch-free, so the CLI,
the workers' settings and the operator read the same definition) and re-exported here.

Values measured at start-up (how many KV blocks fit) live in `CacheBudget`, never written back
into the config. No environment variable is read here or anywhere in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.runtime.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig

__all__ = ["CacheBudget", "CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig", "SpecConfig"]


@dataclass(frozen=True)
class CacheBudget:
    """Measured at start-up from the model's KV size per block and the configured budget."""

    num_blocks: int  # including the reserved null block 0
    block_size: int
    bytes_per_block: int  # all layers, K and V

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1
