"""Checkpoint naming of the MoE families: per-expert tensors (what transformers 5.24 saves),
fused 3-D expert tensors (transformers' in-memory layout), skipped MTP layers, clear errors."""

from __future__ import annotations

import dataclasses
import glob
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh import LLM
from moemesh.engine.errors import ModelLoadError

from .models import build_deepseek_v3, build_mixtral, save_tiny

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def _rewrite(path: str, edit) -> None:
    (file,) = glob.glob(f"{path}/*.safetensors")
    tensors = load_file(file)
    save_file(edit(tensors), file, metadata={"format": "pt"})


def _fuse_mixtral_experts(tensors: dict) -> dict:
    """experts.N.w1/w3/w2 -> experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    out, per = {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            per.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in per.items():
        num_experts = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat((parts[e, "w1"], parts[e, "w3"])) for e in range(num_experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "w2"] for e in range(num_experts)])
    return out


def _expert_weights(llm: LLM) -> list[torch.Tensor]:
    return [t for m in llm.engine.model.moe_layers() for t in (m.experts.w13, m.experts.w2)]


def test_fused_3d_expert_tensors_load_like_per_expert_ones(tmp_path):
    per_expert, fused = str(tmp_path / "per_expert"), str(tmp_path / "fused")
    save_tiny(build_mixtral, per_expert)
    save_tiny(build_mixtral, fused)
    _rewrite(fused, _fuse_mixtral_experts)
    a = _expert_weights(LLM(per_expert, num_blocks=8, show_progress=False))
    b = _expert_weights(LLM(fused, num_blocks=8, show_progress=False))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert float(a[0].abs().sum()) > 0


def test_a_checkpoint_missing_one_expert_is_rejected_naming_it(tmp_path):
    save_tiny(build_mixtral, str(tmp_path))
    dropped = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    _rewrite(str(tmp_path), lambda ts: {k: v for k, v in ts.items() if k != dropped})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.w13.*expert 5"):
        LLM(str(tmp_path), num_blocks=8, show_progress=False)


def test_deepseek_v3_skips_multi_token_prediction_layers_but_not_unknown_weights(tmp_path):
    save_tiny(build_deepseek_v3, str(tmp_path))
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    _rewrite(str(tmp_path), lambda ts: ts | mtp)  # layer 3 of a 3-layer model: an MTP module
    LLM(str(tmp_path), num_blocks=8, show_progress=False)
    _rewrite(str(tmp_path), lambda ts: ts | {"model.layers.1.mlp.gate.extra": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match="unexpected weight 'model.layers.1.mlp.gate.extra'"):
        LLM(str(tmp_path), num_blocks=8, show_progress=False)


def test_a_model_for_remote_experts_neither_reads_nor_allocates_routed_expert_weights(tmp_path):
    """load_routed_experts=False: attention, gates and shared experts equal the full load; the
    routed experts hold zero rows, and running them locally is a clear error."""
    from moemesh.engine.config import ModelConfig
    from moemesh.engine.loader import open_checkpoint
    from moemesh.engine.loader.build import build_model

    save_tiny(build_deepseek_v3, str(tmp_path))  # has shared experts
    checkpoint = open_checkpoint(str(tmp_path))
    read = []

    def recording(select=None, _iter=checkpoint.iter_weights):
        for name, tensor in _iter(select):
            read.append(name)
            yield name, tensor

    checkpoint = dataclasses.replace(checkpoint, iter_weights=recording)
    full = build_model(checkpoint, "float32", "cpu", show_progress=False)
    num_read_full = len(read)
    read.clear()
    lean = build_model(checkpoint, "float32", "cpu", show_progress=False, load_routed_experts=False)
    assert 0 < len(read) < num_read_full and not any(".experts." in name and "shared" not in name for name in read)
    full_params, lean_params = dict(full.named_parameters()), dict(lean.named_parameters())
    for name, param in full_params.items():
        if name.endswith((".experts.w13", ".experts.w2")):
            assert lean_params[name].shape[0] == 0
        else:
            assert torch.equal(param, lean_params[name]), name
    assert sum(p.numel() for p in lean.parameters()) < sum(p.numel() for p in full.parameters()) / 2
    assert ModelConfig("m").load_routed_experts  # the default loads them
    with pytest.raises(RuntimeError, match="without its routed expert weights"):
        layer = lean.moe_layers()[0]
        layer(torch.randn(3, layer.gate.weight.shape[1]))
