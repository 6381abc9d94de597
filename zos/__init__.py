"""zos: decode-step metadata prepared on the GPU, inside CUDA-graph static buffers.

The path of one decode step, top to bottom:
    zos.step.DecodeStep        what the scheduler changed this step (host numpy)
    zos._C.StepPacker          remap + validation + one sparse staging record (C++)
    zos.device_backend         the record into a slot of zos.staging_ring (read in place)
                               or one H2D copy, then zos.kernels.launch_prep
    triton_kernels/prep.py     rebuild input_ids, positions, seq_lens, query_start_loc,
                               block_table, slot_mapping in place; dummy rows at the tail
    zos.buffers                the static buffers and their per-bucket views (StepMetadata)
    zos.spec                   with draft tokens: n-gram drafts and greedy verification
zos.host_backend builds the same buffers on the host (the baseline, numba), zos.buckets holds
the bucket tables of vLLM, SGLang, TensorRT-LLM and DeepInfer, and zos.serving is the harness
(paged Llama, graph runner, engine, demo) that the library never imports.

Names are resolved lazily (PEP 562): ``import zos`` loads nothing heavy, ``zos.buckets`` needs
neither torch nor numba, and only the host baseline imports numba. Without CUDA, the Triton
kernels run in Triton's CPU interpreter (see :mod:`zos._interpret`).
"""
from __future__ import annotations

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "StepPacker": "zos._C", "compute_remap": "zos._C",
    "MetadataBackend": "zos.backend", "StepPlan": "zos.backend",
    "BucketTable": "zos.buckets", "from_policy": "zos.buckets",
    "DecodeBuffers": "zos.buffers", "StepMetadata": "zos.buffers",
    "NULL_BLOCK": "zos.buffers", "PAD_SLOT_ID": "zos.buffers", "PaddingProfile": "zos.buffers",
    "DeviceMetadataBackend": "zos.device_backend",
    "HostMetadataBackend": "zos.host_backend",
    "DecodeStep": "zos.step",
    "paged_decode_attention": "zos.attention",
    "launch_prep": "zos.kernels",
    "SpecDecoder": "zos.spec",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zos' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
