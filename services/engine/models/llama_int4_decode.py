"""A decode round of one request through a Llama stack whose projections are GGUF 4-bit weights on
the CPU (int4pack with bfloat16 activations, GGUF's nibbles with float32 ones, 4-bit code blocks
with either) in one C call (kernels/csrc/llama_decode.c `int4_llama_decode_token`) instead of ~40 torch ops and
module calls per layer.

At one token per round the eager stack spends more time dispatching ops than moving weights
(SmolLM2-135M, one thread: ~6 ms of a 16 ms step); the C call runs the same operations, rounded to
the activation dtype where the eager tensors are, so its tokens are the eager path's up to the
order of the projections' float32 sums. The embedding and the final norm stay the model's own.

`Int4Decode.build(model)` says None (logged, with the reason; the model then never asks again) when
the stack is not one it reads: another dtype or device, a projection in another form, q/k norms,
GPT-J rotary, or no C compiler. The tensors' addresses are taken once; a KV cache rebound since
is noticed and the addresses taken again.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.quantized_linear import QuantizedLinear

log = logging.getLogger(__name__)


class Int4Decode:
    def __init__(self, stack: nn.Module, dims: kernels.Int4Dims, layers: ctypes.Array, cache_ptr: int):
        # the decoder stack, not the model that holds this object: no reference cycle keeps a
        # dropped model (and its KV cache) alive until the cyclic collector runs
        self.stack, self.dims, self.layers, self.cache_ptr = stack, dims, layers, cache_ptr

    @classmethod
    def build(cls, model: nn.Module) -> Int4Decode | None:
        """`model`: a LlamaForCausalLM with its KV caches bound."""
        reason = _unsupported(model)
        if reason:
            log.info("one-token decode runs the eager stack: %s", reason)
            return None
        stack = model.model
        first = stack.layers[0]
        attn, rope = first.self_attn, first.self_attn.rotary_emb
        qkv = first.self_attn.qkv_proj
        cos_sin = rope.cos_sin_cache
        int4pack = qkv.form == "int4pack"
        dims = kernels.Int4Dims(
            hidden=model.cfg.hidden_size,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=first.mlp.down_proj.in_features,
            group=qkv.group_size,
            block_n=qkv.block_n or 0,
            num_blocks=attn.attn.k_cache.shape[0],
            block_size=attn.attn.k_cache.shape[1],
            max_position=cos_sin.shape[0],
            rotary_dim=cos_sin.shape[1],
            format=kernels.INT4_FORMATS[qkv.form],
            bf16=int(first.input_layernorm.weight.dtype == torch.bfloat16),
            half=int(not int4pack and qkv.scales.dtype == torch.float16),
            eps=first.input_layernorm.eps,
            scale=attn.attn.scale,
            cos_sin=cos_sin.data_ptr(),
        )
        layers = (kernels.Int4Layer * len(stack.layers))()
        for entry, layer in zip(layers, stack.layers):
            a, m = layer.self_attn, layer.mlp
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, proj in (
                ("qkv", a.qkv_proj),
                ("o", a.o_proj),
                ("gate_up", m.gate_up_proj),
                ("down", m.down_proj),
            ):
                if int4pack:
                    setattr(entry, name, proj.packed.data_ptr())
                    setattr(entry, f"{name}_sz", proj.scales_zeros.data_ptr())
                else:
                    setattr(entry, name, proj.codes.data_ptr())
                    setattr(entry, f"{name}_sz", proj.scales.data_ptr())
                    setattr(entry, f"{name}_min", proj.mins.data_ptr() if hasattr(proj, "mins") else None)
            entry.k_cache, entry.v_cache = a.attn.k_cache.data_ptr(), a.attn.v_cache.data_ptr()
        log.info("one-token decode: the %d %s layers in one C call", len(stack.layers), qkv.form)
        return cls(stack, dims, layers, first.self_attn.attn.k_cache.data_ptr())

    @staticmethod
    def caches_bound(model: nn.Module) -> bool:
        """The runner has bound the KV caches (forwards before that, such as a memory probe, do not decide)."""
        return model.model.layers[0].self_attn.attn.k_cache.numel() > 0

    def current(self) -> bool:
        """The KV caches are still the ones whose addresses were taken."""
        return self.stack.layers[0].self_attn.attn.k_cache.data_ptr() == self.cache_ptr

    def applies(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        return input_ids.shape[0] == 1 and meta.num_decode_reqs == 1 and meta.context_lens.shape[0] == 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        stack = self.stack
        hidden = stack.embed_tokens(input_ids).contiguous()  # [1, hidden]
        residual = torch.empty_like(hidden)
        table = meta.block_tables[0]
        kernels.int4_llama_decode_token(
            self.dims,
            self.layers,
            hidden,
            residual,
            int(positions[0]),
            int(meta.slot_mapping[0]),
            table if table.is_contiguous() else table.contiguous(),
            int(meta.context_lens[0]),
        )
        return stack.norm(hidden, residual)[0]


# (projection form, activation dtype) pairs the C call reads
_READS = {
    ("int4pack", torch.bfloat16),
    ("nibbles", torch.float32),
    ("blocks", torch.float32),
    ("blocks", torch.bfloat16),
}


def _unsupported(model: nn.Module) -> str | None:
    """Why the C call cannot run this model's stack, or None. It reads int4pack projections with
    bfloat16 activations, GGUF nibble projections (groups of 32) with float32 ones, and 4-bit
    code-block projections with either."""
    if not kernels.llama_decode_built():
        return "no C compiler"
    layers = model.model.layers
    layouts = set()
    for layer in layers:
        a, m = layer.self_attn, getattr(layer, "mlp", None)
        projections = [
            getattr(a, "qkv_proj", None),
            getattr(a, "o_proj", None),
            getattr(m, "gate_up_proj", None),
            getattr(m, "down_proj", None),
        ]
        if not all(isinstance(p, QuantizedLinear) and _readable(p) for p in projections):
            return "a projection is not 4-bit in a layout the C code reads"
        layouts |= {_layout(p) for p in projections}
        if getattr(a, "q_norm", None) is not None or not a.rotary_emb.is_neox_style:
            return "q/k norms or GPT-J-style rotary"
        dtype = layers[0].input_layernorm.weight.dtype  # the activations'
        if (projections[0].form, dtype) not in _READS:
            return f"{projections[0].form} projections with {dtype} activations"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
            return f"norm weights not {dtype}"
        cache = a.attn.k_cache
        if cache.dtype != dtype or cache.device.type != "cpu" or not cache.is_contiguous() or not cache.numel():
            return f"KV cache not a bound {dtype} CPU tensor"
    if len(layouts) != 1:
        return "projections with different layouts, group sizes or scale dtypes"
    if layers[0].self_attn.num_heads * layers[0].self_attn.head_dim > 4096:
        return "more than 4096 query features"
    return None


def _readable(p: QuantizedLinear) -> bool:
    if p.form == "blocks":
        return p.bits == 4
    if p.form == "int4pack":
        return bool(p.block_n)
    return p.form == "nibbles" and p.group_size % 32 == 0 and not p.codes.is_cuda


def _layout(p: QuantizedLinear) -> tuple:
    if p.form == "int4pack":
        return p.form, p.block_n, p.group_size
    return p.form, p.block_n, p.group_size, p.scales.dtype, hasattr(p, "mins")
