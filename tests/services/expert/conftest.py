"""Expert-service fixtures: tiny random MoE checkpoints (transformers' own classes), their Hugging
Face greedy outputs from `generate`, and the in-process engine with local experts as oracles."""

from __future__ import annotations

import pytest
import torch

from tests.engine.moe.conftest import one_thread  # noqa: F401 - the same package-wide fixture
from tests.engine.moe.fp8_models import save_fp8_deepseek_v3
from tests.engine.moe.models import build_deepseek_v3, build_qwen3_moe, make_prompts, save_tiny


def hf_generate(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def local_engine(path: str):
    from moemesh import LLM

    return LLM(path, dtype="float32", num_blocks=256, max_model_len=256, show_progress=False)


@pytest.fixture(scope="package")
def qwen3(tmp_path_factory):
    """(checkpoint dir, HF model)."""
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    return path, save_tiny(build_qwen3_moe, path)


@pytest.fixture(scope="package")
def deepseek(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_v3"))
    return path, save_tiny(build_deepseek_v3, path)


@pytest.fixture(scope="package")
def fp8_deepseek(tmp_path_factory):
    """(block-FP8 checkpoint dir in the released layout, HF model on its fp32 dequantization)."""
    path = str(tmp_path_factory.mktemp("deepseek_v3_fp8"))
    hf, _ = save_fp8_deepseek_v3(path, str(tmp_path_factory.mktemp("deepseek_v3_dequantized")))
    return path, hf


@pytest.fixture(scope="package")
def prompts():
    return make_prompts()
