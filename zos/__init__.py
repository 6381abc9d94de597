"""zos: decode-step metadata prepared on the GPU, inside CUDA-graph static buffers.

The path of one decode step, top to bottom:
    zos.step.DecodeStep        what the scheduler changed this step (host numpy)
    zos._C.StepPacker          remap + validation + one packed staging record (C++)
    zos.device_backend         one H2D copy, then zos.kernels.launch_prep
    triton_kernels/prep.py     rebuild input_ids, positions, seq_lens, query_start_loc,
                               block_table, slot_mapping in place; dummy rows at the tail
    zos.buffers                the static buffers and their per-bucket views
zos.host_backend builds the same buffers on the host (the baseline), and
zos.buckets holds the bucket tables of vLLM, SGLang, TensorRT-LLM and DeepInfer.

Without CUDA, zos's Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 is set
here (unless already set) because Triton reads it when a kernel is defined, at import.
"""
import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from zos._C import StepPacker, compute_remap
from zos.backend import MetadataBackend, StepPlan
from zos.buckets import BucketTable, from_policy
from zos.buffers import NULL_BLOCK, PAD_SLOT_ID, DecodeBuffers, DecodeMetadata
from zos.device_backend import DeviceMetadataBackend
from zos.host_backend import HostMetadataBackend
from zos.step import DecodeStep

__all__ = [
    "BucketTable", "DecodeBuffers", "DecodeMetadata", "DecodeStep", "DeviceMetadataBackend",
    "HostMetadataBackend", "MetadataBackend", "NULL_BLOCK", "PAD_SLOT_ID", "StepPacker",
    "StepPlan", "compute_remap", "from_policy",
]
