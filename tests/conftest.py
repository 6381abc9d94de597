"""Test set-up: without a GPU, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, hence here. The same
suite runs on a GPU (CUDA tensors, compiled kernels, CUDA graphs) unchanged.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
