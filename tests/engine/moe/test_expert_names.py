"""The one routed-expert name parser (loader and expert worker) on the names transformers
writes: every routed expert's gate, up and down of every MoE layer, exactly once; never a
shared expert, router or attention tensor."""

from __future__ import annotations

import glob

import pytest
from safetensors import safe_open

from moemesh.engine.models.expert_names import ExpertWeightName, parse_expert_weight_name

from .models import BUILDERS, save_tiny


def _saved_names(builder, path: str) -> list[str]:
    save_tiny(builder, path)
    (file,) = glob.glob(f"{path}/*.safetensors")
    with safe_open(file, "pt") as f:
        return list(f.keys())


def _hf_moe_layers(config) -> tuple[list[int], int]:
    """(model layer indices with routed experts, experts per layer), from the HF config."""
    if config.model_type == "mixtral":
        return list(range(config.num_hidden_layers)), config.num_local_experts
    if config.model_type == "qwen3_moe":
        layers = [i for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers]
        return layers, config.num_experts
    return list(range(config.first_k_dense_replace, config.num_hidden_layers)), config.n_routed_experts


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_every_routed_expert_tensor_transformers_saves_is_parsed_once(arch, tmp_path):
    names = _saved_names(BUILDERS[arch], str(tmp_path))
    parsed = {name: parse_expert_weight_name(name) for name in names}
    routed = [p for p in parsed.values() if p is not None]
    layers, num_experts = _hf_moe_layers(BUILDERS[arch]().config)
    expected = {(layer, e, part) for layer in layers for e in range(num_experts) for part in ("gate", "up", "down")}
    assert sorted((p.layer, p.expert, p.part) for p in routed) == sorted(expected)
    for name, p in parsed.items():
        if p is None:
            assert ".experts." not in name or "shared_experts" in name, name
        else:
            assert name.startswith(p.prefix + f".{p.expert}.")


def test_fused_and_foreign_names():
    fused = parse_expert_weight_name("model.layers.2.mlp.experts.gate_up_proj")
    assert fused == ExpertWeightName("model.layers.2.mlp.experts", 2, None, "gate_up")
    assert parse_expert_weight_name("model.layers.0.block_sparse_moe.experts.down_proj").part == "down"
    assert parse_expert_weight_name("model.layers.1.block_sparse_moe.experts.7.w3.weight") == ExpertWeightName(
        "model.layers.1.block_sparse_moe.experts", 1, 7, "up"
    )
    for name in (
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.3.gate_proj.bias",
        "model.layers.1.mlp.experts.gate_up_proj.weight",
        "lm_head.weight",
    ):
        assert parse_expert_weight_name(name) is None, name
