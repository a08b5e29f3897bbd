"""The decoder stack every model here shares (HF `model.`): token embedding, the pre-norm
decoder layers (each the model's own attention and MLP), final RMSNorm; plus the checked copy
of one checkpoint tensor into a parameter that every `load_weights` uses.

`forward_micro_batches` runs one round split into micro-batches (ping-pong overlap, as
MegaScale-Infer and DeepSeek's two-batch overlap do): a micro-batch's MoE layer is started
(gating + `ExpertExecutor.submit`) and only finished after the other micro-batch's attention,
so that attention runs while the first one's routed experts run remotely. For two micro-batches
A, B and MoE layers L, L+1:

    attn(A, L) start(A, L) attn(B, L) start(B, L)
    finish(A, L) attn(A, L+1) start(A, L+1) finish(B, L) attn(B, L+1) start(B, L+1) ...

Dense layers run whole in that order. Every operation is per token except attention, which reads
each micro-batch's own metadata, so the outputs are the un-split forward's (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.decoder_layer import DecoderLayer
from moemesh.engine.layers.layernorm import RMSNorm
from moemesh.engine.layers.moe import PendingMoE, SparseMoE
from moemesh.engine.layers.transformer_config import TransformerConfig


@dataclass
class MicroBatch:
    """One part of a round: whole requests, with attention metadata of their own."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata


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

    def forward_micro_batches(self, batches: Sequence[MicroBatch]) -> list[torch.Tensor]:  # [num_tokens_i, hidden]
        hidden = [self.embed_tokens(b.input_ids) for b in batches]  # [num_tokens_i, hidden] each
        residual: list[torch.Tensor | None] = [None] * len(batches)
        pending: list[tuple[SparseMoE, PendingMoE] | None] = [None] * len(batches)  # started, per micro-batch
        for layer in self.layers:
            for i, b in enumerate(batches):
                if pending[i] is not None:
                    moe, started = pending[i]
                    hidden[i], pending[i] = moe.finish(started), None
                hidden[i], residual[i] = layer.attend(b.positions, hidden[i], residual[i], b.meta)
                if isinstance(layer.mlp, SparseMoE):
                    pending[i] = (layer.mlp, layer.mlp.start(hidden[i]))
                else:
                    hidden[i] = layer.mlp(hidden[i])
        for i in range(len(batches)):
            if pending[i] is not None:
                moe, started = pending[i]
                hidden[i] = moe.finish(started)
            hidden[i], _ = self.norm(hidden[i], residual[i])
        return hidden


def copy_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    """Raises ValueError (the loader turns it into ModelLoadError) for an unknown name or shape."""
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    param = params[name]
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
