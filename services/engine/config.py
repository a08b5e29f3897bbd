"""Engine configuration: a few typed dataclasses, validated once, then frozen.

Values measured at start-up (how many KV blocks fit) live in `CacheBudget`, never written back
into the config. No environment variable is read here or anywhere in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.engine.errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_QUANTIZATION = ("auto", "gguf", "none")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how to run it."""

    model: str  # GGUF file or Hugging Face directory
    dtype: str = "auto"  # "auto": bfloat16 where the hardware has it natively, else float32 (engine/dtype.py)
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's context length
    seed: int = 0
    load_routed_experts: bool = True  # False: MoE experts run elsewhere (remote executor), skip their weights
    # Ping-pong micro-batch overlap of MoE models: a round of >= 2 requests runs as two micro-batches
    # so one's attention runs while the other's routed experts run. None: when the expert
    # executor runs them asynchronously (remote experts), on for each round shape where it is
    # measured faster (engine/overlap_tuner.py); True / False: always / never.
    micro_batch_overlap: bool | None = None
    # A GGUF file's quantized weights. "gguf": they stay quantized in memory
    # (layers/quantized_linear.py); "none": dequantized to `dtype` at load; "auto": "gguf" on the
    # CPU for bfloat16 (PyTorch's int4pack) and for float32 where the C kernels build
    # (kernels/group_gemv.c: as fast as dense float32 at 64 rows, ~3x at one), else "none".
    # Other checkpoints are unaffected.
    quantization: str = "auto"

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATION:
            raise ConfigError(f"quantization must be one of {_QUANTIZATION}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: P = block_size tokens per block; pool size by count or memory budget."""

    block_size: int = 16
    num_blocks: int | None = None  # exact pool size (the null block included); wins over memory
    memory_gib: float = 2.0  # KV memory budget when num_blocks is None
    enable_prefix_caching: bool = True
    cache_salt: str = ""  # mixed into every block key; isolates tenants sharing a worker

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (one is the null block), got {self.num_blocks}")
        if self.num_blocks is None and self.memory_gib <= 0:
            raise ConfigError(f"memory_gib must be > 0, got {self.memory_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: per-round budget B_t = max_num_batched_tokens.

    `async_scheduling` (execution overlap): the scheduler prepares round t+1 and the engine
    processes round t-1's outputs while the model runs round t on a worker thread. It is not
    combined with speculative decoding (drafts need the previous round's tokens); with
    speculation on, rounds run one after another.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each round"
            )


_SPEC_METHODS = ("none", "ngram", "draft", "mtp")
_SPEC_SCHEDULING = ("fixed", "confidence")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: who drafts, how many tokens at most, and how many to verify
    (`fixed`: every draft up to k; `confidence`: DSpark's expected-throughput rule).

    `ngram` drafts by prompt lookup; `draft` runs `draft_model` (a GGUF file or HF directory with
    the target's vocabulary), optionally cut to its first `draft_num_layers` layers (a
    self-speculative draft of the target itself), in `draft_dtype` (None: the target's), with its
    own KV cache of `draft_kv_memory_gib`; `mtp` drafts with the target checkpoint's own
    multi-token-prediction layer (DeepSeek-V3 `num_nextn_predict_layers`) from the target's hidden
    states, in the target's dtype, with its own KV cache of `draft_kv_memory_gib`."""

    method: str = "none"
    num_speculative_tokens: int = 4
    scheduling: str = "confidence"
    ngram_min_n: int = 2
    ngram_max_n: int = 4
    draft_model: str | None = None
    draft_dtype: str | None = None
    draft_num_layers: int | None = None
    draft_kv_memory_gib: float = 0.5

    def __post_init__(self):
        if self.method not in _SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {_SPEC_METHODS}, got {self.method!r}")
        if self.scheduling not in _SPEC_SCHEDULING:
            raise ConfigError(f"speculative scheduling must be one of {_SPEC_SCHEDULING}, got {self.scheduling!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ConfigError(f"need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative method 'draft' needs draft_model (a GGUF file or HF directory)")
        if self.method != "draft" and self.draft_model:
            raise ConfigError(f"draft_model is only used with speculative method 'draft', not {self.method!r}")
        if self.draft_dtype is not None and self.draft_dtype not in _DTYPES:
            raise ConfigError(f"draft_dtype must be one of {_DTYPES}, got {self.draft_dtype!r}")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ConfigError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.draft_kv_memory_gib <= 0:
            raise ConfigError(f"draft_kv_memory_gib must be > 0, got {self.draft_kv_memory_gib}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)


@dataclass(frozen=True)
class CacheBudget:
    """Measured at start-up from the model's KV size per block and the configured budget."""

    num_blocks: int  # including the reserved null block 0
    block_size: int
    bytes_per_block: int  # all layers, K and V

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1
