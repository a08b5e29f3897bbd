"""Model architectures, looked up by the `architectures` name of a Hugging Face config."""

from __future__ import annotations

from torch import nn

from moemesh.engine.errors import ModelLoadError


def get_model_class(architecture: str) -> type[nn.Module]:
    from moemesh.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
    from moemesh.engine.models.llama import LlamaForCausalLM
    from moemesh.engine.models.mixtral import MixtralForCausalLM
    from moemesh.engine.models.qwen3_moe import Qwen3MoeForCausalLM

    registry = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    }
    if architecture not in registry:
        raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {sorted(registry)}")
    return registry[architecture]
