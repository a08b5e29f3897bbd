"""Instantiate a model from a checkpoint and copy its weights in, with a progress bar; and the
multi-token-prediction layer of a DeepSeek-V3 checkpoint (its `model.layers.{N + i}.*` tensors,
which the main model skips) as a speculative drafter."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from moemesh.engine.errors import ConfigError, ModelLoadError
from moemesh.engine.layers.moe import RoutedExperts
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.loader.fp8_checkpoint import (
    Fp8Plan,
    cast_floating,
    loaded_tensors,
    plan_fp8,
    read_fp8_block,
    tensor_names,
    weight_name,
)
from moemesh.engine.loader.gguf_quant import keeps_quantized, plan_gguf
from moemesh.engine.models import get_model_class
from moemesh.engine.models.expert_names import is_routed_expert_weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def build_model(
    checkpoint: Checkpoint,
    dtype: str,
    device: str,
    show_progress: bool = True,
    load_routed_experts: bool = True,
    quantization: str = "auto",
) -> nn.Module:
    """`load_routed_experts=False`: MoE layers hold no routed expert weights (neither read nor
    allocated); only a remote ExpertExecutor can run them. `quantization` (ModelConfig): whether
    a GGUF file's quantized projections and embedding stay quantized (loader/gguf_quant.py)."""
    cfg = TransformerConfig.from_hf(checkpoint.hf_config)
    model_class = get_model_class(cfg.architecture)
    with on_meta_without_init():
        model = model_class(cfg)
    select = None
    if not load_routed_experts:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                module.drop_weights()
        select = lambda name: not is_routed_expert_weight(weight_name(name))  # noqa: E731 - scales too
    return _load(
        model,
        cfg,
        checkpoint,
        select,
        dtype,
        device,
        show_progress,
        cfg.architecture,
        swap_fp8=True,
        keep_gguf_quantized=keeps_quantized(checkpoint, quantization, dtype, device),
    )


def build_mtp_model(checkpoint: Checkpoint, dtype: str, device: str) -> nn.Module:
    """The checkpoint's first MTP layer (`models/deepseek_mtp.py`), routed experts included.
    Raises ConfigError when the checkpoint has none (another architecture,
    `num_nextn_predict_layers` 0 or absent, or no `model.layers.{num_hidden_layers}.*` tensors)."""
    from moemesh.engine.models.deepseek_mtp import DeepseekMTP, mtp_weight_prefix, num_mtp_layers

    cfg = TransformerConfig.from_hf(checkpoint.hf_config)
    if cfg.architecture not in _MTP_ARCHITECTURES:
        raise ConfigError(
            f"speculative method 'mtp' needs a model with multi-token-prediction layers "
            f"({', '.join(_MTP_ARCHITECTURES)}); {checkpoint.model_id!r} is {cfg.architecture}"
        )
    if num_mtp_layers(checkpoint.hf_config) < 1:
        raise ConfigError(
            f"speculative method 'mtp': {checkpoint.model_id!r} has no multi-token-prediction "
            f"layer (config.json num_nextn_predict_layers is "
            f"{checkpoint.hf_config.get('num_nextn_predict_layers', 'absent')})"
        )
    with on_meta_without_init():
        model = DeepseekMTP(cfg)
    prefix = mtp_weight_prefix(checkpoint.hf_config)
    if not any(True for _ in checkpoint.iter_weights(lambda name: name.startswith(prefix))):
        raise ConfigError(
            f"speculative method 'mtp': {checkpoint.model_id!r} declares num_nextn_predict_layers "
            f"{num_mtp_layers(checkpoint.hf_config)} but has no {prefix}* weights (the MTP layer "
            f"was left out of this checkpoint)"
        )
    return _load(model, cfg, checkpoint, model.select_weight, dtype, device, False, f"{cfg.architecture} MTP layer")


@contextlib.contextmanager
def on_meta_without_init() -> Iterator[None]:
    """Build modules on the meta device without their parameter initialisers (as transformers'
    `no_init_weights`): the weights come from the checkpoint, and an initialiser on a meta tensor
    still goes through torch._refs, whose first use imports torch._dynamo (~1 s per process)."""
    skipped = (
        "uniform_",
        "normal_",
        "trunc_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "constant_",
        "zeros_",
        "ones_",
        "orthogonal_",
    )
    saved = {name: getattr(nn.init, name) for name in skipped}
    try:
        for name in skipped:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _load(
    model: nn.Module,
    cfg: TransformerConfig,
    checkpoint: Checkpoint,
    select: Callable[[str], bool] | None,
    dtype: str,
    device: str,
    show_progress: bool,
    label: str,
    swap_fp8: bool = False,
    keep_gguf_quantized: bool = False,
) -> nn.Module:
    """Materialize a model built on the meta device and copy the selected tensors in."""
    fp8 = _fp8_plan(model, checkpoint, select, swap_fp8)  # None: not a block-FP8 checkpoint
    gguf = None
    if keep_gguf_quantized:
        gguf = plan_gguf(model, checkpoint, select, DTYPES[dtype])
        outer = select
        select = lambda name: not gguf.owns(name) and (outer is None or outer(name))  # noqa: E731
    model = cast_floating(model.to_empty(device="cpu"), torch.float32)  # float8 weights stay float8
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
        model.load_weights(loaded_tensors(weights) if fp8 is None else fp8.stream(weights))
        if fp8 is not None:
            fp8.finish()
        if gguf is not None:
            gguf.load(checkpoint)
    except ValueError as e:
        raise ModelLoadError(f"checkpoint does not fit {label}: {e}") from e
    tables = {m: m.cos_sin_cache for m in model.modules() if hasattr(m, "cos_sin_cache")}
    model = cast_floating(model, DTYPES[dtype]).to(device=device)
    moved: dict[int, torch.Tensor] = {}
    for module, table in tables.items():  # RoPE tables stay float32 and shared by the layers, any dtype
        module.cos_sin_cache = moved.setdefault(id(table), table.to(device))
    return model.eval()


def _fp8_plan(
    model: nn.Module, checkpoint: Checkpoint, select: Callable[[str], bool] | None, swap: bool
) -> Fp8Plan | None:
    """A block-FP8 checkpoint (loader/fp8_checkpoint.py): with `swap`, FP8 modules replace the
    model's Linears / routed experts that have scales (the model is still on meta); without,
    every scaled tensor is dequantized as it is read."""
    block = read_fp8_block(checkpoint.hf_config)
    if block is None:
        return None
    names = [name for name in tensor_names(checkpoint) if select is None or select(name)]
    return plan_fp8(model, names, block) if swap else Fp8Plan(names, block)
