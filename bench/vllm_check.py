"""vLLM 0.26 with and without zos on one schedule: greedy outputs, shadow comparison, host time.

One run is one vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine
core steps when this script calls ``step()``, so the schedule depends only on the workload).
The workload: ``--requests`` requests of random prompt tokens and output lengths (seeded),
joining a few per step (Poisson), greedy, ``ignore_eos``, under a KV cache of
``--num-gpu-blocks`` blocks, small enough that vLLM preempts requests. Modes:

* ``vllm``: vLLM alone (the plug-in measures its input preparation only);
* ``zos``: ``ZOS_VLLM=1``;
* ``shadow``: ``ZOS_VLLM=1 ZOS_VLLM_SHADOW=1``: every zos step is prepared by vLLM too and
  compared field by field.

Writes ``--out`` (JSON): each request's output token ids, the steps, the wall time, the
tokens/s of the run and the plug-in's statistics (``ZOS_VLLM_STATS``). ``--compare A B``
compares two such files' outputs; ``--profile PATH`` writes where the host time of the
run went (cProfile, which slows small Python calls: compare shares, not times);
``--gpu-idle START STEPS`` the GPU's idle time between kernels over those steps. Everything
else (attention backend, CUDA graphs, asynchronous scheduling) is vLLM's default for the
model.

    python bench/vllm_check.py --model DIR --mode zos --out zos.json
    python bench/vllm_check.py --compare vllm.json zos.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
import time


def workload(args) -> list[tuple[int, list[int], int]]:
    """(join step, prompt token ids, max_tokens) per request, joining order."""
    rng = random.Random(args.seed)
    out, step = [], 0
    while len(out) < args.requests:
        for _ in range(min(args.requests - len(out), _poisson(rng, args.joins_per_step))):
            out.append((step, [rng.randrange(10, 40000) for _ in range(rng.randint(4, 200))],
                        rng.randint(8, args.max_tokens)))
        step += 1
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, pow(2.718281828459045, -lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def run(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["ZOS_VLLM"] = "0" if args.mode == "vllm" else "1"
    os.environ["ZOS_VLLM_SHADOW"] = "1" if args.mode == "shadow" else "0"
    stats_path = args.out + ".stats.json"
    if os.path.exists(stats_path):
        os.remove(stats_path)
    os.environ["ZOS_VLLM_STATS"] = stats_path
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, num_gpu_blocks_override=args.num_gpu_blocks,
              gpu_memory_utilization=0.5, seed=0, enable_prefix_caching=False)
    engine = llm.llm_engine
    reqs = workload(args)
    outputs: dict[str, list[int]] = {}
    i = steps = 0
    profiler = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    window, window_steps = None, 0  # --gpu-idle's torch.profiler, the steps it saw
    while i < len(reqs) or engine.has_unfinished_requests():
        if args.gpu_idle and steps == args.gpu_idle[0]:
            window = torch_profiler()
            window.start()
        if window is not None and steps == sum(args.gpu_idle):
            window.stop()
            window_steps = args.gpu_idle[1]
        while i < len(reqs) and reqs[i][0] <= steps:
            _, prompt, max_tokens = reqs[i]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                              ignore_eos=True, detokenize=False))
            i += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    wall = time.perf_counter() - t0
    if profiler:
        profiler.disable()
        with open(args.profile, "w") as f:
            for key in ("tottime", "cumulative"):
                pstats.Stats(profiler, stream=f).sort_stats(key).print_stats(60)
    idle = None
    if window is not None:
        if not window_steps:  # the run ended inside the window
            window.stop()
            window_steps = steps - args.gpu_idle[0]
        idle = gpu_idle(window, window_steps)
    tokens = sum(map(len, outputs.values()))
    engine.engine_core.shutdown()  # the worker writes the plug-in's statistics
    stats = json.load(open(stats_path))
    if args.mode == "shadow" and (stats["zos"]["mismatches"] or not stats["zos"]["shadow_steps"]):
        print(f"shadow comparison failed: {stats['zos']}", file=sys.stderr)
    return dict(mode=args.mode, requests=len(outputs), steps=steps, wall_s=wall,
                output_tokens=tokens, tokens_per_s=tokens / wall, plugin=stats, gpu_idle=idle,
                outputs=outputs)


def torch_profiler():
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CUDA])


def gpu_idle(prof, steps: int) -> dict:
    """The GPU's busy and idle time over the profiled steps: the union of its kernels',
    copies' and memsets' intervals (CUDA graphs' kernels included) against the span from
    the first to the last."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return dict(steps=steps, span_ms=span / 1e3, busy_ms=busy / 1e3,
                idle_frac=1 - busy / span if span else None,
                idle_us_per_step=(span - busy) / steps if steps else None)


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    diff = [r for r in a["outputs"] if a["outputs"][r] != b["outputs"].get(r)]
    print(f"{a['mode']} vs {b['mode']}: {len(a['outputs'])} / {len(b['outputs'])} requests, "
          f"{len(diff)} with different greedy outputs {diff[:8]}")
    return 1 if diff or len(a["outputs"]) != len(b["outputs"]) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (config, tokenizer, weights)")
    ap.add_argument("--mode", choices=("vllm", "zos", "shadow"), default="zos")
    ap.add_argument("--out", help="JSON to write")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--joins-per-step", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-gpu-blocks", type=int, default=600,
                    help="KV blocks (vLLM's num_gpu_blocks_override); small forces preemption")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", metavar="PATH",
                    help="cProfile the step loop (engine core and worker: one process) into "
                         "PATH, by own time and by cumulative time")
    ap.add_argument("--gpu-idle", type=int, nargs=2, metavar=("START", "STEPS"),
                    help="torch.profiler over engine steps START .. START+STEPS: the GPU's "
                         "busy and idle time there (gpu_idle in --out)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not (args.model and args.out):
        ap.error("--model and --out are required unless --compare")
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    summary = {k: v for k, v in result.items() if k != "outputs"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
