"""Marks shared by test modules in several packages."""

from __future__ import annotations

import pytest
import torch

__all__ = ["GPU_ONLY"]

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
"""A module's ``pytestmark`` for tests that need a CUDA device: marked ``gpu``, skipped
without one."""
