"""What the MoE architectures share: the MoE runtime (expert executor + load counters) on the
shared decoder stack (models/decoder_model.py), and checkpoint loading with each family's
expert weight names.

A subclass says how to build layer i's attention (`make_attention`) and FFN (`make_mlp`: a
dense `LlamaMLP` or a `SparseMoE`), which HF name fragments merge into one parameter
(`stacked_params`) and which rename (`renames`).

Routed-expert tensors (names parsed by models/expert_names.py) all map onto `experts.w13` /
`experts.w2`: per expert, gate -> w13[e, :I], up -> w13[e, I:], down -> w2[e]; fused 3-D,
`gate_up_proj` [E, 2I, H] -> w13 and `down_proj` [E, H, I] -> w2.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.decoder_layer import DecoderLayer
from moemesh.engine.layers.expert_executor import ExpertExecutor, ExpertPlacement, LocalExpertExecutor
from moemesh.engine.layers.expert_load_counter import ExpertLoadCounter
from moemesh.engine.layers.moe import MoERuntime, SparseMoE
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.models.decoder_model import DecoderModel, MicroBatch, copy_weight
from moemesh.engine.models.expert_names import parse_expert_weight_name

_EXPERT_SHARD = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", None)}  # per-expert part -> (param, shard)


class MoEForCausalLM(nn.Module):
    stacked_params: dict[str, tuple[str, int]] = {
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }  # HF name fragment -> (merged parameter fragment, shard index)
    renames: dict[str, str] = {}  # HF name fragment -> ours

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        num_experts = self.read_moe_config(cfg.hf_config)
        moe_layer_ids = [i for i in range(cfg.num_layers) if self.is_moe_layer(i)]
        self.moe_layer_ids = moe_layer_ids  # model layer index of each MoE-layer ordinal
        counter = ExpertLoadCounter(max(1, len(moe_layer_ids)), num_experts)
        self.moe_runtime = MoERuntime(executor=None, expert_load=counter)  # executor set below
        layers = []
        for i in range(cfg.num_layers):
            moe_layer = moe_layer_ids.index(i) if i in moe_layer_ids else None
            layers.append(DecoderLayer(cfg, self.make_attention(i), self.make_mlp(i, moe_layer)))
        self.model = DecoderModel(cfg, layers)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        experts = [moe.experts for moe in self.moe_layers()]
        placement = ExpertPlacement.identity(max(1, len(experts)), num_experts)
        self.moe_runtime.executor = LocalExpertExecutor(experts, placement)

    # -- what a subclass provides ------------------------------------------------------------
    def read_moe_config(self, hf: dict) -> int:
        """Parse the family's MoE fields of config.json into attributes; return num_experts."""
        raise NotImplementedError

    def is_moe_layer(self, layer: int) -> bool:
        raise NotImplementedError

    def make_attention(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, layer: int, moe_layer: int | None) -> nn.Module:
        raise NotImplementedError

    def skip_weight(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.lm_head is None and name == "lm_head.weight")

    # -- serving ---------------------------------------------------------------------------
    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden]
        self.moe_runtime.expert_load.begin_step()
        return self.model(input_ids, positions, meta)

    def forward_micro_batches(self, batches: Sequence[MicroBatch]) -> list[torch.Tensor]:  # [num_tokens_i, hidden]
        """One round as micro-batches whose attention and remote experts interleave (ping-pong)."""
        self.moe_runtime.expert_load.begin_step()
        return self.model.forward_micro_batches(batches)

    @property
    def experts_overlap_submit(self) -> bool:
        """Whether the executor's experts run while the stack goes on (remote): ping-pong pays."""
        return self.moe_runtime.executor.overlaps_submit

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [num_reqs, vocab]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden_states, weight)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def moe_layers(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    @property
    def expert_load(self) -> ExpertLoadCounter:
        return self.moe_runtime.expert_load

    def set_expert_executor(self, executor: ExpertExecutor) -> None:
        """Between steps only (e.g. the worker plugging in a remote executor)."""
        self.moe_runtime.executor = executor

    # -- loading ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter (every expert's slice) must be written."""
        params = dict(self.named_parameters())
        shards: dict[str, dict[int, torch.Tensor]] = {}
        expert_parts: dict[str, set] = {}  # param -> {(expert, shard)} written
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            for old, new in self.renames.items():
                name = name.replace(old, new)
            if self._load_expert_weight(params, name, tensor, expert_parts):
                continue
            for fragment, (merged, shard) in self.stacked_params.items():
                if fragment in name:
                    shards.setdefault(name.replace(fragment, merged), {})[shard] = tensor
                    break
            else:
                copy_weight(params, name, tensor)
                loaded.add(name)
        for target, parts in shards.items():
            num_parts = 1 + max(s for merged, s in self.stacked_params.values() if merged in target)
            missing = [i for i in range(num_parts) if i not in parts]
            if missing:
                raise ValueError(f"checkpoint lacks shard(s) {missing} of {target}")
            copy_weight(params, target, torch.cat([parts[i] for i in range(num_parts)], dim=0))
            loaded.add(target)
        for target, parts in expert_parts.items():
            num_experts = params[target].shape[0]
            need = {(e, s) for e in range(num_experts) for s in ((0, 1) if target.endswith(".w13") else (None,))}
            if need - parts:
                raise ValueError(
                    f"checkpoint lacks {len(need - parts)} expert slice(s) of {target}, e.g. "
                    f"expert {sorted(need - parts, key=str)[0][0]}"
                )
            loaded.add(target)
        unloaded = {name for name in set(params) - loaded if params[name].numel()}  # dropped experts: empty
        if unloaded:
            raise ValueError(f"checkpoint lacks weights for: {sorted(unloaded)[:8]}")

    @staticmethod
    def _load_expert_weight(params, name: str, tensor: torch.Tensor, expert_parts: dict[str, set]) -> bool:
        parsed = parse_expert_weight_name(name)
        if parsed is None:
            return False
        if parsed.expert is None:  # fused: all experts at once
            target = f"{parsed.prefix}.{'w13' if parsed.part == 'gate_up' else 'w2'}"
            copy_weight(params, target, tensor)
            num_experts = params[target].shape[0]
            shards = (0, 1) if target.endswith(".w13") else (None,)
            expert_parts.setdefault(target, set()).update((e, s) for e in range(num_experts) for s in shards)
            return True
        expert = parsed.expert
        which, shard = _EXPERT_SHARD[parsed.part]
        target = f"{parsed.prefix}.{which}"
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        param = params[target]
        if expert >= param.shape[0]:
            raise ValueError(f"weight {name!r} names expert {expert}; the model has {param.shape[0]}")
        rows = param.shape[1] // 2 if shard is not None else param.shape[1]
        expected = (rows, param.shape[2])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, model expects {expected}")
        start = 0 if shard in (None, 0) else rows
        with torch.no_grad():
            param[expert, start : start + rows].copy_(tensor)
        expert_parts.setdefault(target, set()).add((expert, shard))
        return True
