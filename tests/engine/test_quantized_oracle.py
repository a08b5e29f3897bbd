"""The SmolLM2 GGUF with its Q4_1 / Q8_0 weights kept quantized (layers/quantized_linear.py)
against Hugging Face transformers running the same file dequantized to float32.

Teacher forcing: every prompt followed by HF's greedy continuation goes through one prefill; where
our argmax at each position is HF's next token, greedy decoding reproduces HF's tokens."""

from __future__ import annotations

import os

import pytest
import torch

from moemesh import LLM, kernels
from moemesh.engine.layers import quantized_linear

from .oracle_helpers import max_rel_error, prefill_logits

FLOAT32_BOUND = 1e-4  # dequantization is exact; only the matmuls' summation order differs
BFLOAT16_BOUND = 0.1  # bf16 activations, bf16-rounded scales: measured <= 0.075 on these prompts


@pytest.fixture(scope="module")
def teacher_forced(hf_model, prompt_ids, hf_greedy):
    """(sequences, HF's float32 logits of each) for every prompt + HF's greedy continuation."""
    sequences = [p + g for p, g in zip(prompt_ids, hf_greedy)]
    with torch.no_grad():
        return sequences, [hf_model(torch.tensor([s])).logits[0] for s in sequences]


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for name, t in [*model.named_buffers(), *model.named_parameters()] if "cos_sin" not in name}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_float32_quantized_model_matches_hf_logits_and_greedy_tokens(smollm_path, prompt_ids, teacher_forced):
    llm = LLM(smollm_path, dtype="float32", quantization="gguf", num_blocks=64, show_progress=False)
    forms = {m.form for m in llm.engine.model.modules() if hasattr(m, "form")}
    # Q4_1 projections and the Q8_0 tied embedding (SmolLM2's N: multiples of 64): no dense copy
    assert forms == ({"blocks"} if kernels.blocks_block_n() else {"nibbles", "int8"})
    sequences, refs = teacher_forced
    for prompt, seq, ours, ref in zip(prompt_ids, sequences, prefill_logits(llm, sequences), refs):
        assert max_rel_error(ours, ref) < FLOAT32_BOUND
        generated = slice(len(prompt) - 1, len(seq) - 1)  # positions that predict HF's greedy tokens
        assert ours[generated].argmax(-1).tolist() == seq[len(prompt) :]


@pytest.fixture(scope="module")
def bf16_llm(smollm_path):
    return LLM(smollm_path, dtype="bfloat16", quantization="gguf", num_blocks=128, show_progress=False)


def test_bfloat16_quantized_model_weights_stay_under_1_25x_the_file(bf16_llm, smollm_path):
    model = bf16_llm.engine.model
    forms = {"blocks"} if quantized_linear.bf16_code_blocks() else {"int4pack", "int8"}
    assert {m.form for m in model.modules() if hasattr(m, "form")} == forms
    assert weight_bytes(model) <= 1.25 * os.path.getsize(smollm_path)
    assert [n for n, p in model.named_parameters() if p.dim() > 1] == []  # only norm weights stay dense
    for module in (m for m in model.modules() if hasattr(m, "form")):
        floating = [b for b in module.buffers() if b.is_floating_point()]
        assert all(b.numel() <= module.out_features * module.in_features // 16 for b in floating), module


def test_bfloat16_quantized_model_agrees_with_hf_where_the_margin_exceeds_the_bound(
    bf16_llm, prompt_ids, hf_greedy, teacher_forced
):
    """bf16 rounding moves logits by up to ~8% of the largest one, so only positions whose top-2
    margin is larger than twice the bound must agree; over all positions most still do."""
    sequences, refs = teacher_forced
    num_safe = num_agree = 0
    for prompt, seq, ours, ref in zip(prompt_ids, sequences, prefill_logits(bf16_llm, sequences), refs):
        assert max_rel_error(ours, ref) < BFLOAT16_BOUND
        generated = slice(len(prompt) - 1, len(seq) - 1)
        top2 = ref[generated].topk(2, dim=-1).values  # [num_generated, 2]
        safe = (top2[:, 0] - top2[:, 1]) > 2 * BFLOAT16_BOUND * ref[generated].abs().amax(-1)
        agree = ours[generated].argmax(-1) == torch.tensor(seq[len(prompt) :])
        assert agree[safe].all()
        num_safe, num_agree = num_safe + int(safe.sum()), num_agree + int(agree.sum())
    num_generated = sum(len(g) for g in hf_greedy)
    assert num_safe >= 0.05 * num_generated  # the margin check covers some tokens (18 of 216 today)
    assert num_agree >= 0.9 * num_generated  # and greedy choices mostly agree everywhere (95% today)


def test_auto_keeps_gguf_weights_quantized_in_bfloat16_and_in_float32_where_the_c_kernels_build(monkeypatch):
    from types import SimpleNamespace

    from moemesh.engine.loader import gguf_quant

    checkpoint = SimpleNamespace(quantized={"model.layers.0.mlp.down_proj.weight": "Q4_1"})
    keeps = lambda q, dtype, device="cpu": gguf_quant.keeps_quantized(checkpoint, q, dtype, device)  # noqa: E731
    assert keeps("auto", "bfloat16") and keeps("gguf", "float16") and not keeps("none", "bfloat16")
    assert not keeps("auto", "float16") and not keeps("auto", "bfloat16", "cuda")
    assert keeps("auto", "float32") == kernels.quantized_kernels_built()
    monkeypatch.setattr(kernels, "quantized_kernels_built", lambda: False)
    assert not keeps("auto", "float32") and keeps("gguf", "float32")


def test_float32_by_default_keeps_the_file_quantized_under_1_25x(smollm_path):
    if not kernels.quantized_kernels_built():
        pytest.skip("no C compiler here: float32 dequantizes at load")
    llm = LLM(smollm_path, dtype="float32", num_blocks=16, show_progress=False)
    forms = {"blocks"} if kernels.blocks_block_n() else {"nibbles", "int8"}
    assert {m.form for m in llm.engine.model.modules() if hasattr(m, "form")} == forms
    assert weight_bytes(llm.engine.model) <= 1.25 * os.path.getsize(smollm_path)
