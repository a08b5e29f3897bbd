"""moemesh.kernels: the compute functions the engine calls.

Each kernel module holds a plain-torch reference (`*_ref`, the CPU path and the test oracle's
shape) and, where written, a Triton kernel with a typed launcher; the C kernels (csrc/) each
have a loader module that builds them on the machine that runs them. Code outside this package
calls only what is re-exported here: `dispatch.py` picks Triton on CUDA, the C kernel where it
is built and reads the tensors, and the reference elsewhere. Importing this package never
requires a GPU or a C compiler.
"""

from moemesh.kernels.dispatch import (
    build_expert_dispatch_kernel,
    build_grouped_moe_kernel,
    check_expert_groups,
    fp8_fused_moe,
    fp8_linear,
    fused_add_rms_norm,
    fused_moe,
    group_dequantize,
    grouped_moe,
    grouped_topk,
    int4_llama_decode_token,
    llama_decode_built,
    mla_decode_attention,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    plan_expert_dispatch,
    quantized_gemv,
    quantized_kernels_built,
    rms_norm,
    rotary_embedding,
    store_kv_cache,
    topk_softmax,
)
from moemesh.kernels.fp8 import FP8_DTYPE, block_dequant_ref, cdiv

# C only: their layouts (int4pack's, code blocks) are chosen only where the library reads them,
# which int4pack_block_n / blocks_block_n say (None elsewhere)
from moemesh.kernels.group_gemv import (
    blocks_bf16_gemm,
    blocks_block_n,
    blocks_gather,
    blocks_gemm,
    blocks_gemv,
    int4pack_block_n,
    int4pack_dequantize,
)
from moemesh.kernels.group_quant import blocks_from_codes, codes_from_blocks, codes_from_nibbles, nibbles_from_codes
from moemesh.kernels.llama_decode import INT4_FORMATS, Int4Dims, Int4Layer
from moemesh.kernels.moe_dispatch import DispatchPlan, LayerTables
from moemesh.kernels.paged_attention import DecodePlan

__all__ = [
    "FP8_DTYPE",
    "INT4_FORMATS",
    "DecodePlan",
    "DispatchPlan",
    "Int4Dims",
    "Int4Layer",
    "LayerTables",
    "block_dequant_ref",
    "blocks_bf16_gemm",
    "blocks_block_n",
    "blocks_from_codes",
    "blocks_gather",
    "blocks_gemm",
    "blocks_gemv",
    "build_expert_dispatch_kernel",
    "build_grouped_moe_kernel",
    "cdiv",
    "check_expert_groups",
    "codes_from_blocks",
    "codes_from_nibbles",
    "fp8_fused_moe",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "group_dequantize",
    "grouped_moe",
    "grouped_topk",
    "int4_llama_decode_token",
    "int4pack_block_n",
    "int4pack_dequantize",
    "llama_decode_built",
    "mla_decode_attention",
    "nibbles_from_codes",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_expert_dispatch",
    "quantized_gemv",
    "quantized_kernels_built",
    "rms_norm",
    "rotary_embedding",
    "store_kv_cache",
    "topk_softmax",
]
