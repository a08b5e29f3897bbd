"""The pre-norm decoder layer every model here uses: norm -> attention -> add & norm -> MLP.

The attention and MLP modules are the model's own (GQA, MLA; dense or MoE); the residual is
carried between layers so each add is fused into the next RMSNorm.
"""

from __future__ import annotations

from torch import nn

from moemesh.engine.layers.layernorm import RMSNorm
from moemesh.engine.layers.transformer_config import TransformerConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, meta):
        hidden_states, residual = self.attend(positions, hidden_states, residual, meta)
        return self.mlp(hidden_states), residual

    def attend(self, positions, hidden_states, residual, meta):
        """Everything before the MLP: (the MLP's input, the residual). The decoder stack calls it
        alone when it interleaves two micro-batches around a MoE layer's experts."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        return self.post_attention_layernorm(hidden_states, residual)
