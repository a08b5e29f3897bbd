"""MoE engine tests: tiny models, so one intra-op thread (faster than two here, and immune to
the other core being busy); the previous setting is restored after the package."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
