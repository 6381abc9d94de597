"""Host CPU time of the engine's own work per decode step, without the model (CPU only).

An Engine on the CPU with a tiny random Llama and ``runner.decode`` replaced by a stub that
stages the step's metadata for real (``backend.stage``, part of every decode step) and skips
the forward: ``buffers.sampled`` holds a fixed non-eos token, written once. N requests are
admitted prefilled with a large ``max_new_tokens`` (no arrivals, no finishes; rows get a block
every block_size steps, staggered by prompt length), then ``engine.step()`` is timed: median
wall (``perf_counter``) and CPU (``process_time``) microseconds over ``--steps`` steps, for
sync and overlap. A second pass wraps the engine's phases with timers (adds ~1 us per wrapped
call) and prints their medians per step. On the CPU the readback copy is synchronous.

    python bench/bench_engine_host.py [--n 1,8,64,256,512] [--steps 200] [--warmup 50]
"""
from __future__ import annotations

import zos._interpret

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

import zos.step
from zos.serving.engine import Engine
from zos.serving.models import LlamaConfig, random_llama
from zos.serving.runner import DecodeResult
from zos.serving.types import EngineConfig, Request

TOKEN, BS, MAX_LEN = 7, 16, 4096
MODEL_CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=MAX_LEN)


def make_engine(n: int, overlap: bool) -> Engine:
    """An engine holding ``n`` steady rows, its decode stubbed (stage only, no forward)."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=n * (MAX_LEN // BS) // 4 + 2 * MAX_LEN // BS,
                       max_num_seqs=max(n, 1), max_model_len=MAX_LEN, backend="zos",
                       use_cuda_graph=False, bucket_policy="vllm")
    eng = Engine(random_llama(MODEL_CFG), cfg, "cpu", overlap=overlap)
    eng.buffers.sampled.fill_(TOKEN)  # what every step "samples"; eos_token_id is None

    def decode(step):
        t0 = time.perf_counter()
        plan = eng.backend.stage(step)
        return DecodeResult("eager", plan.num_reqs, plan.padded_size,
                            plan.padded_size if plan.bucketed else None,
                            (time.perf_counter() - t0) * 1e6, int(eng.backend.last_upload_bytes))

    eng.runner.decode = decode
    for i in range(n):
        ctx = 100 + i % BS  # staggered: about n / BS rows open a block each step
        eng.admit_prefilled(Request(i, [1] * ctx, MAX_LEN - ctx), TOKEN)
    return eng


def time_steps(eng: Engine, steps: int, warmup: int) -> tuple[float, float]:
    """Median wall and CPU microseconds of ``engine.step()``."""
    for _ in range(warmup):
        eng.step()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        c1, t1 = time.process_time(), time.perf_counter()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
    return statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6


def wrap(obj, name: str, acc: dict, label: str) -> None:
    """Replace ``obj.name`` (if it exists) with a timed call adding to ``acc[label]``."""
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def breakdown(eng: Engine, steps: int, warmup: int) -> dict[str, float]:
    """Median microseconds per step of each phase (phases that exist in this engine); also used
    by bench_e2e.py on a GPU engine, where ``runner.decode`` is stage + graph launch and
    ``readback.pop`` includes the wait for the GPU (``wait``). The engine keeps the timers."""
    acc: dict[str, float] = defaultdict(float)
    wrap(eng.scheduler, "retire", acc, "retire")
    wrap(eng.scheduler, "admit", acc, "admit")
    wrap(eng, "_decode", acc, "decode")
    wrap(eng, "_read_back", acc, "drain")
    wrap(eng.runner, "decode", acc, "runner.decode")
    wrap(eng.backend, "stage", acc, "stage")
    wrap(eng.readback, "push", acc, "readback.push")
    wrap(eng.readback, "pop", acc, "readback.pop")
    cls = zos.step.DecodeStep
    saved = {k: cls.__dict__[k] for k in ("build", "__init__")}
    wrap(cls, "build", acc, "DecodeStep")
    wrap(cls, "__init__", acc, "DecodeStep.__init__")
    per: dict[str, list[float]] = defaultdict(list)
    try:
        for k in range(warmup + steps):
            acc.clear()
            w0, t0 = eng.readback.wait_seconds, time.perf_counter()
            eng.step()
            acc["step"] = time.perf_counter() - t0
            acc["wait"] = eng.readback.wait_seconds - w0
            if k >= warmup:
                for key, v in acc.items():
                    per[key].append(v)
    finally:
        for k, v in saved.items():
            setattr(cls, k, v)
    out = {k: statistics.median(v + [0.0] * (steps - len(v))) * 1e6 for k, v in per.items()}
    if "DecodeStep" not in out:  # build not called: the step was constructed directly
        out["DecodeStep"] = out.pop("DecodeStep.__init__", 0.0)
    else:
        out.pop("DecodeStep.__init__", None)
    # decode minus what it calls: block check, row layout, req-id bookkeeping
    out["decode (own)"] = out.get("decode", 0.0) - sum(
        out.get(k, 0.0) for k in ("DecodeStep", "runner.decode", "readback.push"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="1,8,64,256,512")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()
    if not zos._interpret.kernels_interpreted():
        # A CPU benchmark: on a GPU machine the kernels were compiled for the GPU when zos was
        # imported, and no later change of the environment changes that. Run again, as a new
        # process with Triton's interpreter on.
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("bench_engine_host.py: TRITON_INTERPRET=1, yet zos's kernels are compiled")
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    torch.set_num_threads(1)
    ns = [int(x) for x in args.n.split(",")]
    print(f"{'mode':8s} {'N':>5s} {'wall_us':>9s} {'cpu_us':>9s}")
    for overlap in (False, True):
        for n in ns:
            wall, cpu = time_steps(make_engine(n, overlap), args.steps, args.warmup)
            print(f"{'overlap' if overlap else 'sync':8s} {n:5d} {wall:9.1f} {cpu:9.1f}")
    keys = ["step", "retire", "admit", "decode", "decode (own)", "DecodeStep", "runner.decode",
            "stage",
            "readback.push", "drain", "readback.pop"]
    print("\nper-phase medians (us per step, timers add ~1 us per wrapped call; decode (own) ="
          "\ndecode less DecodeStep, stage and push: block check, row layout, bookkeeping):")
    print(f"{'mode':8s} {'N':>5s} " + " ".join(f"{k:>13s}" for k in keys))
    for overlap in (False, True):
        for n in ns:
            b = breakdown(make_engine(n, overlap), args.steps, args.warmup)
            print(f"{'overlap' if overlap else 'sync':8s} {n:5d} "
                  + " ".join(f"{b.get(k, 0.0):13.1f}" for k in keys))


if __name__ == "__main__":
    main()
