"""Block-FP8 checkpoints in the DeepSeek-V3 format, made in the tests: a tiny random DeepSeek-V3
built by transformers, quantized by an independent reference quantizer (amax per 128 x 128
block, scale = amax / 448, q = e4m3(w / scale), scale_inv = scale) and saved as the released
checkpoints are (float8_e4m3fn weights, float32 `*_scale_inv`, quantization_config, sharded with
model.safetensors.index.json), plus the same weights dequantized to fp32 for Hugging Face.

Dimensions are multiples and non-multiples of 128 (hidden 256, dense FFN 384, experts 192,
q_lora_rank 96, kv_a 80 rows) so partial blocks and separately blocked gate/up halves matter."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from .models import build_deepseek_v3

BLOCK = 128
E4M3_MAX = 448.0
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def build_fp8_shaped_deepseek_v3():
    return build_deepseek_v3(
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=192,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        initializer_range=0.05,
    )


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference block quantizer, block by block: scale = amax / 448, q = e4m3(w / scale)."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].double()
            s = max(float(tile.abs().max()), 1e-12) / E4M3_MAX
            scale[i, j] = s
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (
                (tile / s).clamp(-E4M3_MAX, E4M3_MAX).float().to(torch.float8_e4m3fn)
            )
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [N, K] float32
    n, k = q.shape
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return q.float() * full


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """As in the released checkpoint: every Linear weight in the decoder layers but the router."""
    return (
        name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2 and ".mlp.gate." not in name
    )


def shard_of(name: str) -> str:
    """Four shards: layer 0 + globals, attention/shared of layers 1-2, then each MoE layer's routed experts."""
    if ".mlp.experts." in name:
        return "model-0000{}-of-00004.safetensors".format(2 + int(name.split(".")[2]))
    if name.startswith(("model.layers.1.", "model.layers.2.")):
        return "model-00002-of-00004.safetensors"
    return "model-00001-of-00004.safetensors"


def save_sharded(tensors: dict[str, torch.Tensor], path: str) -> None:
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        shards.setdefault(shard_of(name), {})[name] = t.contiguous()
    for file, part in shards.items():
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: shard_of(name) for name in sorted(tensors)}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def save_fp8_deepseek_v3(fp8_dir: str, ref_dir: str, seed: int = 0):
    """A tiny random DeepSeek-V3 (transformers' classes) quantized to block FP8 and saved in the
    released checkpoints' layout in fp8_dir, and dequantized to fp32 in ref_dir. Returns (HF
    model loaded from ref_dir, {name: float8 tensor} as saved)."""
    torch.manual_seed(seed)
    model = build_fp8_shaped_deepseek_v3().eval()
    model.save_pretrained(fp8_dir)
    (saved,) = [f for f in os.listdir(fp8_dir) if f.endswith(".safetensors")]
    stored = load_file(os.path.join(fp8_dir, saved))
    os.remove(os.path.join(fp8_dir, saved))
    fp8, dequantized = {}, {}
    for name, t in stored.items():
        if is_quantized(name, t):
            q, scale = quantize_blocks(t)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale)
        else:
            fp8[name] = dequantized[name] = t
    save_sharded(fp8, fp8_dir)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config | {"quantization_config": QUANT_CONFIG}, f)
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(config, f)  # the unquantized config; the same tensor names, dequantized to fp32
    save_file(dequantized, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return hf, {n: t for n, t in fp8.items() if t.dtype == torch.float8_e4m3fn}
