"""Block-FP8 checkpoints in the DeepSeek-V3 format (made by `fp8_models.py`): moemesh keeps the
weights in float8 and matches transformers running the same checkpoint dequantized to fp32."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh import LLM, SamplingParams
from moemesh.engine.errors import ModelLoadError
from moemesh.engine.layers.fp8_linear import Fp8Linear
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import build_model

from ..oracle_helpers import max_rel_error, prefill_then_decode_logits
from .fp8_models import QUANT_CONFIG, save_fp8_deepseek_v3
from .models import MAX_NEW, hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(fp8 dir, HF model on the dequantized fp32 copy, {name: float8 tensor})."""
    fp8_dir, ref_dir = str(tmp_path_factory.mktemp("fp8")), str(tmp_path_factory.mktemp("dequantized"))
    hf, stored_fp8 = save_fp8_deepseek_v3(fp8_dir, ref_dir)
    return fp8_dir, hf, stored_fp8


@pytest.fixture(scope="module")
def fp8_llm(fp8_checkpoint):
    return LLM(fp8_checkpoint[0], num_blocks=64, max_model_len=256, enable_prefix_caching=False, show_progress=False)


def test_quantized_weights_stay_float8_in_memory_at_about_one_byte_per_weight(fp8_checkpoint, fp8_llm):
    _, _, stored_fp8 = fp8_checkpoint
    model = fp8_llm.engine.model
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for linear in (
        attn.q_a_proj,
        attn.q_b_proj,
        attn.kv_a_proj_with_mqa,
        attn.o_proj,
        moe.shared_experts.gate_up_proj,
        moe.shared_experts.down_proj,
        model.model.layers[0].mlp.gate_up_proj,
    ):
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == torch.float8_e4m3fn
        assert linear.weight_scale_inv.dtype == torch.float32
    assert moe.shared_experts.gate_up_proj.weight_scale_inv.shape == (2 + 2, 2)  # gate and up halves: 192 rows each
    assert moe.experts.w13.dtype == moe.experts.w2.dtype == torch.float8_e4m3fn
    assert moe.experts.w13_scale_inv.shape == (8, 4, 2) and moe.experts.w2_scale_inv.shape == (8, 2, 2)
    # MLA reads kv_b_proj's weight as a matrix: dequantized at load; router, norms, embeddings as stored
    assert type(attn.kv_b_proj) is torch.nn.Linear and attn.kv_b_proj.weight.dtype == torch.float32
    assert moe.gate.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32

    named = dict(model.named_parameters()) | dict(model.named_buffers())
    tensors = list(named.values())
    fp8_numel = sum(t.numel() for t in tensors if t.dtype == torch.float8_e4m3fn)
    stored_numel = sum(t.numel() for n, t in stored_fp8.items() if ".kv_b_proj." not in n)
    assert fp8_numel == stored_numel  # every quantized weight but kv_b_proj, none upcast
    scale_bytes = sum(t.nbytes for n, t in named.items() if n.endswith("_scale_inv"))
    fp8_bytes = sum(t.nbytes for t in tensors if t.dtype == torch.float8_e4m3fn)
    assert fp8_bytes == fp8_numel
    assert fp8_bytes + scale_bytes < 1.01 * fp8_numel  # vs 2 bytes per weight in bf16, 4 in fp32
    assert fp8_numel > 0.9 * sum(t.numel() for t in tensors if t.dim() >= 2)  # the quantized part is most of it


def test_logits_match_hugging_face_on_the_dequantized_checkpoint(fp8_checkpoint, fp8_llm):
    """Both sides multiply by the same real weights W = e4m3 * scale in fp32 (W8A16 on the CPU):
    only summation order and MLA's absorbed decode differ, so the error stays at fp32 rounding
    (the 1e-4 relative bound of the unquantized oracle tests), orders of magnitude below what a
    wrong block scale (>= 2x on some block) or an upcast without scales would give."""
    _, hf, _ = fp8_checkpoint
    ids = make_prompts(seed=5)[6]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [num_tokens, vocab]
    assert max_rel_error(prefill_then_decode_logits(fp8_llm, ids), ref) < 1e-4


def test_greedy_tokens_equal_hugging_face_on_the_dequantized_checkpoint(fp8_checkpoint, fp8_llm):
    _, hf, _ = fp8_checkpoint
    prompts = make_prompts()[:4]
    assert [o.token_ids for o in fp8_llm.generate(prompts, GREEDY)] == [hf_greedy(hf, p) for p in prompts]


def test_attention_pods_open_only_the_shards_without_routed_experts(fp8_checkpoint, fp8_llm, monkeypatch):
    import safetensors

    opened, real_open = [], safetensors.safe_open

    def spy(file, *args, **kwargs):
        opened.append(os.path.basename(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    model = build_model(open_checkpoint(fp8_checkpoint[0]), "float32", "cpu", False, load_routed_experts=False)
    assert sorted(set(opened)) == ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"]
    full = dict(fp8_llm.engine.model.named_parameters())
    for name, param in model.named_parameters():
        if ".experts." in name:
            assert param.shape[0] == 0
        else:
            assert param.dtype == full[name].dtype and torch.equal(param.float(), full[name].float()), name


def _broken_copy(src: str, dst: str, edit_tensors=None, edit_config=None) -> str:
    shutil.copytree(src, dst)
    if edit_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(edit_config(config), f)
    if edit_tensors is not None:
        file = os.path.join(dst, "model-00002-of-00004.safetensors")
        tensors = edit_tensors(load_file(file))
        save_file(tensors, file, metadata={"format": "pt"})
        index_file = os.path.join(dst, "model.safetensors.index.json")
        with open(index_file) as f:
            index = json.load(f)
        index["weight_map"] = {
            n: s for n, s in index["weight_map"].items() if s != os.path.basename(file) or n in tensors
        }
        with open(index_file, "w") as f:
            json.dump(index, f)
    return dst


SCALE = "model.layers.1.self_attn.o_proj.weight_scale_inv"


@pytest.mark.parametrize(
    "edit_tensors, edit_config, message",
    [
        (
            lambda ts: {n: t for n, t in ts.items() if n != SCALE},
            None,
            r"'model\.layers\.1\.self_attn\.o_proj\.weight' is torch\.float8_e4m3fn but .* no 'model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv'",
        ),
        (
            lambda ts: ts | {SCALE: ts[SCALE][:1].contiguous()},
            None,
            r"'model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv' has shape \(1, 1\); .* must be \(2, 1\)",
        ),
        (
            lambda ts: {
                n: t for n, t in ts.items() if n != "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"
            },
            None,
            r"shared_experts\.gate_proj\.weight_scale_inv' but not the scale_inv of every part",
        ),
        (
            None,
            lambda c: c | {"quantization_config": QUANT_CONFIG | {"weight_block_size": [128, 96]}},
            r"weight_block_size \[128, 96\] is not supported",
        ),
        (
            None,
            lambda c: {k: v for k, v in c.items() if k != "quantization_config"},
            r"is torch\.float8_e4m3fn but config\.json declares no quantization_config",
        ),
    ],
    ids=["missing_scale", "wrong_scale_shape", "half_quantized_merged_linear", "block_size", "no_quant_config"],
)
def test_bad_fp8_checkpoints_are_rejected_naming_the_tensor(
    fp8_checkpoint, tmp_path, edit_tensors, edit_config, message
):
    path = _broken_copy(fp8_checkpoint[0], str(tmp_path / "broken"), edit_tensors, edit_config)
    with pytest.raises(ModelLoadError, match=message):
        LLM(path, num_blocks=8, show_progress=False)
