"""moemesh.kernels: the compute functions the engine calls.

Each kernel module holds a plain-torch reference (`*_ref`, the CPU path and the test oracle's
shape) and, where written, a Triton kernel with a typed launcher. The engine calls only the
dispatch functions re-exported here; `dispatch.py` picks Triton on CUDA and the reference
elsewhere. Importing this package never requires a GPU.
"""

from moemesh.kernels.dispatch import (
    fused_add_rms_norm,
    fused_moe,
    grouped_moe,
    grouped_topk,
    mla_decode_attention,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary_embedding,
    store_kv_cache,
    topk_softmax,
)

__all__ = [
    "fused_add_rms_norm",
    "fused_moe",
    "grouped_moe",
    "grouped_topk",
    "mla_decode_attention",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "store_kv_cache",
    "topk_softmax",
]
