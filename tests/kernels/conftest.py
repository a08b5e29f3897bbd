"""Kernel tests run the Triton kernels on CPU tensors under the Triton interpreter.

TRITON_INTERPRET=1 is set for each test here (and only here). `moemesh.kernels._triton.launch`
reads it at launch time, so it takes effect even when another test folder imported
moemesh.kernels first, and it does not leak into other folders' tests.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
