"""Model architectures, looked up by the `architectures` name of a Hugging Face config."""

from __future__ import annotations

from torch import nn

from moemesh.engine.errors import ModelLoadError


def get_model_class(architecture: str) -> type[nn.Module]:
    from moemesh.engine.models.llama import LlamaForCausalLM

    registry = {"LlamaForCausalLM": LlamaForCausalLM}
    if architecture not in registry:
        raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {sorted(registry)}")
    return registry[architecture]
