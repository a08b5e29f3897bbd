"""Llama: GQA attention with RoPE (layers/gqa_attention.py), RMSNorm, SwiGLU MLP, optionally
tied embeddings, on the shared decoder stack (models/decoder_model.py).

Serving-only forward over a flattened varlen batch: `forward(input_ids, positions, meta)`.
q/k/v and gate/up projections are merged into one matmul each; `load_weights` maps the Hugging
Face names onto the merged parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.engine.layers.activation import SiluAndMul
from moemesh.engine.layers.attention import Attention
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.decoder_layer import DecoderLayer
from moemesh.engine.layers.gqa_attention import GQAAttention
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.models.decoder_model import DecoderModel, copy_weight
from moemesh.engine.models.llama_int4_decode import Int4Decode


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (merged parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        layers = [
            DecoderLayer(cfg, GQAAttention(cfg), LlamaMLP(cfg.hidden_size, cfg.intermediate_size))
            for _ in range(cfg.num_layers)
        ]
        self.model = DecoderModel(cfg, layers)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the one-token C decode: built at the first forward with KV caches bound; False: not for this stack
        self.int4_decode: Int4Decode | None | bool = None

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        if self.int4_decode is None and Int4Decode.caches_bound(self):  # decided once, with the caches bound
            self.int4_decode = Int4Decode.build(self) or False
        elif self.int4_decode and not self.int4_decode.current():
            self.int4_decode = Int4Decode.build(self)  # the KV cache was rebound
        if self.int4_decode and self.int4_decode.applies(input_ids, meta):
            return self.int4_decode.forward(input_ids, positions, meta)  # [1, hidden]
        return self.model(input_ids, positions, meta)  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [num_reqs, vocab]
        if self.lm_head is not None:
            return self.lm_head(hidden_states)
        embed = self.model.embed_tokens  # tied; a quantized embedding multiplies through its table
        return embed.linear(hidden_states) if hasattr(embed, "linear") else F.linear(hidden_states, embed.weight)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be written exactly once."""
        params = dict(self.named_parameters())
        shards: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.lm_head is None and name == "lm_head.weight":
                continue  # tied: the embedding serves
            for fragment, (merged, shard) in self.stacked_params.items():
                if fragment in name:
                    target = name.replace(fragment, merged)
                    shards.setdefault(target, {})[shard] = tensor
                    break
            else:
                copy_weight(params, name, tensor)
                loaded.add(name)
        for target, parts in shards.items():
            num_parts = 3 if ".qkv_proj." in target else 2
            missing = [i for i in range(num_parts) if i not in parts]
            if missing:
                raise ValueError(f"checkpoint lacks shard(s) {missing} of {target}")
            copy_weight(params, target, torch.cat([parts[i] for i in range(num_parts)], dim=0))
            loaded.add(target)
        unloaded = set(params) - loaded
        if unloaded:
            raise ValueError(f"checkpoint lacks weights for: {sorted(unloaded)[:8]}")
