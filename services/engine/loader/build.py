"""Instantiate a model from a checkpoint and copy its weights in, with a progress bar."""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.layers.moe import RoutedExperts
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.models import get_model_class
from moemesh.engine.models.config import TransformerConfig
from moemesh.engine.models.expert_names import is_routed_expert_weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(
    checkpoint: Checkpoint, dtype: str, device: str, show_progress: bool = True, load_routed_experts: bool = True
) -> nn.Module:
    """`load_routed_experts=False`: MoE layers hold no routed expert weights (neither read nor
    allocated); only a remote ExpertExecutor can run them."""
    cfg = TransformerConfig.from_hf(checkpoint.hf_config)
    model_class = get_model_class(cfg.architecture)
    with torch.device("meta"):
        model = model_class(cfg)
    select = None
    if not load_routed_experts:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                module.drop_weights()
        select = lambda name: not is_routed_expert_weight(name)  # noqa: E731
    model = model.to_empty(device="cpu").float()
    for module in model.modules():  # buffers computed in __init__ are lost on meta; rebuild them
        if hasattr(module, "cos_sin_cache"):
            fresh = type(module)(
                module.cos_sin_cache.shape[-1], cfg.max_position, cfg.rope_theta, cfg.rope_scaling, module.is_neox_style
            )
            module.cos_sin_cache = fresh.cos_sin_cache
    weights = tqdm(
        checkpoint.iter_weights(select),
        total=checkpoint.num_tensors,
        desc="loading weights",
        unit="tensor",
        disable=not show_progress,
        leave=False,
    )
    try:
        model.load_weights((name, tensor.float()) for name, tensor in weights)
    except ValueError as e:
        raise ModelLoadError(f"checkpoint does not fit {cfg.architecture}: {e}") from e
    model = model.to(device=device, dtype=DTYPES[dtype])
    for module in model.modules():  # keep RoPE tables in float32 whatever the model dtype
        if hasattr(module, "cos_sin_cache"):
            module.cos_sin_cache = module.cos_sin_cache.float()
    return model.eval()
