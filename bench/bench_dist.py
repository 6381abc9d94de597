"""Several GPUs: decode tokens/s and per-step host time of TP=1, TP=2 and DP=2, both backends.

Run with torchrun, one process per GPU (2 for TP=2 / DP=2; with 1 only TP=1 runs):

    torchrun --nproc-per-node 2 bench/bench_dist.py --out $OUT/dist.json

Model: random bf16 weights of SmolLM2-135M's shape with 8 q / 2 KV heads (its 9 / 3 do not
split over 2 ranks; ``--shape 1.7b``: SmolLM2-1.7B's, 32 / 32 heads, hidden 2048, 24 layers).
Steady-state decode as ``bench/bench_e2e.py``: N requests admitted with ~``--context`` tokens
of KV taken as in the cache (``Engine.admit_prefilled``), one CUDA graph of N rows, ``--warmup``
then ``--steps`` timed steps; for each backend (host-built, zos) and engine (sync, overlap):

* ``tp1``: rank 0 alone, the whole model on one GPU (other ranks wait);
* ``tp2``: the model sharded over 2 ranks (``zos.serving.models.parallel``), rank 0 schedules
  and broadcasts each step (``zos.serving.distributed.TPLeader``), rank 1 replays it;
* ``dp2``: every rank a full model and its own N requests (2N rows in all), one padded-size
  agreement per step (``DPRunner``: all_reduce MAX on a gloo group);
* ``dp2_skew``: as dp2 but rank 1 has max(1, N // 8) requests: it pads up to rank 0's N.

Per rank: wall time per step (TPOT), host CPU per step (``time.process_time`` around
``Engine.step`` less the readback wait; TP rank 1: around each replayed decode), the engine's
metadata us per step, and the per-step collective's host us (TP: the step broadcast; DP: the
agreement, which includes waiting for the slower rank). ``agree_alone_us``: the same
all_reduce back to back, 200 times after a barrier (its cost without rank skew). tokens/s
counts every rank's tokens over the wall time of rank 0. JSON: ``{meta, agree_alone_us,
rows}`` to ``--out`` (rank 0). ``--device cpu --shape tiny`` is a smoke test (gloo, Triton
interpreter): the figures mean nothing there.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zos.serving.distributed import DPRunner, TPLeader, init_distributed, shutdown_distributed
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.models import LlamaConfig, random_llama, smollm2_config
from zos.serving.models.parallel import tp_llama

COMBOS = [("host", False), ("zos", False), ("host", True), ("zos", True)]
BLOCK_SIZE = 16


def shape(name: str) -> LlamaConfig:
    """The model shape of ``--shape``."""
    if name == "135m-8h":
        return dataclasses.replace(smollm2_config(), num_attention_heads=8, num_key_value_heads=2)
    if name == "1.7b":
        return dataclasses.replace(smollm2_config(), hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=24, num_attention_heads=32,
                                   num_key_value_heads=32, rope_theta=130000.0)
    return LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=2048)


def buckets(n: int) -> list[int]:
    """Powers of 2 below n, and n: the same table on every rank (a DP rank with fewer rows
    pads to its own bucket, then to the agreed one)."""
    return sorted({1 << i for i in range(n.bit_length()) if 1 << i < n} | {n})


def make_engine(model, backend, overlap, n, admit, args, device, seed) -> Engine:
    """An engine of n rows, ``admit`` of them admitted with contexts ~args.context (+- 6%)."""
    rng = random.Random(seed)
    ctx = args.context
    lens = [max(1, ctx + rng.randint(-ctx // 16, ctx // 16)) for _ in range(n)]
    total = args.warmup + args.steps + 2
    max_len = ctx + ctx // 16 + total + 1
    per_req = -(-max_len // BLOCK_SIZE)
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=n * per_req + 1, max_num_seqs=n,
                       max_model_len=max_len, backend=backend, buckets=buckets(n),
                       use_cuda_graph=device.type == "cuda")
    engine = Engine(model, cfg, device, overlap=overlap)
    for i, length in enumerate(lens[:admit]):
        engine.admit_prefilled(Request(i, [1] * length, total),
                               first_token=rng.randrange(model.config.vocab_size))
    return engine


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(engine, args, device, step=None) -> dict:
    """Warm-up, then the timed steps; ``step`` (default ``engine.step``) runs one."""
    step = step or engine.step
    for _ in range(args.warmup):
        step()
    _sync(device)
    cpu, first = [], len(engine.records)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        c0, w0 = time.process_time(), engine.readback.wait_seconds
        step()
        cpu.append((time.process_time() - c0 - (engine.readback.wait_seconds - w0)) * 1e6)
    _sync(device)
    wall = time.perf_counter() - t0
    recs = [r for r in engine.records[first:] if r.kind == "decode"]
    return dict(wall_s=wall, tpot_us=wall / args.steps * 1e6,
                host_cpu_us_median=statistics.median(cpu),
                metadata_us_median=statistics.median(r.metadata_us for r in recs) if recs
                else None, decode_steps=len(recs),
                padded_sizes=sorted({r.padded_size for r in recs}))


def run_tp(model, backend, overlap, n, args, ctx, tp) -> dict | None:
    """TP over ``tp`` ranks (tp = 1: rank 0 alone; tp = 2: the whole world of 2)."""
    if ctx.rank >= tp:
        return None
    engine = make_engine(model, backend, overlap, n, n if ctx.rank == 0 else 0, args,
                         ctx.device, args.seed)
    if tp == 1:
        return timed_steps(engine, args, ctx.device)
    if ctx.rank != 0:
        return follow(engine.runner, ctx, args.steps)
    leader = engine.runner = TPLeader(engine.runner, ctx)
    try:
        row = timed_steps(engine, args, ctx.device)
    finally:
        leader.stop()
    row["collective_us_median"] = statistics.median(leader.broadcast_us[-args.steps:])
    return row


def follow(runner, ctx, keep: int) -> dict:
    """``zos.serving.distributed.tp_follow`` with each replayed decode's host CPU timed;
    the median of the last ``keep`` (the timed steps)."""
    cpu = []
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
        op = box[0]
        if op[0] == "stop":
            return dict(host_cpu_us_median=statistics.median(cpu[-keep:]) if cpu else None)
        c0 = time.process_time()
        if op[0] == "decode":
            runner.decode(op[1], min_padded_size=op[2])
            cpu.append((time.process_time() - c0) * 1e6)
        else:
            runner.prefill(op[1])


def run_dp(model, backend, overlap, n, args, ctx, skew: bool) -> dict:
    """DP over all ranks, each its own engine; rank 1 has n // 8 rows with ``skew``."""
    mine = max(1, n // 8) if skew and ctx.rank == 1 else n
    engine = make_engine(model, backend, overlap, n, mine, args, ctx.device,
                         args.seed + 1000 * ctx.rank)
    dp = engine.runner = DPRunner(engine.runner, ctx)

    def step():
        dp.decoded = False
        engine.step()
        if not dp.decoded:
            dp.idle_step(True)

    row = timed_steps(engine, args, ctx.device, step)
    row["collective_us_median"] = statistics.median(dp.stats.agree_us[-args.steps:])
    row["rows"] = mine
    return row


def agree_alone(ctx, reps=200) -> float:
    """Median host us of the DP agreement's all_reduce back to back (no rank skew)."""
    t = torch.zeros(3, dtype=torch.int64)  # as DPRunner.agree: size, active, failed rank
    dist.barrier(group=ctx.cpu_group)
    us = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
        us.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(us)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,64,256", help="N request rows per engine")
    ap.add_argument("--context", type=int, default=1024, help="tokens of KV per row")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    ap.add_argument("--shape", choices=("135m-8h", "1.7b", "tiny"), default="135m-8h")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--modes", default="tp1,tp2,dp2,dp2_skew", help="comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON file written by rank 0")
    args = ap.parse_args()
    ctx = init_distributed(device=args.device)
    world = ctx.world_size
    modes = [m for m in args.modes.split(",") if m == "tp1" or world == 2]
    cfg = shape(args.shape)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    full = random_llama(cfg, seed=args.seed, dtype=dtype, device=ctx.device)
    shard = (tp_llama(full.state_dict(), cfg, ctx.rank, 2, dtype=dtype, device=ctx.device)
             if "tp2" in modes else None)
    alone = agree_alone(ctx) if world > 1 else None
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for mode in modes:
            for backend, overlap in COMBOS:
                if mode == "tp1":
                    r = run_tp(full, backend, overlap, n, args, ctx, 1)
                elif mode == "tp2":
                    r = run_tp(shard, backend, overlap, n, args, ctx, 2)
                else:
                    r = run_dp(full, backend, overlap, n, args, ctx, mode == "dp2_skew")
                got = [None] * world
                dist.all_gather_object(got, r, group=ctx.cpu_group)
                gc.collect()
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                if ctx.rank:
                    continue
                lead = got[0]
                tokens = n * args.steps if mode.startswith("tp") else sum(
                    g["rows"] * args.steps for g in got)
                row = dict(mode=mode, backend=backend, overlap=overlap, n=n,
                           tokens_per_s=tokens / lead["wall_s"], per_rank=got)
                rows.append(row)
                print(f"N {n:>4} {mode:>8} {backend:>4} {'overlap' if overlap else 'sync':>7}"
                      f"  TPOT {lead['tpot_us']:8.1f} us  tok/s {row['tokens_per_s']:9.0f}"
                      "  host CPU us/rank " + "/".join(
                          f"{g['host_cpu_us_median']:.0f}" for g in got if g) +
                      "  collective us/rank " + "/".join(
                          f"{g.get('collective_us_median', 0):.0f}" for g in got if g),
                      flush=True)
    if ctx.rank == 0:
        meta = dict(device=torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu",
                    world_size=world, backend=ctx.backend, date=dt.date.today().isoformat(),
                    torch=torch.__version__, shape=args.shape, config=dataclasses.asdict(cfg),
                    dtype=str(dtype), context=args.context, steps=args.steps,
                    warmup=args.warmup, block_size=BLOCK_SIZE)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, agree_alone_us=alone, rows=rows), indent=1)
                       + "\n")
        print(f"wrote {out}")
    shutdown_distributed(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
