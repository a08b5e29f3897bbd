"""Mixtral: Llama attention (GQA + RoPE), every layer a sparse MoE of SwiGLU experts with
softmax top-k routing renormalized over the chosen experts. Checkpoint names
`block_sparse_moe.{gate,experts.N.w1/w2/w3}` are read as `mlp.*`."""

from __future__ import annotations

from torch import nn

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.layers.gqa_attention import GQAAttention
from moemesh.engine.layers.moe import GatingConfig, SparseMoE
from moemesh.engine.models.moe_model import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
    }
    renames = {".block_sparse_moe.": ".mlp."}

    def read_moe_config(self, hf: dict) -> int:
        if hf.get("sliding_window") is not None:
            raise ModelLoadError(f"Mixtral with sliding_window={hf['sliding_window']} is not supported")
        self.gating = GatingConfig(hf["num_local_experts"], hf["num_experts_per_tok"], renormalize=True)
        return self.gating.num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def make_attention(self, layer: int) -> nn.Module:
        return GQAAttention(self.cfg)

    def make_mlp(self, layer: int, moe_layer: int | None) -> nn.Module:
        return SparseMoE(moe_layer, self.cfg.hidden_size, self.cfg.intermediate_size, self.gating, self.moe_runtime)
