"""GGUF blocks kept quantized (loader/gguf_blocks.py, layers/quantized_linear.py) against the
oracle `gguf.quants.dequantize`: exact storage, matmuls within the rounding of their dtype
(float64 reference), and no full-precision copy of a weight left in the module."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from moemesh import kernels
from moemesh.engine import dtype as engine_dtype
from moemesh.engine.layers import quantized_linear
from moemesh.engine.layers.quantized_linear import GEMV_MAX_M, QuantizedEmbedding, QuantizedLinear
from moemesh.engine.loader.gguf_blocks import read_blocks
from moemesh.kernels import group_gemv  # only to take its library away: a machine without a C compiler

N, K = 96, 512  # K: two K-quant super-blocks
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# module bytes / GGUF bytes. Q8_0, Q4_1: the file's own layout. Q4_0: its min (-8 d) is stored too.
# K-quants: d * sc_j needs > 11 bits, so per-group scales (and Q4_K's mins) are float32 (float32
# form) or bf16 (bf16 form), and Q6_K's 6-bit codes take a byte each.
MAX_BYTES_RATIO = {"Q8_0": 1.0, "Q4_0": 1.12, "Q4_1": 1.0, "Q4_K": 1.34, "Q6_K": 1.53}


def gguf_blocks(qtype: str, seed: int = 0, n: int = N) -> np.ndarray:
    """GGUF bytes [N, bytes per row]: `gguf.quants.quantize` of a random matrix where gguf can
    quantize the type; random codes and sub-scales with sane fp16 super-scales otherwise."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        return quants.quantize(rng.standard_normal((n, K)).astype(np.float32), kind)
    block_bytes = {"Q4_K": 144, "Q6_K": 210}[qtype]
    data = rng.integers(0, 256, (n, K // 256 * block_bytes), dtype=np.uint8)
    blocks = data.reshape(-1, block_bytes)
    scales = (rng.uniform(0.5, 2.0, (blocks.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":
        blocks[:, 0:4] = scales  # d, dmin
    else:
        blocks[:, 208:210] = scales[:, :2]  # d
    return data


def reference(data: np.ndarray, qtype: str) -> torch.Tensor:  # [N, K] float64
    return torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[qtype]).astype(np.float64))


def loaded(qtype: str, dtype: torch.dtype, gather: bool = False, n: int = N) -> tuple[QuantizedLinear, np.ndarray]:
    data = gguf_blocks(qtype, n=n)
    module = QuantizedLinear(K, n)
    module.load(read_blocks(data, qtype, (n, K)), dtype, gather=gather)
    return module, data


def stored_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.buffers()) + list(module.parameters())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_read_as_codes_and_scales_dequantize_bit_for_bit_like_gguf(qtype):
    data = gguf_blocks(qtype)
    ours = read_blocks(data, qtype, (N, K)).dequantize()
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[qtype])))


def float32_form(qtype: str, n: int) -> str:
    """The form weights of n rows take with float32 activations on this machine."""
    block_n = kernels.blocks_block_n()
    if block_n and n % block_n == 0:
        return "blocks"
    return "nibbles" if qtype.startswith("Q4") else "int8"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("num_tokens", [1, 16])  # the C GEMV, dequantize + dense
@pytest.mark.parametrize("n", [128, 80])  # code blocks (with AVX2 or AVX-512), GGUF's row layouts
def test_float32_matmul_equals_the_float64_product_with_ggufs_weights_within_float32_rounding(qtype, num_tokens, n):
    module, data = loaded(qtype, torch.float32, n=n)
    assert module.form == float32_form(qtype, n)
    x = torch.randn(num_tokens, K, generator=torch.Generator().manual_seed(1))
    w = reference(data, qtype)
    bound = (x.double().abs() @ w.abs().T) * 1e-5  # a few float32 ulps of the summed magnitudes
    assert ((module(x).double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 16])  # 3: the C GEMV, and int4pack below a full block of 4 rows
def test_bfloat16_matmul_is_within_bfloat16_rounding_of_the_float64_product(qtype, num_tokens):
    module, data = loaded(qtype, torch.bfloat16)
    x = torch.randn(num_tokens, K, generator=torch.Generator().manual_seed(2))
    w = reference(data, qtype)
    y = module(x.bfloat16())
    assert y.dtype == torch.bfloat16
    bound = (x.double().abs() @ w.abs().T) * 2e-2  # bf16 input, scales and output: ~3 roundings of 2^-9
    assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_full_precision_weight_is_left_and_bytes_stay_near_the_files(qtype, dtype):
    module, data = loaded(qtype, dtype)
    floating = [b for b in module.buffers() if b.is_floating_point()]
    assert all(b.numel() < N * K // 8 for b in floating), [(b.dtype, tuple(b.shape)) for b in floating]
    assert {b.dtype for b in module.buffers() if not b.is_floating_point()} <= {torch.uint8, torch.int8}
    assert stored_bytes(module) <= MAX_BYTES_RATIO[qtype] * data.nbytes, stored_bytes(module) / data.nbytes


def test_four_bit_weights_use_the_int4pack_kernel_in_bfloat16_and_dequantize_per_call_in_float32():
    assert loaded("Q4_1", torch.bfloat16)[0].form == "int4pack"  # 96 rows: no blocks of 64
    assert loaded("Q4_K", torch.bfloat16)[0].form == "int4pack"
    expected = "blocks" if quantized_linear.bf16_code_blocks() else "int4pack"  # AVX512-BF16, no AMX
    assert loaded("Q4_1", torch.bfloat16, n=128)[0].form == expected


def test_bfloat16_weights_stay_int4pack_on_cpus_with_amx(monkeypatch):
    """AMX's tile GEMM (oneDNN) multiplies int4pack's rebuilt bf16 weight faster than the code
    blocks' vector dot products."""
    monkeypatch.setattr(engine_dtype, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert loaded("Q4_1", torch.bfloat16, n=128)[0].form == "int4pack"
    assert loaded("Q4_1", torch.float32, n=128)[0].form == float32_form("Q4_1", 128)  # float32 keeps its blocks
    assert loaded("Q4_1", torch.float32, n=80)[0].form == "nibbles"  # 80 rows: blocks of neither 32 nor 64
    assert loaded("Q4_1", torch.float32, n=128)[0].form == float32_form("Q4_1", 128)
    assert loaded("Q8_0", torch.float32, n=128)[0].form == float32_form("Q8_0", 128)
    assert loaded("Q4_1", torch.bfloat16, gather=True)[0].form == "nibbles"  # embeddings gather rows
    assert loaded("Q6_K", torch.bfloat16)[0].form == "int8"


def test_scales_keep_ggufs_float16_when_exact_and_float32_for_k_quant_products():
    assert loaded("Q4_1", torch.float32)[0].scales.dtype == torch.float16
    assert loaded("Q4_K", torch.float32)[0].scales.dtype == torch.float32


def test_without_a_c_compiler_weights_dequantize_per_call_logged_once_per_type(monkeypatch, caplog):
    monkeypatch.setattr(group_gemv, "library", lambda: None)  # every front-door function sees no library
    with caplog.at_level(logging.INFO, logger="moemesh.engine.layers.quantized_linear"):
        module, data = loaded("Q4_0", torch.float32)
        loaded("Q4_0", torch.float32)
    lines = [r.getMessage() for r in caplog.records if "Q4_0" in r.getMessage()]
    assert len(lines) == 1 and "dequantizing per call" in lines[0]
    x = torch.randn(2, K)
    w = reference(data, "Q4_0")
    bound = (x.double().abs() @ w.abs().T) * 1e-5
    assert ((module(x).double() - x.double() @ w.T).abs() <= bound).all()


def test_decode_rows_use_the_c_gemv_and_larger_rounds_dequantize(monkeypatch):
    if not kernels.quantized_kernels_built():
        pytest.skip("no C compiler here")
    module, _ = loaded("Q8_0", torch.bfloat16)
    calls = []
    real = kernels.quantized_gemv
    monkeypatch.setattr(kernels, "quantized_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    module(torch.randn(GEMV_MAX_M, K).bfloat16())
    module(torch.randn(GEMV_MAX_M + 1, K).bfloat16())
    assert calls == [GEMV_MAX_M]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tall_weight_is_dequantized_and_multiplied_in_chunks_of_bounded_bytes(dtype, monkeypatch):
    """Past CHUNK_ROWS rows (an lm_head) each chunk holds CHUNK_BYTES (at least 256 rows): here 600
    rows in chunks of 256, 256 and 88, each rebuilt into one scratch buffer; the product is the
    whole weight's."""
    module, data = loaded("Q8_0", dtype, n=600)
    monkeypatch.setattr(quantized_linear, "CHUNK_ROWS", 300)
    monkeypatch.setattr(quantized_linear, "CHUNK_BYTES", 100 * K * 4)  # under the 256-row floor
    sizes = []
    real = module.dequantize_rows
    monkeypatch.setattr(
        module, "dequantize_rows", lambda rows, *a, **k: sizes.append(rows.stop - rows.start) or real(rows, *a, **k)
    )
    x = torch.randn(GEMV_MAX_M + 4, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y, w = module(x), reference(data, "Q8_0")
    assert sizes == [256, 256, 88] and y.shape == (GEMV_MAX_M + 4, 600)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((y.double() - x.double() @ w.T).abs() <= (x.double().abs() @ w.abs().T) * tolerance).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_bfloat16_four_bit_rounds_above_the_gemvs_rows_dequantize_the_int4pack_layout(qtype, monkeypatch):
    """N a multiple of int4pack's row blocks: up to GEMV_MAX_M rows run int4pack's own kernel,
    more rebuild W^T from its layout in C and multiply densely; both within bf16 rounding of GGUF's
    weights in float64. N = 80 (a multiple of neither 32 nor 64) keeps int4pack at every row count.
    (Where AVX512-BF16 gives bfloat16 weights code blocks instead, they are hidden here.)"""
    if not kernels.quantized_kernels_built() or kernels.int4pack_block_n() is None:
        pytest.skip("no C compiler or an unknown int4pack layout here")
    monkeypatch.setattr(kernels, "blocks_bf16_gemm", lambda: False)
    module, data = loaded(qtype, torch.bfloat16, n=256)
    assert module.form == "int4pack" and module.block_n == kernels.int4pack_block_n()
    calls = []
    real = kernels.int4pack_dequantize
    monkeypatch.setattr(kernels, "int4pack_dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(quantized_linear, "CHUNK_ROWS", 128)  # two column chunks
    w = reference(data, qtype)
    for m, dequantized in ((GEMV_MAX_M, False), (GEMV_MAX_M + 1, True), (40, True)):
        calls.clear()
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = module(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 256) and bool(calls) == dequantized
        bound = (x.double().abs() @ w.abs().T) * 2e-2
        assert ((y.double() - x.double() @ w.T).abs() <= bound).all()
    odd, data = loaded(qtype, torch.bfloat16, n=80)
    x = torch.randn(16, K).bfloat16()
    calls.clear()
    y, w = odd(x), reference(data, qtype)
    assert odd.block_n is None and not calls
    assert ((y.double() - x.double() @ w.T).abs() <= (x.double().abs() @ w.abs().T) * 2e-2).all()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_bfloat16_code_blocks_are_within_bfloat16_rounding_of_the_float64_product(qtype):
    """With AVX512-BF16, bfloat16 weights of 64-row blocks are code blocks: the GEMV (float32 sums
    of x's values), and the GEMM's bfloat16 dot products of W rounded to bfloat16."""
    if not quantized_linear.bf16_code_blocks():
        pytest.skip("no AVX512-BF16 GEMM for code blocks on this CPU (or AMX)")
    module, data = loaded(qtype, torch.bfloat16, n=128)
    assert module.form == "blocks"
    w = reference(data, qtype)
    for m in (1, 3, 16):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = module(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 128)
        bound = (x.double().abs() @ w.abs().T) * 2e-2  # bf16 weights and output: ~2 roundings of 2^-9
        assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [96, 128])  # float32 4-bit: nibbles (AVX-512) or blocks; blocks
def test_the_c_dequantizer_gives_the_torch_paths_rows_bit_for_bit(qtype, dtype, n):
    if not kernels.quantized_kernels_built():
        pytest.skip("no C compiler here")
    module, _ = loaded(qtype, dtype, gather=True, n=n)
    ids = torch.tensor([5, 0, 95, 5])
    for rows in (slice(None), slice(3, 40), ids):
        assert torch.equal(module.dequantize_rows(rows, dtype), module._dequantize_rows_torch(rows, dtype))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_float32_four_bit_rounds_run_the_blocks_gemv_then_the_blocks_gemm(qtype, monkeypatch):
    """Nibble blocks: up to BLOCKS_GEMV_MAX_M rows run the blocks' GEMV, more the blocks' GEMM; both
    within float32 rounding of GGUF's weights in float64, and no full-precision weight is kept."""
    block_n = kernels.blocks_block_n()
    if block_n is None:
        pytest.skip("no vector loops for nibble blocks on this CPU")
    module, data = loaded(qtype, torch.float32, n=640)
    assert module.form == "blocks" and module.block_n == block_n and module.scales.shape == (K // 32, 640)
    assert stored_bytes(module) <= MAX_BYTES_RATIO[qtype] * data.nbytes
    calls = []
    for name in ("blocks_gemv", "blocks_gemm"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda x, *a, real=real, name=name, **k: calls.append((name, x.shape[0])) or real(x, *a, **k)
        )
    w = reference(data, qtype)
    rows = (1, quantized_linear.BLOCKS_GEMV_MAX_M, quantized_linear.BLOCKS_GEMV_MAX_M + 1, GEMV_MAX_M + 1, 40)
    for m in rows:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        y = module(x)
        assert y.dtype == torch.float32 and y.shape == (m, 640)
        assert ((y.double() - x.double() @ w.T).abs() <= (x.double().abs() @ w.abs().T) * 1e-5).all()
    gemv_rows = [m for m in rows if m <= quantized_linear.BLOCKS_GEMV_MAX_M]
    assert calls == [("blocks_gemv" if m in gemv_rows else "blocks_gemm", m) for m in rows]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
@pytest.mark.parametrize("n", [96, 128])
def test_quantized_embedding_gathers_exactly_ggufs_rows(qtype, n):
    data = gguf_blocks(qtype, n=n)
    embedding = QuantizedEmbedding(n, K, torch.float32)
    embedding.table.load(read_blocks(data, qtype, (n, K)), torch.float32, gather=True)
    ids = torch.tensor([5, 0, 95, 5])
    assert torch.equal(embedding(ids), reference(data, qtype)[ids].float())
