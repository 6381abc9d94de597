"""This process's place among several (``torch.distributed``): start, stop, metadata checksums.

``init_distributed`` starts ``torch.distributed`` (NCCL on CUDA, one GPU per rank; gloo on a
CPU) and a gloo group on the host for small host-side collectives (the setup of the step
transports of :mod:`zos.serving.dist_transport`, the metadata checks), so that they never wait
for the GPU (vLLM keeps such a CPU group too).
"""
from __future__ import annotations

import gc
import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zos.buffers import DecodeBuffers

CHECKSUM_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
                   "block_table", "counts", "sampled")


@dataclass
class DistContext:
    """This process's place: ``rank`` of ``world_size``, its ``device`` (cuda:LOCAL_RANK or
    cpu), ``backend`` of the default group ("nccl" or "gloo") and ``cpu_group`` (gloo) for
    host-side collectives."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    cpu_group: object


def init_distributed(*, rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None, device: str | None = None,
                     timeout_s: float = 600.0) -> DistContext:
    """Start ``torch.distributed`` (once per process) and return this rank's context.

    Args:
        rank, world_size, init_method: None under ``torchrun`` (read from RANK, WORLD_SIZE,
            MASTER_ADDR, MASTER_PORT: ``env://``); given by a spawner otherwise (e.g.
            ``file:///tmp/x``).
        device: "cuda" or "cpu"; None picks cuda when available. On CUDA the rank uses GPU
            LOCAL_RANK (default: rank) and NCCL; on a CPU, gloo.
        timeout_s: collective timeout (a rank that died does not hang the others forever).

    Raises:
        ValueError: ``device`` not "cuda"/"cpu", or "cuda" without a GPU.
    """
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no GPU is visible")
    backend = "nccl" if cuda else "gloo"
    if cuda:  # the GPU first: NCCL's communicator is made on the current device
        local = os.environ.get("LOCAL_RANK", rank if rank is not None else os.environ["RANK"])
        torch.cuda.set_device(int(local))
    if not dist.is_initialized():
        kw = dict(backend=backend, timeout=timedelta(seconds=timeout_s),
                  init_method=init_method or "env://")
        if rank is not None:
            kw.update(rank=rank, world_size=world_size)
        dist.init_process_group(**kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistContext(rank, world, dev, backend, cpu_group)


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave ``torch.distributed`` on every rank: collect garbage and synchronize the GPU, so
    that no CUDA graph with an NCCL collective captured in it (the TP decode graphs) outlives
    its communicator, then a barrier on the host group and ``destroy_process_group``. Callers
    drop their engines first. (On 2 x H200, torch 2.11 and NCCL 2.28, a TP rank that destroyed
    the process group with its engine's graphs alive and no barrier hung there.)

    Raises:
        RuntimeError: the barrier timed out (a rank did not reach it) or the group failed."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    dist.barrier(group=ctx.cpu_group)
    dist.destroy_process_group()


def metadata_checksum(buffers: DecodeBuffers) -> str:
    """A 64-bit BLAKE2b digest (hex) of the whole of the buffers' ``CHECKSUM_FIELDS`` (every
    row, not only the step's): equal digests mean byte-identical metadata. Syncs the device."""
    h = hashlib.blake2b(digest_size=8)
    for name in CHECKSUM_FIELDS:
        h.update(getattr(buffers, name).cpu().numpy().tobytes())
    return h.hexdigest()


def compare_metadata(buffers: DecodeBuffers, ctx: DistContext, log: list) -> None:
    """Gather every rank's checksum; RuntimeError on all ranks if they differ."""
    got = [None] * ctx.world_size
    dist.all_gather_object(got, metadata_checksum(buffers), group=ctx.cpu_group)
    log.append(got)
    if len(set(got)) != 1:
        raise RuntimeError(f"tensor parallelism: metadata buffers differ across ranks after "
                           f"decode step {len(log)}: checksums {got}")
