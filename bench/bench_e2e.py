"""End-to-end decode benchmark: what each metadata backend costs in a whole decode step.

SmolLM2-135M's shape with random weights, bf16, on one GPU. For each context (default ~1k and
~7k tokens per row, spread +-6% so rows cross block boundaries on different steps) and each
N (request rows, default 1, 8, 64, 256, 512), every combination of backend (host-built, zos)
and engine (sync, overlap) runs a decode-only steady state: N requests admitted with their
prompt's KV taken as already in the cache (``Engine.admit_prefilled``), one CUDA graph of
exactly N rows, no arrivals, no finishes. Per combination, in one process on one GPU:

* timed pass (``--steps`` decode steps after ``--warmup``): wall time per step (TPOT: the
  whole run's wall time after a final sync, over the steps), tokens/s = N * steps / wall,
  host CPU time per step (``time.process_time`` around ``Engine.step`` less the time spent
  waiting for sampled tokens, which spins: scheduler + metadata + launch + reading tokens
  back), and within it the metadata (``stage``) time the engine records;
* profiled pass (``--profile-steps`` more steps under ``torch.profiler``): GPU busy time (the
  union of kernel, memcpy and memset intervals) over the span from the first to the last of
  them; idle fraction = 1 - busy / span, and the part of it in gaps longer than 20 us (the
  GPU waiting for the host, as opposed to the ~1 us gaps between the kernels of one graph
  replay). The profiler adds host overhead, so idle is an upper bound for both backends alike;
* phase pass (``--steps`` more steps with timers around the engine's phases, from
  bench_engine_host.py: retire, admit, decode and within it DecodeStep, stage, graph launch,
  readback push; drain and within it the wait for sampled tokens): median us per phase, the
  breakdown of the host's step.

Not measured: prefill, arrivals and finishes (decode-only steady state), token correctness
(tests/test_overlap.py and tests/test_engine.py check that), sampling beyond greedy argmax.

Usage: python bench/bench_e2e.py [--sizes 1,8,64,256,512] [--contexts 1024,7168]
       [--out bench/results]   (writes e2e_<gpu>_<date>.json and .png)
CUDA required.
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

from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.models import random_llama, smollm2_config
from zos.serving.profiling import profile_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_host import breakdown  # noqa: E402

COMBOS = [("host", False), ("zos", False), ("host", True), ("zos", True)]
BLOCK_SIZE = 16


def make_engine(model, backend: str, overlap: bool, n: int, ctx: int, steps: int,
                seed: int) -> Engine:
    """An engine of N rows whose requests are admitted with contexts ctx +- 6%."""
    rng = random.Random(seed)
    lens = [max(1, ctx + rng.randint(-ctx // 16, ctx // 16)) for _ in range(n)]
    max_len = max(lens) + steps + 1
    per_req = -(-max_len // BLOCK_SIZE)
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=n * per_req + 1, max_num_seqs=n,
                       max_model_len=max_len, backend=backend, buckets=[n])
    engine = Engine(model, cfg, "cuda", overlap=overlap)
    for i, length in enumerate(lens):
        engine.admit_prefilled(Request(i, [1] * length, steps), first_token=rng.randrange(1000))
    return engine


def run_combo(model, backend, overlap, n, ctx, args) -> dict:
    """Warm-up, timed pass and profiled pass of one combination (see the module doc)."""
    total = args.warmup + args.steps + args.profile_steps + args.steps
    engine = make_engine(model, backend, overlap, n, ctx, total + 2, args.seed)
    for _ in range(args.warmup):
        engine.step()
    torch.cuda.synchronize()
    cpu, thread_cpu, first = [], [], len(engine.records)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        c0, th0, w0 = time.process_time(), time.thread_time(), engine.readback.wait_seconds
        engine.step()
        # CPU time of the step's own work: waiting for the GPU (a spinning event wait counts
        # as CPU time) is taken out. process_time counts every thread of the process (torch's
        # and the driver's too); thread_time only the thread that runs the engine.
        wait = engine.readback.wait_seconds - w0
        cpu.append((time.process_time() - c0 - wait) * 1e6)
        thread_cpu.append((time.thread_time() - th0 - wait) * 1e6)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    recs = [r for r in engine.records[first:] if r.kind == "decode"]
    assert len(recs) == args.steps and all(r.num_reqs == n for r in recs), "not steady state"

    def profiled():
        for _ in range(args.profile_steps):
            engine.step()

    act = profile_device(profiled)
    out = dict(backend=backend, overlap=overlap, n=n, context=ctx, steps=args.steps,
               graph_steps=sum(r.path == "graph" for r in recs),
               tpot_us=wall / args.steps * 1e6, tokens_per_s=n * args.steps / wall,
               host_cpu_us_median=statistics.median(cpu),
               host_thread_cpu_us_median=statistics.median(thread_cpu),
               metadata_us_median=statistics.median(r.metadata_us for r in recs),
               upload_bytes_median=statistics.median(r.upload_bytes for r in recs),
               gpu_busy_us_per_step=act.busy_us / args.profile_steps,
               gpu_span_us=act.span_us, gpu_busy_us=act.busy_us,
               gpu_idle_fraction=1 - act.busy_us / act.span_us if act.span_us else None,
               gpu_idle_long_gap_fraction=act.long_gap_us / act.span_us if act.span_us else None,
               h2d_bytes_per_step=act.h2d_bytes / args.profile_steps,
               h2d_copies_per_step=act.h2d_copies / args.profile_steps)
    out["phases_us_median"] = breakdown(engine, args.steps, 0)  # timers on: a pass of its own
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Idle fraction and TPOT against N, one line per combination, one row per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(ctxs), 2, figsize=(11, 3.6 * len(ctxs)), squeeze=False)
    for i, ctx in enumerate(ctxs):
        for backend, overlap in COMBOS:
            sel = sorted((r for r in rows if r["context"] == ctx and r["backend"] == backend
                          and r["overlap"] == overlap), key=lambda r: r["n"])
            label = f"{'zos' if backend == 'zos' else 'host-built'}, " \
                    f"{'overlap' if overlap else 'sync'}"
            style = "-" if backend == "zos" else "--"
            ns = [r["n"] for r in sel]
            axes[i][0].plot(ns, [100 * r["gpu_idle_fraction"] for r in sel], style, marker="o",
                            label=label)
            axes[i][1].plot(ns, [r["tpot_us"] / 1e3 for r in sel], style, marker="o",
                            label=label)
        axes[i][0].set_ylabel(f"GPU idle % (context ~{ctx})")
        axes[i][1].set_ylabel(f"TPOT ms (context ~{ctx})")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (request rows)")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8,64,256,512", help="N values, comma-separated")
    ap.add_argument("--contexts", default="1024,7168", help="tokens per row, comma-separated")
    ap.add_argument("--max-kv-gb", type=float, default=100.0,
                    help="skip (N, context) whose KV cache would exceed this many GB")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    ap.add_argument("--profile-steps", type=int, default=24, help="profiled decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results", help="output folder")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_e2e.py needs CUDA", file=sys.stderr)
        return 2
    cfg = smollm2_config()
    model = random_llama(cfg, seed=args.seed, dtype=torch.bfloat16, device="cuda")
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        for n in (int(x) for x in args.sizes.split(",")):
            if n * (ctx * 17 // 16 + 200) * kv_per_token > args.max_kv_gb * 1e9:
                print(f"skip N={n} context {ctx}: KV over {args.max_kv_gb} GB")
                continue
            for backend, overlap in COMBOS:
                r = run_combo(model, backend, overlap, n, ctx, args)
                gc.collect()  # the engine (its KV cache and graphs) goes before the next one
                torch.cuda.empty_cache()
                rows.append(r)
                print(f"ctx {ctx:>5} N {n:>4} {backend:>4} {'overlap' if overlap else 'sync':>7}"
                      f"  TPOT {r['tpot_us']:8.1f} us  tok/s {r['tokens_per_s']:9.0f}"
                      f"  idle {100 * r['gpu_idle_fraction']:5.1f}%"
                      f" ({100 * r['gpu_idle_long_gap_fraction']:4.1f}% in gaps > 20 us)"
                      f"  host CPU {r['host_cpu_us_median']:7.1f} us"
                      f" (thread {r['host_thread_cpu_us_median']:7.1f})"
                      f"  graph steps {r['graph_steps']}"
                      f" (metadata {r['metadata_us_median']:6.1f})", flush=True)
                ph = r["phases_us_median"]
                print("    phases us: " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()))
    gpu, date = torch.cuda.get_device_name(), dt.date.today().isoformat()
    meta = dict(gpu=gpu, date=date, torch=torch.__version__,
                triton=__import__("triton").__version__, model="SmolLM2-135M shape, random "
                "weights, bf16", block_size=BLOCK_SIZE, steps=args.steps, warmup=args.warmup,
                profile_steps=args.profile_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"e2e_{gpu.replace(' ', '_')}_{date}"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    plot(rows, out / f"{stem}.png", f"zos end-to-end decode, {gpu}, {date}")
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
