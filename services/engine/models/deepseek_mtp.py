"""DeepSeek-V3's multi-token-prediction (MTP) layer, served as a speculative drafter.

MTP layer k (checkpoint layer `num_hidden_layers + k`) at position i combines the previous
depth's representation h_i with the embedding of the next token t_{i+1}:

    x     = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])        # [num_tokens, hidden]
    h'_i  = shared_head.norm(DecoderLayer(x))                  # MLA attention + DeepSeekMoE
    logits = Head(h'_i)                                        # predicts t_{i+2}

with its own paged KV cache. Depth 0's h_i is what the main model hands its LM head: the output
of the final `model.norm`. DeepSeek's reference inference code has no MTP path; this is the
convention of vLLM (`deepseek_mtp.py`, fed the target's normed output) and SGLang
(`deepseek_nextn.py`, which also re-feeds `shared_head.norm`'s output as the next depth's h).
We follow SGLang for depth > 0 as well, so every depth's h is the normalized state that an
output head reads.

The embedding and output head are the main model's (the paper shares them; the released
checkpoint also stores copies, `model.layers.{N}.embed_tokens` / `.shared_head.head`, which are
not loaded), so `forward` takes token embeddings and `logits` are computed by the main model.

The decoder layer is layer 0 of a one-layer `DeepseekV3ForCausalLM` built from the target's
config, so it shares that model's attention, MoE and checkpoint-name handling exactly; its
embedding and final norm are dropped. Its routed experts always run locally, with their own
load counter (not published), even when the main model's experts run on expert workers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.layernorm import RMSNorm
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.models.deepseek_v3 import DeepseekV3ForCausalLM

_OWN_WEIGHTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # the MTP layer's own, not the decoder's
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")  # copies of the main model's, not loaded


def num_mtp_layers(hf_config: dict) -> int:
    return int(hf_config.get("num_nextn_predict_layers") or 0)


def mtp_weight_prefix(hf_config: dict, depth: int = 0) -> str:
    """Checkpoint prefix of MTP layer `depth`: `model.layers.{num_hidden_layers + depth}.`."""
    return f"model.layers.{hf_config['num_hidden_layers'] + depth}."


class _SharedHead(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekMTP(nn.Module):
    """One MTP layer (depth `depth`); reused for every draft step."""

    def __init__(self, cfg: TransformerConfig, depth: int = 0):
        super().__init__()
        self.cfg, self.depth = cfg, depth
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = _SharedHead(cfg)
        self.block = DeepseekV3ForCausalLM(_block_config(cfg, depth))
        self.block.model.embed_tokens = nn.Identity()  # the main model's embedding is used
        self.block.model.norm = nn.Identity()  # shared_head.norm is the MTP layer's final norm
        self._prefix = re.compile(rf"^{re.escape(mtp_weight_prefix(cfg.hf_config, depth))}")

    @property
    def layer(self) -> nn.Module:
        return self.block.model.layers[0]

    def forward(
        self,
        input_embeds: torch.Tensor,  # [num_tokens, hidden], Emb(t_{i+1})
        hidden_states: torch.Tensor,  # [num_tokens, hidden], h_i of the previous depth
        positions: torch.Tensor,  # [num_tokens], i
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], h'_i (normalized; the output head's input)
        self.block.expert_load.begin_step()
        x = self.eh_proj(torch.cat((self.enorm(input_embeds), self.hnorm(hidden_states)), dim=-1))
        x, residual = self.layer(positions, x, None, meta)
        out, _ = self.shared_head.norm(x, residual)
        return out

    def attention_layers(self) -> list[nn.Module]:
        return self.block.attention_layers()

    def select_weight(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` belongs to this layer (and is loaded)."""
        if not self._prefix.match(name):
            return False
        return not self._prefix.sub("", name).startswith(_SHARED_COPIES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint-named tensors of this layer (`select_weight`); every parameter must be
        written. Raises ValueError for a missing or unexpected one."""
        own = dict(self.named_parameters())
        written: set[str] = set()

        def decoder_weights():
            for name, tensor in weights:
                if not self.select_weight(name):
                    continue
                local = self._prefix.sub("", name)
                if local.startswith(_OWN_WEIGHTS):
                    if local not in own or own[local].shape != tensor.shape:
                        raise ValueError(f"unexpected MTP weight {name!r} of shape {tuple(tensor.shape)}")
                    with torch.no_grad():
                        own[local].copy_(tensor)
                    written.add(local)
                else:
                    yield f"model.layers.0.{local}", tensor

        self.block.load_weights(decoder_weights())
        missing = {n for n in own if not n.startswith("block.")} - written
        if missing:
            raise ValueError(f"checkpoint lacks MTP weights: {sorted(missing)}")


def _block_config(cfg: TransformerConfig, depth: int) -> TransformerConfig:
    """The target's config cut to one decoder layer (MoE when checkpoint layer N + depth is),
    with a one-token vocabulary: the block's own embedding and head are never used."""
    hf = cfg.hf_config
    layer = hf["num_hidden_layers"] + depth
    dense = layer < (hf.get("first_k_dense_replace") or 0)
    block_hf = {
        **hf,
        "num_hidden_layers": 1,
        "first_k_dense_replace": 1 if dense else 0,
        "vocab_size": 1,
        "tie_word_embeddings": True,
    }
    return TransformerConfig.from_hf(block_hf)
