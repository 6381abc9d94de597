"""Worker processes of tests/test_distributed.py (spawned: they must be importable top-level
functions). Each rank writes what it saw to ``<out>/rank<r>.json``; the test compares. Not a
test file and no fixtures: the spawned children import it by name from the tests directory."""
from __future__ import annotations

import json
import os
import random

import torch
import torch.distributed as dist

from zos.serving.distributed import dp_generate, init_distributed, tp_generate
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.models import random_llama
from zos.serving.models.parallel import tp_llama

from helpers import LLAMA_BLOCK_SIZE, LLAMA_CFG

BACKENDS = ("host", "zos")


def engine_config(backend: str) -> EngineConfig:
    """Small and tight: 6 rows, buckets 1, 2, 4 (5 and 6 run eagerly), 15 usable blocks of 4
    tokens (preemption happens), eos 7."""
    return EngineConfig(block_size=LLAMA_BLOCK_SIZE, num_kv_blocks=16, max_num_seqs=6,
                        max_model_len=32, max_prefill_tokens=24, eos_token_id=7,
                        backend=backend, use_cuda_graph=True, buckets=[1, 2, 4])


def make_requests(seed: int, n: int, max_new: int) -> list[Request]:
    """``n`` seeded requests: prompts of 1..11 ids, 1..max_new new tokens, arrivals spread."""
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(LLAMA_CFG.vocab_size) for _ in range(rng.randint(1, 11))],
                    rng.randint(1, max_new), arrival=float(i)) for i in range(n)]


def dp_requests(rank: int) -> list[Request]:
    """Rank 0: 7 requests up to 12 tokens; rank 1: 2 short ones (it goes idle early)."""
    return make_requests(100 + rank, 7, 12) if rank == 0 else make_requests(200, 2, 3)


def _start(rank: int, world: int, init: str):
    """gloo on a CPU; NCCL with one GPU per rank where CUDA is (the test needs 2 GPUs then)."""
    torch.set_num_threads(1)  # two ranks share the CPU cores
    return init_distributed(rank=rank, world_size=world, init_method=init, timeout_s=600)


def _write(out: str, rank: int, data: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)


def tp_worker(rank: int, world: int, init: str, out: str, seed: int, overlap: bool) -> None:
    """TP over ``world`` ranks, both backends in turn, metadata checked every decode step."""
    ctx = _start(rank, world, init)
    full = random_llama(LLAMA_CFG, seed=0, device=ctx.device)
    model = tp_llama(full.state_dict(), LLAMA_CFG, rank, world, device=ctx.device)
    data = {}
    for backend in BACKENDS:
        engine = Engine(model, engine_config(backend), ctx.device, overlap=overlap)
        result, extra = tp_generate(engine, make_requests(seed, 6, 12), ctx,
                                    check_metadata=True)
        if rank == 0:
            data[backend] = dict(outputs=result.outputs, checksums=extra.checksums,
                                 decode_steps=result.totals["decode_steps"],
                                 preemptions=result.totals["preemptions"])
        else:
            data[backend] = dict(checksums=extra)
    _write(out, rank, data)
    dist.destroy_process_group()


def dp_worker(rank: int, world: int, init: str, out: str, overlap: bool) -> None:
    """DP over ``world`` ranks (each its own requests), both backends in turn."""
    ctx = _start(rank, world, init)
    model = random_llama(LLAMA_CFG, seed=0, device=ctx.device)
    data = {}
    for backend in BACKENDS:
        engine = Engine(model, engine_config(backend), ctx.device, overlap=overlap)
        outputs, stats = dp_generate(engine, dp_requests(rank), ctx)
        data[backend] = dict(outputs=outputs, local=stats.local, agreed=stats.agreed,
                             dummy=stats.dummy,
                             padded=[r.padded_size for r in engine.records
                                     if r.kind == "decode"])
    _write(out, rank, data)
    dist.destroy_process_group()
