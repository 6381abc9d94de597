"""Test set-up. Without a GPU, ``import zos`` makes Triton run its kernels in the CPU
interpreter (TRITON_INTERPRET=1); the same suite runs on a GPU (CUDA tensors, compiled
kernels, CUDA graphs) unchanged."""
import zos._interpret  # noqa: F401  (before anything imports triton)

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
