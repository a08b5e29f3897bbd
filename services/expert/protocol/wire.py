"""Tensors on the wire: raw little-endian C-order bytes with dtype and shape (expert.proto
`Tensor`). No pickle; bfloat16 travels as its two bytes per element."""

from __future__ import annotations

import torch

from moemesh.proto.v1 import expert_pb2

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(ValueError):
    """A Tensor message that does not describe a valid tensor (maps to INVALID_ARGUMENT)."""


def tensor_to_proto(tensor: torch.Tensor) -> expert_pb2.Tensor:
    if tensor.dtype not in _NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot be sent; use one of {sorted(DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return expert_pb2.Tensor(dtype=_NAMES[tensor.dtype], shape=list(tensor.shape), data=data)


def tensor_from_proto(message: expert_pb2.Tensor, name: str = "tensor", ndim: int | None = None) -> torch.Tensor:
    """A writable CPU tensor; raises WireError naming `name` when the message is inconsistent."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"{name}: dtype {message.dtype!r} is not one of {sorted(DTYPES)}")
    shape = tuple(message.shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{name}: expected {ndim} dimensions, got shape {list(shape)}")
    if any(n < 0 for n in shape):
        raise WireError(f"{name}: negative size in shape {list(shape)}")
    numel = 1
    for n in shape:
        numel *= n
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(message.data) != expected:
        raise WireError(
            f"{name}: shape {list(shape)} of {message.dtype} needs {expected} bytes, got {len(message.data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data), dtype=dtype).view(shape)
