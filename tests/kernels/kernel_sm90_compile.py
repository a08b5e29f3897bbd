"""Compile every Triton launcher's kernels for sm_90 (H100/H200) without a GPU.

`triton.compile` with an explicit GPUTarget runs the whole CUDA pipeline (TTIR -> TTGIR -> LLVM
-> PTX -> cubin with the bundled ptxas) on the CPU. The launchers run on `meta` tensors at
serving sizes with `launch` replaced by a compile, so the constexprs, warps and stages are the
ones the launcher picks on a GPU; the compiled kernel must also fit the SM's shared memory.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 232448  # 227 KiB opt-in shared memory per block on sm_90

_PTR = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def compile_launch(kernel, grid, *args, **kwargs) -> dict:
    """What `launch` would run, compiled for sm_90; returns the compiled kernel's metadata."""
    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
    values = dict(zip([p.name for p in params], args)) | kwargs
    signature, constexprs = {}, {}
    for p in params:
        v = values[p.name]
        if "constexpr" in str(p.annotation):
            signature[p.name] = "constexpr"
            constexprs[p.name] = False if p.name == "UPCAST_DOT" else v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = _PTR[v.dtype]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32" if -(2**31) <= int(v) < 2**31 else "i64"
    compiled = triton.compile(
        ASTSource(fn=JITFunction(fn), signature=signature, constexprs=constexprs), target=SM90, options=options
    )
    shared = compiled.metadata.shared
    assert shared <= MAX_SHARED_BYTES, f"{fn.__name__} needs {shared} bytes of shared memory"
    return {"name": fn.__name__, "shared": shared, "num_warps": compiled.metadata.num_warps}
