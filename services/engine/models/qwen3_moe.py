"""Qwen3-MoE: GQA attention with per-head RMSNorm on q and k (before RoPE), softmax top-k routing
(`norm_topk_prob` renormalizes), no shared experts. Layer i is MoE when it is not in
`mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the others are dense SwiGLU MLPs."""

from __future__ import annotations

from torch import nn

from moemesh.engine.layers.gqa_attention import GQAAttention
from moemesh.engine.layers.moe import GatingConfig, SparseMoE
from moemesh.engine.models.llama import LlamaMLP
from moemesh.engine.models.moe_model import MoEForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def read_moe_config(self, hf: dict) -> int:
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        self.gating = GatingConfig(num_experts, hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)))
        self.moe_intermediate_size = hf["moe_intermediate_size"]
        self.decoder_sparse_step = hf.get("decoder_sparse_step", 1)
        self.mlp_only_layers = set(hf.get("mlp_only_layers") or [])
        return num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.gating.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def make_attention(self, layer: int) -> nn.Module:
        return GQAAttention(self.cfg, qk_norm=True)

    def make_mlp(self, layer: int, moe_layer: int | None) -> nn.Module:
        if moe_layer is None:
            return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size)
        return SparseMoE(moe_layer, self.cfg.hidden_size, self.moe_intermediate_size, self.gating, self.moe_runtime)
