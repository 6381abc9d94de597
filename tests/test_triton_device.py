"""A CPU backend on a machine whose Triton compiles for the GPU fails at construction with the
remedy (TRITON_INTERPRET=1 before triton is imported), not deep inside a Triton launch
("Pointer argument ... cannot be accessed from Triton (cpu tensor?)"). Such a machine is
simulated here: CUDA reported available, zos's kernels reported not interpreted."""
import zos._interpret

import os

import pytest
import torch

from zos import DecodeBuffers, DeviceMetadataBackend, HostMetadataBackend, SpecDecoder
from zos.serving.engine import Engine, EngineConfig
from zos.serving.models import random_llama

from helpers import LLAMA_CFG

REMEDY = r"TRITON_INTERPRET=1 in the environment before triton is imported"


@pytest.fixture
def cuda_machine(monkeypatch):
    """A machine with CUDA where triton was imported without TRITON_INTERPRET."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(zos._interpret, "kernels_interpreted", lambda: False)


def test_detection_matches_the_environment():
    """zos's kernels are interpreted exactly when TRITON_INTERPRET was on at their definition
    (zos turns it on where there is no CUDA)."""
    on = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert zos._interpret.kernels_interpreted() is on


def test_device_backend_on_cpu_buffers(cuda_machine):
    buffers = DecodeBuffers(4, 2, 16, device="cpu")
    with pytest.raises(ValueError, match=rf"^DeviceMetadataBackend: buffers: device is cpu, "
                       rf"but this machine has CUDA.*{REMEDY}"):
        DeviceMetadataBackend(buffers, num_kv_blocks=8, vocab_size=100)
    HostMetadataBackend(buffers, num_kv_blocks=8, vocab_size=100)  # no Triton: fine


def test_spec_decoder_on_cpu_buffers(cuda_machine):
    buffers = DecodeBuffers(4, 2, 16, uniform_decode_query_len=3, device="cpu")
    with pytest.raises(ValueError, match=rf"^SpecDecoder: buffers: device is cpu.*{REMEDY}"):
        SpecDecoder(buffers, num_kv_blocks=8, num_draft_tokens=2)


@pytest.mark.parametrize("backend,spec", [("zos", 0), ("host", 2)])
def test_engine_on_cpu(cuda_machine, backend, spec):
    """``Engine(..., device="cpu")``: the zos backend, or the drafter's kernels, refuse at
    construction; the host backend alone builds (its model runs torch ops on a CPU)."""
    model = random_llama(LLAMA_CFG, seed=0)
    cfg = EngineConfig(block_size=4, num_kv_blocks=16, max_num_seqs=4, max_model_len=32,
                       backend=backend, use_cuda_graph=False, bucket_policy=None,
                       num_draft_tokens=spec)
    with pytest.raises(ValueError, match=REMEDY):
        Engine(model, cfg, "cpu")
    Engine(model, EngineConfig(block_size=4, num_kv_blocks=16, max_num_seqs=4, max_model_len=32,
                               backend="host", use_cuda_graph=False, bucket_policy=None), "cpu")


def test_model_triton_kernels_on_cpu(cuda_machine):
    """The paged Llama with kernels="triton" on CPU tensors refuses before its first kernel;
    with the default it runs torch ops there."""
    from zos.serving.models.llama import model_ops

    with pytest.raises(ValueError, match=rf"^LlamaForCausalLM\(kernels='triton'\).*{REMEDY}"):
        model_ops("triton", torch.device("cpu"))
    assert model_ops(None, torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="kernels: expected one of"):
        model_ops("cuda", torch.device("cpu"))
