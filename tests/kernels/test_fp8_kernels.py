"""Block-scaled FP8 (DeepSeek-V3 format): quantizers, torch references and Triton kernels.

Can the Triton 3.9 interpreter emulate fp8? Checked before writing these: float8e4nv loads and
fp8 x fp8 `tl.dot` (fp32 accumulate) interpret exactly; the fp32 -> float8e4nv cast does not
(a rounding carry into the exponent is lost: 127.0 -> 64.0; ties go away from zero; overflow
wraps). The kernels therefore round to the e4m3 grid in fp32 before casting (fp8.py), and every
Triton kernel here is tested for real under TRITON_INTERPRET=1 on CPU tensors, against float64
oracles. The oracles decode e4m3 from its bit layout and round by table lookup, independently
of torch's float8 conversions. The sm_90 compile test checks the same kernels build for
H100/H200 at DeepSeek-V3 sizes within shared memory; a `gpu`-marked test runs them on CUDA.
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import TOLERANCES, assert_close_f64
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moemesh.kernels import dispatch
from moemesh.kernels.fp8 import FP8_DTYPE, act_quant_ref, act_quant_triton, block_dequant_ref, block_quant_ref
from moemesh.kernels.fp8_gemm import (
    fp8_gemm_ref,
    fp8_gemm_triton,
    fp8_linear_triton,
    fp8_linear_w8a8_ref,
    fp8_linear_w8a16_ref,
)
from moemesh.kernels.fp8_moe import fp8_fused_moe_triton, fp8_fused_moe_w8a8_ref, fp8_fused_moe_w8a16_ref

B = 128  # DeepSeek-V3's block (128, 128)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: a shared CPU's thread pool costs more than it gives."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


SHAPES = [(1, 256, 384), (5, 320, 256), (33, 256, 320)]  # (M, N, K): ragged N = 320, ragged K = 320


def _e4m3_table() -> torch.Tensor:
    """[127] float64: the non-negative finite e4m3fn values, by code 0..126 (ascending)."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


E4M3 = _e4m3_table()


def _nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 y -> the nearest e4m3 value, ties to the even code, saturated at 448."""
    mag = y.abs().clamp(max=448.0)
    hi = torch.searchsorted(E4M3, mag).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - E4M3[lo], E4M3[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, E4M3[hi], E4M3[lo]) * torch.where(y < 0, -1.0, 1.0)


def _expand(scale: torch.Tensor, rows: int, cols: int, block=(B, B)) -> torch.Tensor:
    """A block-scale grid gathered per element (float64 [rows, cols])."""
    return scale.double()[torch.arange(rows)[:, None] // block[0], torch.arange(cols)[None, :] // block[1]]


def _weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 weight, scale_inv, and its exact float64 value; blocks of very different magnitude."""
    w = torch.randn(n, k) * k**-0.5 * torch.logspace(-3, 0, -(-n // B))[:, None].repeat_interleave(B, 0)[:n]
    q, scale_inv = block_quant_ref(w)
    return q, scale_inv, q.double() * _expand(scale_inv, n, k)


def _dequant_x(x_q, x_scale) -> torch.Tensor:
    return x_q.double() * _expand(x_scale, *x_q.shape, block=(1, B))


def test_e4m3_table_is_how_torch_decodes_float8_e4m3fn():
    decoded = torch.arange(127, dtype=torch.uint8).view(FP8_DTYPE).double()
    assert torch.equal(decoded, E4M3) and E4M3[-1] == 448.0


def _activations(m: int, k: int, dtype) -> torch.Tensor:
    x = torch.randn(m, k) * torch.logspace(-3, 2, m)[:, None]
    if m >= 5:
        x[1] = 0.0  # an all-zero token: zeros, no division by zero
        x[2, :B] = E4M3[torch.randint(0, 127, (B,))] * torch.where(torch.rand(B) < 0.5, -1.0, 1.0)
        x[2, 0] = 448.0  # scale exactly 1: exact e4m3 values pass through
        x[3, :B] = (E4M3[1:].repeat(2)[:B] + E4M3[:-1].repeat(2)[:B]) / 2  # midpoints: ties to even
        x[3, 0] = -448.0
        x[4, :8] = torch.tensor([448.0, 127.0, 126.9, 124.0, 3e-3, 2.93e-3, 1e-3, -0.015])  # carries, subnormals
    return x.to(dtype)


@pytest.mark.parametrize("m, k", [(1, 256), (5, 320), (33, 128)])
def test_act_quant_ref_scales_by_group_amax_and_rounds_to_nearest_e4m3(m, k):
    x = _activations(m, k, torch.float32)
    x_q, x_scale = act_quant_ref(x)
    groups = F.pad(x.double(), (0, -k % B)).view(m, -1, B)
    amax = groups.abs().amax(-1).clamp(min=1e-10)
    torch.testing.assert_close(x_scale.double(), amax / 448, rtol=2**-23, atol=0)
    quotient = (x / _expand(x_scale, m, k, (1, B)).float()).double()  # the fp32 quotient both paths compute
    assert torch.equal(x_q.double(), _nearest_e4m3(quotient))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k", [(1, 256), (5, 320), (33, 128)])
def test_triton_act_quant_gives_the_reference_bits(m, k, dtype):
    x = _activations(m, k, dtype)
    x_q, x_scale = act_quant_triton(x)
    ref_q, ref_scale = act_quant_ref(x)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(x_scale, ref_scale)


def test_quantizers_round_trip_within_e4m3_relative_error():
    """|x - dequant(quant(x))| <= 2^-4 |x| (half an e4m3 ulp) + half a subnormal step of the scale."""
    x = _activations(33, 320, torch.float32)
    x_q, x_scale = act_quant_ref(x)
    s = _expand(x_scale, 33, 320, (1, B))
    assert ((x.double() - _dequant_x(x_q, x_scale)).abs() <= 2**-4 * x.double().abs() + s * 2**-10).all()
    w = torch.randn(320, 384) * torch.logspace(-4, 1, 320)[:, None]
    q, scale_inv = block_quant_ref(w)
    s = _expand(scale_inv, 320, 384)
    assert ((w.double() - q.double() * s).abs() <= 2**-4 * w.double().abs() + s * 2**-10).all()
    assert q.float().abs().amax() == 448.0


def test_block_dequant_ref_is_the_weight_times_its_block_scale():
    q, scale_inv, expected = _weight(320, 200)  # both dims ragged
    torch.testing.assert_close(
        block_dequant_ref(q, scale_inv).double(), expected, rtol=2**-24, atol=0
    )  # one fp32 rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_w8a16_reference_matches_the_float64_oracle(m, n, k, dtype):
    q, scale_inv, w = _weight(n, k)
    x = torch.randn(m, k, dtype=dtype)
    for tile_rows in (128, None):  # one block row per tile; the default bound (whole weight here)
        assert_close_f64(fp8_linear_w8a16_ref(x, q, scale_inv, tile_rows=tile_rows), x.double() @ w.t(), dtype)


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_w8a8_reference_is_the_product_of_quantized_activations_and_weights(m, n, k):
    q, scale_inv, w = _weight(n, k)
    x = torch.randn(m, k)
    x_q, x_scale = act_quant_ref(x)
    assert_close_f64(
        fp8_gemm_ref(x_q, x_scale, q, scale_inv, tile_rows=128), _dequant_x(x_q, x_scale) @ w.t(), torch.float32
    )
    assert_close_f64(fp8_linear_w8a8_ref(x, q, scale_inv), _dequant_x(x_q, x_scale) @ w.t(), torch.float32)


def test_w8a8_error_from_activation_quantization_is_within_its_bound():
    q, scale_inv, w = _weight(320, 384)
    x = _activations(33, 384, torch.float32)
    _, x_scale = act_quant_ref(x)
    bound = (2**-4 * x.double().abs() + _expand(x_scale, 33, 384, (1, B)) * 2**-10) @ w.abs().t()
    error = (fp8_linear_w8a8_ref(x, q, scale_inv).double() - x.double() @ w.t()).abs()
    assert (error <= bound * 1.001 + 1e-6).all()
    assert error.max() > 1e-4  # the activations really were quantized


class _AllocationLog(TorchDispatchMode):
    """Bytes of every storage an aten op creates while active: the largest one and the peak live total."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, list] = {}  # storage address -> [nbytes, number of live tensors on it]
        self.largest = self.peak = 0
        self.fp8_upcasts: list[tuple[int, ...]] = []  # shapes of fp8 -> float conversions

    def _release(self, key: int) -> None:
        self.refs[key][1] -= 1
        if self.refs[key][1] == 0:
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == FP8_DTYPE:
            self.fp8_upcasts.append(tuple(out.shape))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key in inputs and key not in self.refs:
                    continue  # a view of the caller's tensors (a slice of the weight), not an allocation
                entry = self.refs.setdefault(key, [t.untyped_storage().nbytes(), 0])
                entry[1] += 1
                weakref.finalize(t, self._release, key)
                self.largest = max(self.largest, entry[0])
        self.peak = max(self.peak, sum(nbytes for nbytes, _ in self.refs.values()))
        return out


def test_reference_linears_never_materialise_the_whole_dequantized_weight():
    n, k, m = 1024, 512, 5
    q, scale_inv, _ = _weight(n, k)
    x = torch.randn(m, k)
    full, tile = n * k * 4, B * k * 4  # bytes of the fp32 dequantized weight and of one 128-row tile
    with _AllocationLog() as control:
        block_dequant_ref(q, scale_inv)
    assert control.largest >= full  # the probe sees a materialised weight
    for linear in (fp8_linear_w8a16_ref, fp8_linear_w8a8_ref):
        with _AllocationLog() as log:
            linear(x, q, scale_inv, tile_rows=B)
        assert log.fp8_upcasts.count((B, k)) == n // B  # the weight went through in 128-row tiles
        assert log.largest <= tile
        assert log.peak <= 3 * tile < full


def _moe_inputs(dtype, num_tokens, num_experts=4, hidden=256, inter=192, top_k=2):
    """inter = 192: the gate and the up half each have a ragged scale block, and w2's K is ragged."""
    gates, ups, downs = [], [], []
    for _ in range(num_experts):
        gates.append(block_quant_ref(torch.randn(inter, hidden) * hidden**-0.5))
        ups.append(block_quant_ref(torch.randn(inter, hidden) * hidden**-0.5))
        downs.append(block_quant_ref(torch.randn(hidden, inter) * inter**-0.5))
    w13 = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gates, ups)])  # [E, 2 * inter, hidden]
    w13_scale_inv = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gates, ups)])  # [E, 2 * 2, 2]
    w2, w2_scale_inv = torch.stack([d[0] for d in downs]), torch.stack([d[1] for d in downs])
    x = torch.randn(num_tokens, hidden).to(dtype)
    topk_ids = torch.rand(num_tokens, num_experts - 1).argsort(dim=1)[:, :top_k].contiguous()  # expert 3 unused
    topk_weights = torch.rand(num_tokens, top_k) + 0.1
    if num_tokens >= 5:
        topk_ids[1, 1] = -1  # a skipped slot; its weight is ignored
        topk_weights[1, 1] = float("nan")
        topk_ids[3] = -1  # every slot skipped: zeros
    return x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids


def _naive_moe(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, quantize_activations):
    """float64, one (token, slot) at a time; W8A8 quantizes x (act_quant_ref) and the activation
    (amax / 448 per group, nearest e4m3) in float64."""
    inter, hidden = w2.shape[2], w2.shape[1]
    xs = _dequant_x(*act_quant_ref(x)) if quantize_activations else x.double()
    half = -(-inter // B)
    gates = [w13[e, :inter].double() * _expand(w13_scale_inv[e, :half], inter, hidden) for e in range(w13.shape[0])]
    ups = [w13[e, inter:].double() * _expand(w13_scale_inv[e, half:], inter, hidden) for e in range(w13.shape[0])]
    downs = [w2[e].double() * _expand(w2_scale_inv[e], hidden, inter) for e in range(w2.shape[0])]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gate, up = gates[e] @ xs[t], ups[e] @ xs[t]
            act = F.silu(gate) * up  # [inter]
            if quantize_activations:
                groups = F.pad(act, (0, -inter % B)).view(-1, B)
                scale = groups.abs().amax(-1, keepdim=True) / 448
                act = (_nearest_e4m3(groups / scale) * scale).flatten()[:inter]
            out[t] += float(topk_weights[t, j]) * (downs[e] @ act)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_triton_fp8_fused_moe_matches_the_float64_w8a8_oracle(num_tokens, dtype):
    inputs = _moe_inputs(dtype, num_tokens)
    out = fp8_fused_moe_triton(*inputs, block_m=16)
    expected = _naive_moe(*inputs, quantize_activations=True)
    assert_close_f64(out, expected, dtype)
    assert_close_f64(fp8_fused_moe_w8a8_ref(*inputs), expected, dtype)
    if num_tokens >= 5:
        assert out[3].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_fused_moe_reference_matches_the_float64_oracle(dtype):
    inputs = _moe_inputs(dtype, 33)
    assert_close_f64(fp8_fused_moe_w8a16_ref(*inputs), _naive_moe(*inputs, quantize_activations=False), dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_triton_fp8_gemm_matches_the_float64_blocked_product(m, n, k, out_dtype):
    q, scale_inv, w = _weight(n, k)
    x_q, x_scale = act_quant_ref(torch.randn(m, k))
    out = fp8_gemm_triton(x_q, x_scale, q, scale_inv, out_dtype)
    assert_close_f64(out, _dequant_x(x_q, x_scale) @ w.t(), out_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_linear_is_the_w8a8_reference(dtype):
    q, scale_inv, w = _weight(320, 384)
    x = torch.randn(33, 384, dtype=dtype)
    expected = _dequant_x(*act_quant_ref(x)) @ w.t()
    assert_close_f64(fp8_linear_triton(x, q, scale_inv), expected, dtype)


def test_launchers_and_references_reject_malformed_block_scales():
    q, scale_inv, _ = _weight(320, 256)
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match=r"scale_inv must have shape \[3, 2\]"):
        fp8_linear_w8a16_ref(x, q, scale_inv[:2])
    with pytest.raises(ValueError, match="weight must be one of"):
        fp8_linear_w8a8_ref(x, q.float(), scale_inv)
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 256\]"):
        fp8_linear_triton(x[:, :128], q, scale_inv)
    with pytest.raises(ValueError, match="tile_rows must be a positive multiple"):
        fp8_linear_w8a16_ref(x, q, scale_inv, tile_rows=100)
    with pytest.raises(ValueError, match="block_k a power of two"):
        fp8_linear_triton(x, q, scale_inv[:, :1].repeat(1, 3), block=(128, 96))
    inputs = list(_moe_inputs(torch.float32, 5))
    inputs[2] = inputs[2][:, :3]  # gate and up blocked together: ceil(2 * 192 / 128) = 3 blocks, not 2 + 2
    with pytest.raises(ValueError, match=r"w13_scale_inv must have shape \[4, 4, 2\]"):
        fp8_fused_moe_triton(*inputs)


def test_dispatch_takes_the_w8a16_reference_on_cpu_for_any_leading_dims():
    q, scale_inv, w = _weight(320, 256)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    y = dispatch.fp8_linear(x, q, scale_inv)
    assert y.shape == (2, 3, 320)
    assert torch.equal(y.view(6, 320), fp8_linear_w8a16_ref(x.view(6, 256), q, scale_inv))
    inputs = _moe_inputs(torch.bfloat16, 5)
    assert torch.equal(dispatch.fp8_fused_moe(*inputs), fp8_fused_moe_w8a16_ref(*inputs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_paths_run_the_triton_kernels_and_match_the_w8a8_references(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, scale_inv, _ = _weight(576, 7168)  # DeepSeek-V3 wkv_a: ragged N
    x = torch.randn(64, 7168, dtype=torch.bfloat16)
    args = [t.cuda() for t in (x, q, scale_inv)]
    torch.testing.assert_close(dispatch.fp8_linear(*args), fp8_linear_w8a8_ref(*args), rtol=1.6e-2, atol=1.6e-2)
    inputs = _moe_inputs(torch.bfloat16, 33)
    expected = _naive_moe(*inputs, quantize_activations=True)  # float64, on the CPU
    cuda_inputs = [t.cuda() for t in inputs]
    out, ref = dispatch.fp8_fused_moe(*cuda_inputs).cpu(), fp8_fused_moe_w8a8_ref(*cuda_inputs).cpu()
    # each against the oracle, so a failure names the side that is off and the tokens it hits
    tol = TOLERANCES[torch.bfloat16]
    for name, actual in (("triton", out), ("w8a8_ref", ref)):
        excess = ((actual.double() - expected).abs() - tol["rtol"] * expected.abs()).amax(dim=1)  # [num_tokens]
        bad = [(t, round(float(excess[t]), 4)) for t in excess.argsort(descending=True)[:4].tolist()]
        assert excess.max() <= tol["atol"], f"{name} on CUDA vs the float64 oracle, worst tokens: {bad}"


def test_fp8_kernels_compile_for_sm90_at_deepseek_v3_sizes(monkeypatch, tmp_path):
    """As test_sm90_compile_kernels: the launchers' own tile choices, compiled for sm_90 on the CPU."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton's CUDA backend is not installed")
    import kernel_sm90_compile
    from triton.runtime.jit import JITFunction

    from moemesh.kernels import fp8, fp8_gemm, fp8_moe

    if not isinstance(triton.language.standard.sum, JITFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1")
    monkeypatch.setitem(kernel_sm90_compile._PTR, FP8_DTYPE, "*fp8e4nv")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = []
    for module in (fp8, fp8_gemm, fp8_moe):
        monkeypatch.setattr(
            module, "launch", lambda *a, **k: compiled.append(kernel_sm90_compile.compile_launch(*a, **k))
        )
        monkeypatch.setattr(module, "check_launchable", lambda *a: None)  # meta tensors stand in for CUDA ones

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    hidden, inter, experts, top_k = 7168, 2048, 256, 8
    for m in (1, 64, 4096):  # decode, large decode, prefill tiles
        fp8_linear_triton(
            empty(m, hidden), empty(2 * inter, hidden, dtype=FP8_DTYPE), empty(32, 56, dtype=torch.float32)
        )
    moe_weights = (
        empty(experts, 2 * inter, hidden, dtype=FP8_DTYPE),
        empty(experts, 32, 56, dtype=torch.float32),
        empty(experts, hidden, inter, dtype=FP8_DTYPE),
        empty(experts, 56, 16, dtype=torch.float32),
    )
    for t in (16, 4096):
        fp8_fused_moe_triton(
            empty(t, hidden), *moe_weights, empty(t, top_k, dtype=torch.float32), empty(t, top_k, dtype=torch.int64)
        )
    names = [r["name"] for r in compiled]
    gemm = ["_act_quant_kernel", "_fp8_gemm_kernel"]
    moe = [
        "_moe_align_kernel",
        "_act_quant_kernel",
        "_fp8_moe_gate_up_kernel",
        "_fp8_moe_down_kernel",
        "_moe_combine_kernel",
    ]
    assert names == gemm * 3 + moe * 2, names
