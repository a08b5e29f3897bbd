"""The decoder stack every model here shares (HF `model.`): token embedding, the pre-norm
decoder layers (each the model's own attention and MLP), final RMSNorm; plus the checked copy
of one checkpoint tensor into a parameter that every `load_weights` uses."""

from __future__ import annotations

import torch
from torch import nn

from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.decoder_layer import DecoderLayer
from moemesh.engine.layers.layernorm import RMSNorm
from moemesh.engine.models.config import TransformerConfig


class DecoderModel(nn.Module):
    def __init__(self, cfg: TransformerConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden_states, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def copy_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    """Raises ValueError (the loader turns it into ModelLoadError) for an unknown name or shape."""
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    param = params[name]
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
