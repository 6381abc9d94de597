"""Graph capture benchmark: capture time and graph memory per bucket, eager vs lazy capture.

SmolLM2-135M's shape with random weights (bf16), the decode body ``GraphRunner`` captures (zos prep
kernels, forward, logits, greedy sampling), and DeepInfer's ``nextn`` table
(``zos.buckets.deepinfer_policy``; default 256 requests, nextn 5, interval 8: sizes up to 1536
token rows). Three passes, each on a fresh runner over the same model and KV cache:

* ``eager``: ``GraphRunner.capture()`` with ``graph_capture="eager"``: warm-up of every size on
  a side stream, then one capture per size, largest first, in one shared pool. Per bucket:
  capture seconds, pool growth (``torch.cuda.memory_reserved`` delta) and the instantiated
  graph's own bytes (drop of ``torch.cuda.mem_get_info`` free memory beyond the pool growth;
  0 below the driver's granularity); totals: wall seconds (warm-up included), reserved and
  device bytes added.
* ``isolated``: each size captured alone in a fresh pool (after the eager pass's warm-up), then
  dropped: what one bucket costs by itself (the shared pool makes later captures nearly free).
* ``lazy``: ``graph_capture="lazy"`` under each budget of ``--budgets-mb`` ("none" = unbounded;
  default: none and 50% / 25% of the eager pass's cache bytes), over ``--lazy-steps`` decode
  steps whose request counts follow a seeded random walk over 1..max_num_seqs (all rows new
  each step, one block each): captures, evictions, eager steps by reason, capture seconds,
  cache bytes at the end, and the synchronized wall time per step by path (graph replay, eager,
  eager + capture).

``--q-mode rows`` (default) runs q = 1 over the table's token-row sizes: DeepInfer's raw table
at 256/nextn 5 *is* ``deepinfer_policy(1536)`` (the 195 sizes, 1 row per request), so this
runs on a runner without speculative decoding; attention sees 1536 one-row requests instead of
256 six-row ones (the dense part, which dominates the kernels and the pool, is the same).
``--q-mode spec`` runs q = 1 + nextn over the q-uniform table (193 sizes: DeepInfer's rounded
up to multiples of q); it needs a runner and backend that accept q > 1.

Usage: python bench/bench_graphs.py [--max-num-seqs 256] [--nextn 5] [--q-mode rows|spec]
       [--lazy-steps 400] [--budgets-mb none,512,128] [--no-isolated] --out results.json
       (--out: a .json path, or a directory for graphs_<gpu>_<date>.json). CUDA required.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from zos import DecodeBuffers, DecodeStep, DeviceMetadataBackend
from zos.buckets import BucketTable, deepinfer_policy
from zos.graphs import CudaGraphCapturer
from zos.serving.models import allocate_kv_cache, random_llama, smollm2_config
from zos.serving.runner import GraphRunner

BLOCK_SIZE = 16


def table_for(args) -> BucketTable:
    """The bucket table the runner captures (see the module doc, --q-mode)."""
    if args.q_mode == "rows":
        return deepinfer_policy(args.max_num_seqs * (1 + args.nextn), interval=args.interval)
    return deepinfer_policy(args.max_num_seqs, nextn=args.nextn, interval=args.interval)


def make_runner(model, caches, table: BucketTable, **graph_kw) -> GraphRunner:
    q = table.uniform_decode_query_len
    bufs = DecodeBuffers(table.max_size // q, 2, BLOCK_SIZE, uniform_decode_query_len=q,
                         device="cuda")
    backend = DeviceMetadataBackend(bufs, num_kv_blocks=caches[0].shape[1],
                                    vocab_size=model.config.vocab_size, buckets=table,
                                    capture_prep=False)
    return GraphRunner(model, caches, backend, use_cuda_graph=True, **graph_kw)


def release() -> None:
    """Free what dropped graphs and pools held (call after the last reference is gone)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def eager_pass(model, caches, table) -> tuple[dict, GraphRunner]:
    runner = make_runner(model, caches, table)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    n = runner.capture()
    wall = time.perf_counter() - t0
    log = [e for e in runner.cache.log if e["event"] == "capture"]
    per = sorted(({"size": e["size"], "capture_s": e["seconds"], "pool_bytes": e["pool_bytes"],
                   "graph_bytes": e["nbytes"]} for e in log), key=lambda r: r["size"])
    cap = sum(r["capture_s"] for r in per)
    out = dict(graphs=n, wall_s=wall, capture_s=cap, warmup_s=wall - cap,
               mean_capture_s=cap / n, cache_bytes=runner.cache.used_bytes,
               reserved_bytes=runner.graph_memory["reserved_bytes"],
               allocated_bytes=runner.graph_memory["allocated_bytes"],
               device_bytes=free0 - torch.cuda.mem_get_info()[0], per_bucket=per)
    return out, runner


def isolated_pass(runner: GraphRunner, sizes) -> list[dict]:
    """Each size alone in a fresh pool (the runner's body is warm from the eager pass)."""
    rows = []
    for s in sizes:
        cap = CudaGraphCapturer(runner._body)
        g = cap(s)
        rows.append({"size": s, "capture_s": g.seconds, "pool_bytes": g.pool_bytes,
                     "graph_bytes": g.nbytes})
        del g, cap  # the pool goes with its only graph, before the next capture measures
        release()
    return rows


def lazy_pass(model, caches, table, budget_bytes, args) -> dict:
    runner = make_runner(model, caches, table, graph_capture="lazy",
                         graph_memory_budget=budget_bytes)
    runner.capture()
    q, max_reqs = table.uniform_decode_query_len, table.max_size // table.uniform_decode_query_len
    rng, n, base = random.Random(args.seed), max(1, max_reqs // 2), 0
    times = {"graph": [], "eager": [], "eager+capture": []}
    reasons: dict[str, int] = {}
    for _ in range(args.lazy_steps):
        n = min(max_reqs, max(1, n + rng.randint(-max_reqs // 8, max_reqs // 8)))
        step = DecodeStep.build(list(range(base, base + n)),
                                {r: (1 + r % 1000, 0, [1 + r]) for r in range(n)})
        base += n
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = runner.decode(step)
        torch.cuda.synchronize()
        dt_us = (time.perf_counter() - t0) * 1e6
        kind = res.path if not res.capture_s else "eager+capture"
        times[kind].append(dt_us)
        if res.eager_reason:
            reasons[res.eager_reason] = reasons.get(res.eager_reason, 0) + 1
    c = runner.cache
    out = dict(budget_bytes=budget_bytes, steps=args.lazy_steps, q=q,
               distinct_buckets=len({e["size"] for e in c.log if e["event"] == "capture"}),
               captures=c.captures, evictions=c.evictions, over_budget=sum(
                   e["event"] == "over budget" for e in c.log),
               eager_steps_by_reason=reasons, capture_s=c.capture_seconds,
               cache_bytes_end=c.used_bytes, graphs_end=len(c),
               step_us_median={k: statistics.median(v) if v else None for k, v in times.items()},
               step_count={k: len(v) for k, v in times.items()})
    c.clear()
    del runner, c
    release()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--nextn", type=int, default=5)
    p.add_argument("--interval", type=int, default=8)
    p.add_argument("--q-mode", choices=("rows", "spec"), default="rows")
    p.add_argument("--lazy-steps", type=int, default=400)
    p.add_argument("--budgets-mb", default=None,
                   help="comma-separated MiB or 'none' (default: none and 50%%, 25%% of eager)")
    p.add_argument("--no-isolated", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_graphs.py: CUDA required", file=sys.stderr)
        return 2
    table = table_for(args)
    cfg = smollm2_config()
    model = random_llama(cfg, seed=args.seed, dtype=torch.bfloat16, device="cuda")
    max_reqs = table.max_size // table.uniform_decode_query_len
    caches = allocate_kv_cache(cfg.num_hidden_layers, max_reqs + 1, BLOCK_SIZE,
                               cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cuda")
    print(f"table: {table!r}", flush=True)
    eager, runner = eager_pass(model, caches, table)
    print(f"eager: {eager['graphs']} graphs in {eager['wall_s']:.2f} s "
          f"(capture {eager['capture_s']:.2f} s), cache {eager['cache_bytes'] / 2**20:.1f} MiB, "
          f"reserved +{eager['reserved_bytes'] / 2**20:.1f} MiB", flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=dt.date.today().isoformat(), q_mode=args.q_mode,
                  table=dict(policy="deepinfer", max_num_seqs=args.max_num_seqs,
                             nextn=args.nextn, interval=args.interval, count=len(table),
                             q=table.uniform_decode_query_len, sizes=list(table.sizes)),
                  eager=eager)
    if not args.no_isolated:
        result["isolated"] = isolated_pass(runner, table.sizes)
        print(f"isolated: max pool {max(r['pool_bytes'] for r in result['isolated']) / 2**20:.1f}"
              f" MiB", flush=True)
    runner.cache.clear()
    del runner
    release()
    if args.budgets_mb is None:
        budgets = [None, eager["cache_bytes"] // 2, eager["cache_bytes"] // 4]
    else:
        budgets = [None if b.strip() == "none" else int(float(b) * 2**20)
                   for b in args.budgets_mb.split(",")]
    result["lazy"] = []
    for b in budgets:
        r = lazy_pass(model, caches, table, b, args)
        result["lazy"].append(r)
        print(f"lazy budget {b}: {r['captures']} captures, {r['evictions']} evictions, "
              f"eager {r['eager_steps_by_reason']}, median us {r['step_us_median']}", flush=True)
    out = Path(args.out)
    if out.suffix != ".json":
        gpu = torch.cuda.get_device_name().replace(" ", "_")
        out = out / f"graphs_{gpu}_{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
