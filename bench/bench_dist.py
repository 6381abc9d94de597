"""Several GPUs: decode tokens/s and per-step host time of TP=1, TP=2 and DP=2, both backends.

Run with torchrun, one process per GPU (2 for TP=2 / DP=2; with 1 only TP=1 runs):

    torchrun --nproc-per-node 2 bench/bench_dist.py --out $OUT/dist.json

Coordination alone, no model (``--modes coord``; on a CPU too: ``--device cpu``):

    torchrun --nproc-per-node 2 bench/bench_dist.py --modes coord --out $OUT/coord.json

Model: random bf16 weights of SmolLM2-135M's shape with 8 q / 2 KV heads (its 9 / 3 do not
split over 2 ranks; ``--shape 1.7b``: SmolLM2-1.7B's, 32 / 32 heads, hidden 2048, 24 layers).
Steady-state decode as ``bench/bench_e2e.py``: N requests admitted with ~``--context`` tokens
of KV taken as in the cache (``Engine.admit_prefilled``), one CUDA graph of N rows, ``--warmup``
then ``--steps`` timed steps; for each backend (host-built, zos) and engine (sync, overlap):

* ``tp1``: rank 0 alone, the whole model on one GPU (other ranks wait);
* ``tp2``: the model sharded over 2 ranks (``zos.serving.models.parallel``), rank 0 schedules
  and publishes each step (``zos.serving.distributed.TPLeader``), rank 1 replays it;
* ``dp2``: every rank a full model and its own N requests (2N rows in all), one padded-size
  agreement per step (``DPRunner``);
* ``dp2_skew``: as dp2 but rank 1 has max(1, N // 8) requests: it pads up to rank 0's N;
* ``coord``: the coordination alone, for each transport: ``tp_publish`` (per step, in
  lockstep, rank 0 works ``--coord-gap-us`` then publishes a steady N-row DecodeStep that rank
  1 waits for; the latency from the start of the publish to the end of the receive, on the
  host's monotonic clock, and the publish call alone) and ``dp_agree`` (the DP agreement back
  to back after a barrier, ``--coord-reps`` times: its cost without rank skew).

tp2, dp2 and dp2_skew run once per ``--transports`` entry ("shm": the shared-memory ring / slots
of one host, "collective": the gloo group, as across hosts; ``zos.serving.dist_transport``).

Per rank: wall time per step (TPOT), host CPU per step (``time.process_time`` around
``Engine.step`` less the readback wait; TP rank 1: around each replayed decode), the engine's
metadata us per step, and the per-step collective's host us (TP: the step broadcast; DP: the
agreement, which includes waiting for the slower rank). tokens/s counts every rank's tokens
over the wall time of rank 0. JSON: ``{meta, rows}`` to ``--out`` (rank 0; coord rows have
``mode`` "coord"). ``--device cpu --shape tiny`` is a smoke test (gloo, Triton
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

import numpy as np
import torch
import torch.distributed as dist

from zos.serving.distributed import (
    Agreement,
    DPRunner,
    StepChannel,
    TPLeader,
    init_distributed,
    shutdown_distributed,
)
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.models import LlamaConfig, random_llama, smollm2_config
from zos.serving.models.parallel import tp_llama
from zos.step import DecodeStep

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


def run_tp(model, backend, overlap, n, args, ctx, tp, transport="auto") -> dict | None:
    """TP over ``tp`` ranks (tp = 1: rank 0 alone; tp = 2: the whole world of 2)."""
    if ctx.rank >= tp:
        return None
    engine = make_engine(model, backend, overlap, n, n if ctx.rank == 0 else 0, args,
                         ctx.device, args.seed)
    if tp == 1:
        return timed_steps(engine, args, ctx.device)
    if ctx.rank != 0:
        return follow(engine.runner, ctx, args.steps, transport)
    leader = engine.runner = TPLeader(engine.runner, ctx, transport=transport)
    try:
        row = timed_steps(engine, args, ctx.device)
    finally:
        leader.stop()
    row["collective_us_median"] = statistics.median(leader.broadcast_us[-args.steps:])
    row["transport"] = leader.channel.kind
    return row


def follow(runner, ctx, keep: int, transport: str) -> dict:
    """``zos.serving.distributed.tp_follow`` with each replayed decode's host CPU timed;
    the median of the last ``keep`` (the timed steps)."""
    channel = StepChannel(ctx, runner.buffers, transport=transport)
    cpu = []
    while True:
        op = channel.receive()
        if op[0] == "stop":
            channel.close()
            return dict(host_cpu_us_median=statistics.median(cpu[-keep:]) if cpu else None)
        c0 = time.process_time()
        if op[0] == "decode":
            runner.decode(op[1], min_padded_size=op[2])
            cpu.append((time.process_time() - c0) * 1e6)
        elif op[0] == "accepted":
            runner.backend.observe_accepted(op[1], op[2])
        else:
            runner.prefill(op[1])


def run_dp(model, backend, overlap, n, args, ctx, skew: bool, transport="auto") -> dict:
    """DP over all ranks, each its own engine; rank 1 has n // 8 rows with ``skew``."""
    mine = max(1, n // 8) if skew and ctx.rank == 1 else n
    engine = make_engine(model, backend, overlap, n, mine, args, ctx.device,
                         args.seed + 1000 * ctx.rank)
    dp = engine.runner = DPRunner(engine.runner, ctx, transport=transport)

    def step():
        dp.decoded = False
        engine.step()
        if not dp.decoded:
            dp.idle_step(True)

    row = timed_steps(engine, args, ctx.device, step)
    row["collective_us_median"] = statistics.median(dp.stats.agree_us[-args.steps:])
    row["rows"], row["transport"] = mine, dp.agreement.kind
    return row


def _pct(xs, q) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))])


def coord_dp(ctx, transport: str, reps: int) -> dict:
    """The DP agreement back to back, ``reps`` times after a barrier (no rank skew): this
    rank's median and p90 host us."""
    agreement = Agreement(ctx, transport=transport, spin_s=0.05)
    dist.barrier(group=ctx.cpu_group)
    us = []
    for i in range(reps):
        t0 = time.perf_counter()
        agreement.all_max((i % 7, 1, 0))
        us.append((time.perf_counter() - t0) * 1e6)
    agreement.close()
    return dict(transport=agreement.kind, median_us=statistics.median(us),
                p90_us=_pct(us, 0.9))


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def coord_tp(ctx, transport: str, n: int, reps: int, gap_us: float) -> dict:
    """Per step, after a barrier (outside the timed window: the ranks are in lockstep, as the
    model's all-reduce keeps them), rank 0 is busy for ``gap_us`` (a scheduler's work; rank 1
    is waiting by then) and publishes a steady n-row DecodeStep (carried rows, one appended
    block); rank 1 receives it. Rank 0: publish-call us; rank 1: receive-end times. Latency =
    receive end - publish start (``time.perf_counter`` is CLOCK_MONOTONIC, one clock for the
    host's processes)."""
    from zos.buffers import DecodeBuffers

    channel = StepChannel(ctx, DecodeBuffers(n, 4, BLOCK_SIZE, device="cpu"),
                          transport=transport, spin_s=0.05)
    step = DecodeStep(np.arange(n, dtype=np.int64), append_rows=np.array([0], np.int32),
                      append_block_ids=np.array([7], np.int32))
    marks, calls = [], []
    for _ in range(reps):
        dist.barrier(group=ctx.cpu_group)  # lockstep, as the model's all-reduce makes it
        if ctx.rank == 0:
            _spin(gap_us)
            t0 = time.perf_counter()
            channel.publish(("decode", step, 0))
            t1 = time.perf_counter()
            marks.append(t0)
            calls.append((t1 - t0) * 1e6)
        else:
            op = channel.receive()
            marks.append(time.perf_counter())
            assert op[1].num_reqs == n
    if ctx.rank == 0:
        channel.publish(("stop",))
    else:
        channel.receive()
    kind = channel.kind
    channel.close()
    got = [None] * ctx.world_size
    dist.all_gather_object(got, marks, group=ctx.cpu_group)
    lat = [(b - a) * 1e6 for a, b in zip(got[0], got[1])]
    return dict(transport=kind, n=n, latency_median_us=statistics.median(lat),
                latency_p90_us=_pct(lat, 0.9),
                publish_median_us=statistics.median(calls) if calls else None)


def run_coord(args, ctx) -> list[dict]:
    """The ``coord`` mode's rows (rank 0 prints them)."""
    rows = []
    for transport in args.transports.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            r = coord_tp(ctx, transport, n, args.coord_reps, args.coord_gap_us)
            rows.append(dict(mode="coord", kind="tp_publish", **r))
        got = [None] * ctx.world_size
        dist.all_gather_object(got, coord_dp(ctx, transport, args.coord_reps),
                               group=ctx.cpu_group)
        rows.append(dict(mode="coord", kind="dp_agree", transport=got[0]["transport"],
                         per_rank=got))
    if ctx.rank == 0:
        for r in rows:
            if r["kind"] == "tp_publish":
                print(f"coord tp_publish {r['transport']:>10} N {r['n']:>4}: latency median "
                      f"{r['latency_median_us']:8.1f} us, p90 {r['latency_p90_us']:8.1f}; "
                      f"publish call {r['publish_median_us']:7.1f} us", flush=True)
            else:
                print(f"coord dp_agree   {r['transport']:>10}: median us/rank " + "/".join(
                    f"{g['median_us']:.1f}" for g in r["per_rank"]) + ", p90 " + "/".join(
                    f"{g['p90_us']:.1f}" for g in r["per_rank"]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,64,256", help="N request rows per engine")
    ap.add_argument("--context", type=int, default=1024, help="tokens of KV per row")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    ap.add_argument("--shape", choices=("135m-8h", "1.7b", "tiny"), default="135m-8h")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--modes", default="coord,tp1,tp2,dp2,dp2_skew", help="comma-separated")
    ap.add_argument("--transports", default="shm,collective",
                    help="comma-separated: shm, collective (and auto)")
    ap.add_argument("--coord-reps", type=int, default=2000, help="coord: steps / agreements")
    ap.add_argument("--coord-gap-us", type=float, default=1000.0,
                    help="coord: rank 0's busy time between two published steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON file written by rank 0")
    args = ap.parse_args()
    ctx = init_distributed(device=args.device)
    world = ctx.world_size
    modes = [m for m in args.modes.split(",") if m == "tp1" or world == 2]
    transports = args.transports.split(",")
    rows = run_coord(args, ctx) if "coord" in modes else []
    modes = [m for m in modes if m != "coord"]
    cfg = shape(args.shape)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    full = random_llama(cfg, seed=args.seed, dtype=dtype, device=ctx.device) if modes else None
    shard = (tp_llama(full.state_dict(), cfg, ctx.rank, 2, dtype=dtype, device=ctx.device)
             if "tp2" in modes else None)
    for n in (int(x) for x in args.sizes.split(",")):
        for mode in modes:
            for transport in transports if mode != "tp1" else ["-"]:
                for backend, overlap in COMBOS:
                    if mode == "tp1":
                        r = run_tp(full, backend, overlap, n, args, ctx, 1)
                    elif mode == "tp2":
                        r = run_tp(shard, backend, overlap, n, args, ctx, 2, transport)
                    else:
                        r = run_dp(full, backend, overlap, n, args, ctx, mode == "dp2_skew",
                                   transport)
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
                    row = dict(mode=mode, transport=lead.get("transport"), backend=backend,
                               overlap=overlap, n=n, tokens_per_s=tokens / lead["wall_s"],
                               per_rank=got)
                    rows.append(row)
                    print(f"N {n:>4} {mode:>8} {transport:>10} {backend:>4} "
                          f"{'overlap' if overlap else 'sync':>7}"
                          f"  TPOT {lead['tpot_us']:8.1f} us  tok/s {row['tokens_per_s']:9.0f}"
                          "  host CPU us/rank " + "/".join(
                              f"{g['host_cpu_us_median']:.0f}" for g in got if g) +
                          "  coordination us/rank " + "/".join(
                              f"{g.get('collective_us_median', 0):.0f}" for g in got if g),
                          flush=True)
    if ctx.rank == 0:
        meta = dict(device=torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu",
                    world_size=world, backend=ctx.backend, date=dt.date.today().isoformat(),
                    torch=torch.__version__, shape=args.shape, config=dataclasses.asdict(cfg),
                    dtype=str(dtype), context=args.context, steps=args.steps,
                    warmup=args.warmup, block_size=BLOCK_SIZE, transports=transports,
                    coord_reps=args.coord_reps, coord_gap_us=args.coord_gap_us)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
        print(f"wrote {out}")
    shutdown_distributed(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
