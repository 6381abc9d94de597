"""Worker processes of tests/test_distributed.py (spawned: they must be importable top-level
functions). Each rank writes what it saw to ``<out>/rank<r>.json``; the test compares. Not a
test file and no fixtures: the spawned children import it by name from the tests directory."""
from __future__ import annotations

import json
import os
import random

import torch

from zos.serving.distributed import (
    DPRunner,
    dp_generate,
    init_distributed,
    shutdown_distributed,
    tp_generate,
)
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.models import random_llama
from zos.serving.models.parallel import tp_llama

from helpers import LLAMA_BLOCK_SIZE, LLAMA_CFG

BACKENDS = ("host", "zos")


def engine_config(backend: str, num_draft_tokens: int = 0) -> EngineConfig:
    """Small and tight: 6 rows, buckets 1, 2, 4 (5 and 6 run eagerly; with k draft tokens,
    token rows: q = 1 + k times those), 15 usable blocks of 4 tokens (preemption happens),
    eos 7."""
    q = 1 + num_draft_tokens
    return EngineConfig(block_size=LLAMA_BLOCK_SIZE, num_kv_blocks=16, max_num_seqs=6,
                        max_model_len=32, max_prefill_tokens=24, eos_token_id=7,
                        backend=backend, use_cuda_graph=True, buckets=[q, 2 * q, 4 * q],
                        num_draft_tokens=num_draft_tokens)


def make_requests(seed: int, n: int, max_new: int) -> list[Request]:
    """``n`` seeded requests: prompts of 1..11 ids, 1..max_new new tokens, arrivals spread."""
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(LLAMA_CFG.vocab_size) for _ in range(rng.randint(1, 11))],
                    rng.randint(1, max_new), arrival=float(i)) for i in range(n)]


def dp_requests(rank: int) -> list[Request]:
    """Rank 0: 7 requests up to 12 tokens; rank 1: 2 short ones (it goes idle early)."""
    return make_requests(100 + rank, 7, 12) if rank == 0 else make_requests(200, 2, 3)


def _start(rank: int, world: int, init: str, timeout_s: float = 600):
    """gloo on a CPU; NCCL with one GPU per rank where CUDA is (the test needs 2 GPUs then)."""
    torch.set_num_threads(1)  # two ranks share the CPU cores
    return init_distributed(rank=rank, world_size=world, init_method=init, timeout_s=timeout_s)


def _write(out: str, rank: int, data: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)


def _tp_run(model, backend: str, overlap: bool, seed: int, ctx, transport: str,
            k: int) -> dict:
    """One TP run of ``backend`` (the engine and its graphs die with this frame)."""
    engine = Engine(model, engine_config(backend, k), ctx.device, overlap=overlap)
    result, extra = tp_generate(engine, make_requests(seed, 6, 12), ctx, check_metadata=True,
                                transport=transport)
    if ctx.rank:
        return dict(checksums=extra)
    return dict(outputs=result.outputs, checksums=extra.checksums,
                decode_steps=result.totals["decode_steps"],
                preemptions=result.totals["preemptions"], transport=extra.channel.kind,
                spec_tokens=result.totals.get("spec_tokens"),
                spec_rows=result.totals.get("spec_rows"))


def tp_worker(rank: int, world: int, init: str, out: str, seed: int, overlap: bool,
              transport: str = "auto", k: int = 0, backends=BACKENDS) -> None:
    """TP over ``world`` ranks, ``backends`` in turn, metadata checked every decode step;
    ``k`` draft tokens per request and step."""
    ctx = _start(rank, world, init)
    full = random_llama(LLAMA_CFG, seed=0, device=ctx.device)
    model = tp_llama(full.state_dict(), LLAMA_CFG, rank, world, device=ctx.device)
    data = {b: _tp_run(model, b, overlap, seed, ctx, transport, k) for b in backends}
    _write(out, rank, data)
    shutdown_distributed(ctx)


class ExitingRunner:
    """A follower's GraphRunner whose ``exit_at``-th decode call ends the process at once
    (``os._exit(0)``: no exception, no clean-up, as a killed rank; exit status 0 so that the
    spawner does not kill rank 0 first)."""

    def __init__(self, runner, exit_at: int) -> None:
        self.runner, self.exit_at, self.calls = runner, exit_at, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, step, *, min_padded_size=0):
        self.calls += 1
        if self.calls == self.exit_at:
            os._exit(0)
        return self.runner.decode(step, min_padded_size=min_padded_size)


def tp_exit_worker(rank: int, world: int, init: str, out: str, transport: str,
                   exit_at: int) -> None:
    """TP where rank 1 exits in its ``exit_at``-th decode: rank 0 records the error it stopped
    with and the decode steps it ran (ring timeout 60 s, collectives 120 s)."""
    ctx = _start(rank, world, init, 120.0)
    full = random_llama(LLAMA_CFG, seed=0, device=ctx.device)
    model = tp_llama(full.state_dict(), LLAMA_CFG, rank, world, device=ctx.device)
    engine = Engine(model, engine_config("host"), ctx.device)
    if rank:
        engine.runner = ExitingRunner(engine.runner, exit_at)
    try:
        tp_generate(engine, make_requests(11, 6, 12), ctx, transport=transport, timeout_s=60.0)
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads which error rank 0 saw
        error = f"{type(e).__name__}: {e}"
    _write(out, rank, dict(error=error, decode_steps=sum(
        r.kind == "decode" for r in engine.records)))
    os._exit(0)  # no shutdown: the peer is gone


def ring_exit_worker(rank: int, world: int, init: str, out: str, exit_at: int) -> None:
    """The step ring alone: rank 0 publishes decode steps until an error; rank 1 reads
    ``exit_at`` of them and exits. Rank 0 records the error and the messages it published."""
    from zos.buffers import DecodeBuffers
    from zos.serving.distributed import StepChannel
    from zos.step import DecodeStep

    ctx = _start(rank, world, init, 120.0)
    ch = StepChannel(ctx, DecodeBuffers(8, 4, 4), transport="shm", timeout_s=60.0)
    if rank:
        for _ in range(exit_at):
            ch.receive()
        os._exit(0)
    sent, error = 0, None
    try:
        while sent < 10_000:
            ch.publish(("decode", DecodeStep.build([sent, sent + 1]), 0))
            sent += 1
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    _write(out, rank, dict(error=error, sent=sent, num_slots=ch.ring.num_slots))
    os._exit(0)


def _dp_run(model, backend: str, overlap: bool, ctx, transport: str) -> dict:
    """One DP run of ``backend`` (the engine and its graphs die with this frame)."""
    engine = Engine(model, engine_config(backend), ctx.device, overlap=overlap)
    outputs, stats = dp_generate(engine, dp_requests(ctx.rank), ctx, transport=transport)
    return dict(outputs=outputs, local=stats.local, agreed=stats.agreed, dummy=stats.dummy,
                padded=[r.padded_size for r in engine.records if r.kind == "decode"],
                transport=engine.runner.agreement.kind)


def dp_worker(rank: int, world: int, init: str, out: str, overlap: bool,
              transport: str = "auto") -> None:
    """DP over ``world`` ranks (each its own requests), both backends in turn."""
    ctx = _start(rank, world, init)
    model = random_llama(LLAMA_CFG, seed=0, device=ctx.device)
    _write(out, rank, {b: _dp_run(model, b, overlap, ctx, transport) for b in BACKENDS})
    shutdown_distributed(ctx)


class FailingRunner:
    """A GraphRunner whose ``fail_at``-th call of ``method`` ("decode" or "prefill") raises
    ValueError (as a step its backend refuses does, before anything is written); other
    attributes are the runner's."""

    def __init__(self, runner, method: str, fail_at: int) -> None:
        self.runner, self.method, self.fail_at, self.calls = runner, method, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _count(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls == self.fail_at:
                raise ValueError(f"injected: {method} call {self.calls} refused")

    def decode(self, step, *, min_padded_size=0):
        self._count("decode")
        return self.runner.decode(step, min_padded_size=min_padded_size)

    def prefill(self, seqs):
        self._count("prefill")
        return self.runner.prefill(seqs)


def _dp_fail_run(ctx, method: str, fail_at: int, transport: str) -> dict:
    engine = Engine(random_llama(LLAMA_CFG, seed=0, device=ctx.device), engine_config("host"),
                    ctx.device)
    if ctx.rank == 1:
        engine.runner = FailingRunner(engine.runner, method, fail_at)
    engine.runner = DPRunner(engine.runner, ctx, transport=transport)
    try:
        dp_generate(engine, make_requests(300 + ctx.rank, 5, 12), ctx)
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads which error each rank saw
        error = f"{type(e).__name__}: {e}"
    stats = engine.runner.stats
    return dict(error=error, agreements=len(stats.agreed), dummy=len(stats.dummy))


def dp_fail_worker(rank: int, world: int, init: str, out: str, method: str, fail_at: int,
                   timeout_s: float, transport: str = "auto") -> None:
    """DP where rank 1's ``fail_at``-th ``method`` call raises: each rank records the error it
    stopped with and its agreements (host backend; collectives time out after ``timeout_s``)."""
    ctx = _start(rank, world, init, timeout_s)
    _write(out, rank, _dp_fail_run(ctx, method, fail_at, transport))
    shutdown_distributed(ctx)
