"""What the kernel modules share: the optional Triton import, the launch helper, launcher checks.

Triton is optional: without it (or without a GPU) `moemesh.kernels` still imports and serves
through the torch references. The kernel modules define their `@triton.jit` kernels only under
`if HAS_TRITON:`.

Interpreter: Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function, i.e. at
import time (ours and triton.language's own helpers), so a process that imported triton before
setting it would get compiled kernels that cannot run on CPU tensors. `launch` re-reads Triton's
knob (`triton.knobs.runtime.interpret`, i.e. TRITON_INTERPRET) at every launch and runs the
interpreted or the compiled form of the same Python function accordingly.

Two Triton 3.9 interpreter bugs the kernels and tests live with: bf16 `tl.dot` operands are
multiplied as raw bits (see `upcast_dot`), and fp32 -> bf16 casts truncate instead of rounding
to nearest even (the GPU rounds), so interpreted bf16 results carry up to one extra bf16 ulp.
"""

from __future__ import annotations

import os

import torch

# MOEMESH_TRITON=0: never import Triton (`moemesh serve` sets it for a worker on a CPU device,
# which only runs the torch references; it saves Triton's import on every process start).
triton = tl = None
HAS_TRITON = False
if os.environ.get("MOEMESH_TRITON", "1") != "0":
    try:
        import triton
        import triton.language as tl

        HAS_TRITON = True
    except ImportError:  # the CPU serving path needs only torch
        pass

_interpreted: dict = {}  # python function -> InterpretedFunction
_compiled: dict = {}  # python function -> JITFunction
_MISSING = object()


def interpreting() -> bool:
    return HAS_TRITON and bool(triton.knobs.runtime.interpret)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), interpreted iff TRITON_INTERPRET=1 now."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    fn = kernel.fn
    if not interpreting():
        if not isinstance(kernel, JITFunction):  # decorated while TRITON_INTERPRET=1
            if fn not in _compiled:
                _compiled[fn] = JITFunction(fn)
            kernel = _compiled[fn]
        kernel[grid](*args, **kwargs)
        return
    # The interpreter patches triton.language while it runs and does not undo all of it (device
    # function calls such as tl.sum patch triton.language.core for good), which breaks any later
    # compilation in this process; so everything it touches is restored afterwards. If triton was
    # imported before TRITON_INTERPRET=1, triton.language's own @jit helpers (tl.sum, tl.max,
    # tl.cumsum, ...) are compiled-mode objects too: interpreted ones stand in meanwhile.
    saved = [(obj, dict(vars(obj))) for obj in _language_objects()]
    try:
        for module in (tl, tl.core, tl.standard, tl.math):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, _interpreted_function(value.fn))
        interpreted = kernel if isinstance(kernel, InterpretedFunction) else _interpreted_function(fn)
        interpreted[grid](*args, **kwargs)
    finally:
        for obj, attrs in saved:
            if isinstance(obj, type):  # (names added to a module are the rewriter's globals: kept)
                for attr in [a for a in vars(obj) if a not in attrs]:
                    delattr(obj, attr)
            for attr, value in attrs.items():
                if vars(obj).get(attr, _MISSING) is not value:
                    setattr(obj, attr, value)


def _language_objects() -> list:
    """Modules and classes of triton.language that the interpreter patches."""
    core = tl.core
    return [tl, core, tl.math, tl.standard, core.tensor, core.dtype, core.tensor_descriptor_base] + (
        [core.condition] if hasattr(core, "condition") else []
    )


def _interpreted_function(fn):
    from triton.runtime.interpreter import InterpretedFunction

    if fn not in _interpreted:
        _interpreted[fn] = InterpretedFunction(fn)
    return _interpreted[fn]


def check_launchable(name: str, *tensors: torch.Tensor) -> None:
    """Triton present; all tensors on one device, CUDA unless the interpreter runs (then CPU)."""
    if not HAS_TRITON:
        raise ValueError(f"{name}: triton is not installed; call the dispatch function or {name[:-7]}_ref")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors are on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    if interpreting():
        if device.type != "cpu":
            raise ValueError(f"{name}: TRITON_INTERPRET=1 runs on CPU tensors, got {device}")
    elif device.type != "cuda":
        raise ValueError(f"{name}: needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_dtype(name: str, what: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: {what} must be one of {[str(d) for d in allowed]}, got {t.dtype}")


def check_shape(name: str, what: str, t: torch.Tensor, shape: tuple) -> None:
    """`shape` entries are ints or None (any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: {what} must have shape {want}, got {list(t.shape)}")


def check_contiguous(name: str, what: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous, got strides {t.stride()}")


def check_inner_contiguous(name: str, what: str, t: torch.Tensor, num_dims: int) -> None:
    """The last `num_dims` dims are dense (the leading dim may have any stride, e.g. a split of qkv)."""
    expected = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - num_dims, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            raise ValueError(f"{name}: the last {num_dims} dims of {what} must be dense, got strides {t.stride()}")
        expected *= t.shape[dim]


def check_out(name: str, out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The caller's output buffer (checked) or a new one."""
    if out is None:
        return scratch(shape, like.dtype, like.device)
    check_shape(name, "out", out, shape)
    if out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{name}: out must be {like.dtype} on {like.device}, got {out.dtype} on {out.device}")
    check_contiguous(name, "out", out)
    return out


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, except under the interpreter: filled with NaN (or the most negative integer),
    so an element a kernel should have written but did not shows up in the tests."""
    if not interpreting():
        return torch.empty(shape, dtype=dtype, device=device)
    poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, poison, dtype=dtype, device=device)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact fp32 products (the references' accuracy), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether kernels cast tl.dot operands to fp32 first.

    Triton 3.9's interpreter multiplies bf16 tl.dot operands as their raw uint16 bit patterns
    (`InterpreterBuilder.create_dot` calls np.matmul on the storage), which gives garbage; on the
    GPU the operands stay bf16 for the tensor cores.
    """
    return interpreting() and dtype == torch.bfloat16
