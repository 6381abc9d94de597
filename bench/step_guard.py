"""Guard against a slow own-engine decode step: GPU busy time per step against the memory floor
and the committed reference (CUDA required).

The own engine (bench_e2e.py's ``make_engine``: zos backend, sync, SmolLM2-135M shape, random
bf16 weights, ~1k-token contexts, one CUDA graph of exactly N rows) runs ``--steps`` decode steps
under ``torch.profiler`` at each N (default 1 and 64). Printed per N:

* GPU busy us per step (union of kernel, memcpy and memset intervals, over the steps);
* the memory floor: the bytes one step must read (every weight once, every row's KV over its
  context: layers x 2 x KV heads x head_dim x 2 B per token) over the GPU's measured copy
  bandwidth (a 1 GiB device-to-device copy, bytes read + written per second: what the memory
  moves, which a read-only stream approaches): a step cannot be much faster than this, and
  busy / floor says how far the kernels are from it;
* the committed reference: ``gpu_busy_us_per_step`` of the same row (zos, sync, same N, context
  1024) in the newest ``e2e_<gpu>_<date>.json`` of this GPU in ``--results`` (default
  bench/results, the committed one); FAIL where busy is
  more than ``--limit`` (1.5) times it;
* the same N once more after ``TRITON_INTERPRET=1`` is set in this process (a new engine, its
  graphs captured afterwards): FAIL where busy moves by more than ``--limit`` (issue 30: launch
  grids chosen from that variable made every step 3-7x slower).

Exit status 1 on any FAIL. Writes ``step_guard_<gpu>_<date>.json`` under ``--out``.

    python bench/step_guard.py [--sizes 1,64] [--steps 24] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys
from pathlib import Path

import torch

from zos.serving.models import random_llama, smollm2_config
from zos.serving.profiling import profile_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import make_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONTEXT = 1024


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes per second moved (read + written) by a device-to-device copy, the best of reps."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best


def step_bytes(model, cfg, engine) -> tuple[int, int]:
    """Weight bytes (each storage once: tied embeddings count once) and KV bytes one decode step
    reads (every running row's KV in the cache, this step's token included), after the run."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    tokens = sum(r.num_computed + 1 for r in engine.scheduler.row_of)
    return sum(storages.values()), tokens * per_token


def busy_per_step(model, n: int, steps: int, seed: int) -> tuple[float, object]:
    """GPU busy us per decode step of the own engine (zos, sync) with n rows."""
    engine = make_engine(model, "zos", False, n, CONTEXT, steps + 10, seed)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()

    def run():
        for _ in range(steps):
            engine.step()

    return profile_device(run).busy_us / steps, engine


def reference(gpu: str, results: Path) -> tuple[str | None, dict[int, float]]:
    """The newest e2e result of this GPU in ``results``: its path and zos-sync busy us per N."""
    found = sorted(results.glob(f"e2e_{gpu.replace(' ', '_')}_*.json"))
    if not found:
        return None, {}
    rows = json.loads(found[-1].read_text())["rows"]
    return str(found[-1]), {
        r["n"]: r["gpu_busy_us_per_step"] for r in rows
        if r["backend"] == "zos" and not r["overlap"] and r["context"] == CONTEXT}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,64", help="N values, comma-separated")
    ap.add_argument("--steps", type=int, default=24, help="profiled decode steps per N")
    ap.add_argument("--limit", type=float, default=1.5, help="FAIL above this ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(RESULTS),
                    help="folder of the reference e2e JSONs (default: the committed ones)")
    ap.add_argument("--out", default=".", help="output folder")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_guard.py needs CUDA", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    cfg = smollm2_config()
    model = random_llama(cfg, seed=args.seed, dtype=torch.bfloat16, device="cuda")
    bw = copy_bandwidth()
    ref_path, ref = reference(gpu, Path(args.results))
    print(f"{gpu}: copy bandwidth {bw / 1e9:.0f} GB/s (read + written); reference "
          f"{ref_path or 'none committed for this GPU'}")
    sizes = [int(x) for x in args.sizes.split(",")]
    rows, failed = [], False
    for n in sizes:
        busy, engine = busy_per_step(model, n, args.steps, args.seed)
        weights, kv = step_bytes(model, cfg, engine)
        del engine
        gc.collect()
        floor = (weights + kv) / bw * 1e6
        row = dict(n=n, context=CONTEXT, gpu_busy_us_per_step=busy, weight_bytes=weights,
                   kv_bytes=kv, memory_floor_us=floor, busy_over_floor=busy / floor,
                   reference_us=ref.get(n))
        rows.append(row)
        verdict = ""
        if row["reference_us"]:
            ratio = busy / row["reference_us"]
            row["over_reference"] = ratio
            verdict = f"  {ratio:.2f}x reference {row['reference_us']:.0f} us " + (
                "FAIL" if ratio > args.limit else "ok")
            failed |= ratio > args.limit
        print(f"N {n:>4}: GPU busy {busy:8.1f} us/step  floor {floor:7.1f} us "
              f"({busy / floor:.1f}x){verdict}", flush=True)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # after import, as bench_engine_host.py once did
    for row in rows:
        busy, engine = busy_per_step(model, row["n"], args.steps, args.seed)
        del engine
        gc.collect()
        ratio = busy / row["gpu_busy_us_per_step"]
        row["busy_after_setting_triton_interpret_us"] = busy
        moved = not 1 / args.limit <= ratio <= args.limit
        failed |= moved
        print(f"N {row['n']:>4} after TRITON_INTERPRET=1: GPU busy {busy:8.1f} us/step "
              f"({ratio:.2f}x) " + ("FAIL" if moved else "ok"), flush=True)
    if saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = saved
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = dt.date.today().isoformat()
    path = out / f"step_guard_{gpu.replace(' ', '_')}_{date}.json"
    path.write_text(json.dumps(dict(meta=dict(gpu=gpu, date=date, torch=torch.__version__,
                                              copy_bandwidth_bytes_per_s=bw, steps=args.steps,
                                              limit=args.limit, reference=ref_path),
                                    rows=rows, failed=failed), indent=1) + "\n")
    print(("FAIL" if failed else "ok") + f": wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
