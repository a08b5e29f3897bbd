"""A checkpoint's RoPE scaling: parsed and checked once from config.json, then the inverse
frequencies and the cos/sin factor the rotary layer bakes into its table.

Types (HF `rope_type`, or the older `type`): `default`, `linear` (positions / factor), `llama3`
(per-band wavelength smoothing) and `yarn`. YaRN (arXiv 2309.00071; DeepSeek-V3's
inference/model.py `precompute_freqs_cis`, transformers' `_compute_yarn_parameters`):
    low, high = correction range of dims d whose wavelength 2 pi / theta_d completes between
                beta_fast and beta_slow rotations over original_max_position (floor / ceil when
                `truncate`, the default), clamped to [0, rotary_dim - 1]
    ramp_d    = clamp((d - low) / (high - low), 0, 1)       over the rotary_dim / 2 frequencies
    inv_freq  = theta_d / factor * ramp_d + theta_d * (1 - ramp_d)
and cos/sin are multiplied by the attention factor: `attention_factor` when given, else
mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor),
with mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1). DeepSeek-V3 additionally multiplies the
softmax scale by mscale(factor, mscale_all_dim)^2 (see models/deepseek_v3.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moemesh.engine.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # one of ROPE_TYPES other than "default"
    factor: float
    original_max_position: int | None = None  # llama3 and yarn: the pre-training context length
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn, and DeepSeek's softmax-scale correction
    attention_factor: float | None = None  # yarn: an explicit cos/sin factor
    truncate: bool = True  # yarn: floor / ceil the correction range

    @classmethod
    def from_hf(cls, scaling: dict | None, hf: dict) -> RopeScaling | None:
        """`scaling` is config.json's rope_scaling / rope_parameters; None for plain RoPE.
        Raises ModelLoadError naming the field that is wrong."""
        if scaling is None:
            return None
        if not isinstance(scaling, dict):
            raise ModelLoadError(f"config.json rope_scaling must be an object, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ModelLoadError(
                f"config.json rope_scaling.rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if kind == "default":
            return None
        kw: dict = {"factor": _number(scaling, "factor", kind, positive=True)}
        kw["mscale_all_dim"] = _number(scaling, "mscale_all_dim", kind, optional=True)  # any type, as in HF
        if kind in ("llama3", "yarn"):
            # transformers: a top-level original_max_position_embeddings wins, then the scaling's,
            # then max_position_embeddings
            name = "original_max_position_embeddings"
            source = hf if hf.get(name) is not None else scaling if scaling.get(name) is not None else {}
            source = source or {name: hf.get("max_position_embeddings")}
            kw["original_max_position"] = int(_number(source, name, kind, positive=True))
        if kind == "llama3":
            kw["low_freq_factor"] = _number(scaling, "low_freq_factor", kind, positive=True)
            kw["high_freq_factor"] = _number(scaling, "high_freq_factor", kind, positive=True)
            if kw["high_freq_factor"] <= kw["low_freq_factor"]:
                raise ModelLoadError("config.json rope_scaling.high_freq_factor must exceed low_freq_factor")
        if kind == "yarn":
            kw["beta_fast"] = _number(scaling, "beta_fast", kind, optional=True) or 32.0
            kw["beta_slow"] = _number(scaling, "beta_slow", kind, optional=True) or 1.0
            for name in ("mscale", "attention_factor"):
                kw[name] = _number(scaling, name, kind, optional=True)
            kw["truncate"] = bool(scaling.get("truncate", True))
        return cls(kind, **kw)

    def inv_freq(self, rotary_dim: int, base: float) -> torch.Tensor:  # [rotary_dim / 2] float64
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        return self._yarn(inv_freq, rotary_dim, base)

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        factor, low, high, old_len = (
            self.factor,
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position,
        )
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)

    def _yarn(self, inv_freq: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
        def correction_dim(num_rotations: float) -> float:
            return (
                rotary_dim * math.log(self.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # as the references do: no division by zero
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)


def _number(scaling: dict, name: str, kind: str, positive: bool = False, optional: bool = False) -> float | None:
    value = scaling.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = "is missing" if value is None else f"must be a number, got {value!r}"
        raise ModelLoadError(f"config.json rope_scaling.{name} {what} (rope_type {kind!r})")
    if positive and not value > 0:
        raise ModelLoadError(f"config.json rope_scaling.{name} must be > 0, got {value!r} (rope_type {kind!r})")
    return float(value)
