"""csrc/llama_decode.c `int4_llama_decode_token` on a tiny random two-layer Llama stack against a float64
forward written here, for each build this machine can run (native, AVX2 only, scalar) and both
int4pack block widths (64 rows, as ATen packs with AVX-512; 32, with AVX2; bf16 activations), the
weights packed by this folder's own writer of the layout, and GGUF's codes with float32 activations
in GGUF's nibble order or in nibble blocks of 32 and 64 rows (vector loops where the build's lanes
fit the block, scalar loops otherwise); one thread and two give the same bits."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import C_BUILDS, built_library
from test_group_dequantize_kernels import _int4_weight, pack_int4

from moemesh.kernels import group_quant, llama_decode

BUILDS = C_BUILDS
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, GROUP = 64, 2, 1, 32, 64, 32
BLOCK_SIZE, NUM_BLOCKS, EPS = 4, 6, 1e-5


def _library(build: str):
    return built_library(llama_decode.build, build)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean() + EPS) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [heads, d]
    half = x.shape[-1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _projection(layout: str, n: int, k: int, seed: int):
    """(codes, scales, mins or None, the weight in float64) of one projection in `layout`:
    "int4pack-32" / "int4pack-64" (bf16 scale and zero pairs), "nibbles" (GGUF's: float16 scale
    and min per row and group), or "blocks-32" / "blocks-64" (the same codes in row blocks, scales
    and mins [G, N])."""
    if layout.startswith("int4pack"):
        codes, scales_zeros, w = _int4_weight(n, k, GROUP, seed=seed)
        return pack_int4(codes, int(layout.split("-")[1])), scales_zeros, None, w
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // GROUP, generator=gen) * 1e-2).half()
    mins = (torch.randn(n, k // GROUP, generator=gen) * 1e-2).half()
    w = codes.double().view(n, -1, GROUP) * scale.double()[..., None] + mins.double()[..., None]
    if layout.startswith("blocks"):
        packed = group_quant.blocks_from_codes(codes, int(layout.split("-")[1]))
        return packed, scale.t().contiguous(), mins.t().contiguous(), w.view(n, k)
    return group_quant.nibbles_from_codes(codes), scale, mins, w.view(n, k)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize(
    "layout", ["int4pack-32", "int4pack-64", "nibbles", "blocks-32", "blocks-64", "blocks-64-bf16"]
)
def test_one_token_through_two_layers_matches_a_float64_forward(build, layout):
    lib = _library(build)
    exact = not layout.startswith("int4pack")  # GGUF's exact scales
    dtype = torch.bfloat16 if layout.endswith("bf16") or not exact else torch.float32  # the activations'
    layout = layout.removesuffix("-bf16")
    gen = torch.Generator().manual_seed(5)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {
        "qkv": (q_size + 2 * kv_size, HIDDEN),
        "o": (HIDDEN, q_size),
        "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }
    position, context = 9, 10  # the token at position 9 sees 9 cached tokens and itself
    table = torch.tensor([3, 0, 5], dtype=torch.int32)  # positions 0-3 in block 3, 4-7 in 0, 8-11 in 5
    slot = int(table[position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE
    cos_sin = torch.randn(16, HEAD_DIM, generator=gen).float()
    keep, layers, ref_layers = [], (llama_decode.Int4Layer * 2)(), []
    for i, entry in enumerate(layers):
        weights = {}
        for name, (n, k) in shapes.items():
            codes, scales, mins, w = _projection(layout, n, k, seed=10 * i + len(name))
            keep += [codes, scales] + ([] if mins is None else [mins])
            setattr(entry, name, codes.data_ptr())
            setattr(entry, f"{name}_sz", scales.data_ptr())
            setattr(entry, f"{name}_min", None if mins is None else mins.data_ptr())
            weights[name] = w
        norms = [(torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype) for _ in range(2)]
        caches = [
            (torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen) * 0.5).to(dtype) for _ in range(2)
        ]
        keep += norms + caches
        entry.input_norm, entry.post_norm = norms[0].data_ptr(), norms[1].data_ptr()
        entry.k_cache, entry.v_cache = caches[0].data_ptr(), caches[1].data_ptr()
        ref_layers.append((weights, norms, [c.clone() for c in caches]))
    formats = {
        "int4pack": llama_decode.FORMAT_INT4PACK,
        "nibbles": llama_decode.FORMAT_NIBBLES,
        "blocks": llama_decode.FORMAT_BLOCKS,
    }
    dims = llama_decode.Int4Dims(
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate=INTER,
        group=GROUP,
        block_n=int(layout.split("-")[1]) if "-" in layout else 0,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_position=16,
        rotary_dim=HEAD_DIM,
        format=formats[layout.split("-")[0]],
        bf16=int(dtype == torch.bfloat16),
        half=int(exact),
        eps=EPS,
        scale=HEAD_DIM**-0.5,
        cos_sin=cos_sin.data_ptr(),
    )
    embedding = torch.randn(HIDDEN, generator=gen).to(dtype)
    runs = []
    for threads in (1, 2):  # 2: a second thread takes half of each GEMV's rows; the same sums
        hidden, residual = embedding.clone(), torch.empty(HIDDEN, dtype=dtype)
        llama_decode.int4_llama_decode_token(
            dims, layers, hidden, residual, position, slot, table, context, lib=lib, threads=threads
        )
        runs.append((hidden, residual))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])

    # float64: the eager stack's operations without its bf16 roundings
    x, res = embedding.double(), None
    cos, sin = cos_sin[position, : HEAD_DIM // 2].double(), cos_sin[position, HEAD_DIM // 2 :].double()
    for weights, (w_in, w_post), (k_cache, v_cache) in ref_layers:
        res = x if res is None else x + res
        qkv = weights["qkv"] @ _rms(res, w_in.double())
        q = _rope(qkv[:q_size].view(HEADS, HEAD_DIM), cos, sin)
        k = _rope(qkv[q_size : q_size + kv_size].view(KV_HEADS, HEAD_DIM), cos, sin)
        k_cache.view(-1, KV_HEADS, HEAD_DIM)[slot] = k.to(dtype)
        v_cache.view(-1, KV_HEADS, HEAD_DIM)[slot] = qkv[q_size + kv_size :].view(KV_HEADS, HEAD_DIM).to(dtype)
        rows = [int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context)]
        keys, values = k_cache.view(-1, HEAD_DIM)[rows].double(), v_cache.view(-1, HEAD_DIM)[rows].double()
        attn = torch.softmax(q @ keys.T * HEAD_DIM**-0.5, dim=-1) @ values  # [heads, d]: one kv head
        res = weights["o"] @ attn.reshape(-1) + res
        gate_up = weights["gate_up"] @ _rms(res, w_post.double())
        x = weights["down"] @ (torch.nn.functional.silu(gate_up[:INTER]) * gate_up[INTER:])
    scale = x.abs().max()
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # float32 sums only; bf16: roundings after every op
    assert (hidden.double() - x).abs().max() <= tol * scale, ((hidden.double() - x).abs().max(), scale)
    assert (residual.double() - res).abs().max() <= tol * res.abs().max()
    stored = [keep[i] for i in range(len(keep)) if keep[i].dim() == 4]  # each layer's K and V cache
    for (_, _, (k_ref, v_ref)), (k_cache, v_cache) in zip(ref_layers, zip(stored[0::2], stored[1::2])):
        flat_k, flat_ref = k_cache.view(-1, HEAD_DIM).double(), k_ref.view(-1, HEAD_DIM).double()
        assert torch.equal(
            torch.cat((flat_k[:slot], flat_k[slot + 1 :])), torch.cat((flat_ref[:slot], flat_ref[slot + 1 :]))
        )
        assert (flat_k[slot] - flat_ref[slot]).abs().max() <= tol * flat_ref[slot].abs().max()
        assert (
            v_cache.view(-1, HEAD_DIM)[slot].double() - v_ref.view(-1, HEAD_DIM)[slot].double()
        ).abs().max() <= tol * v_ref.view(-1, HEAD_DIM)[slot].double().abs().max()


def test_a_block_outside_the_cache_is_refused_before_anything_is_written():
    lib = _library("native")
    dims = llama_decode.Int4Dims(
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate=INTER,
        group=GROUP,
        block_n=64,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_position=16,
        rotary_dim=HEAD_DIM,
        eps=EPS,
        scale=1.0,
        cos_sin=0,
    )
    hidden = torch.ones(HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        llama_decode.int4_llama_decode_token(
            dims,
            (llama_decode.Int4Layer * 1)(),
            hidden,
            hidden.clone(),
            5,
            5,
            torch.tensor([0, 99], dtype=torch.int32),
            6,
            lib=lib,
        )
    assert torch.equal(hidden, torch.ones(HIDDEN, dtype=torch.bfloat16))
