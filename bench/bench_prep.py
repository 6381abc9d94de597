"""Prep benchmark: zos's device-side metadata against the host-built baseline.

For each batch size N: a steady workload (bench/workload.py: block size 16,
contexts up to 32k tokens, 5% of rows replaced per step, prompt lengths from the
Azure 2023 trace) runs through four backends on the same GPU in the same run:
``host`` (HostMetadataBackend: numba build into pinned memory + copies),
``zos-eager`` (DeviceMetadataBackend, prep kernels launched per step, the record read
in place from the mapped staging ring), ``zos-graph`` (the same, prep kernels replayed
from one CUDA graph per bucket) and ``zos-graph-copy`` (prep graphs, the record copied
to the device by one H2D copy per step: the fallback, ``staging="copy"``).

Measured per step: host microseconds from the schedule (a built DecodeStep) to
work enqueued (``backend.prepare``: stage, build and metadata, for zos-graph one native call
that stages the step and launches its prep graph; median and p90 of timed steps), then, over
as many further steps, ``stage`` alone (``stage us``, the build called after it untimed: the
host time zos adds to a runner that captures the prep inside its own graph, as zos's
GraphRunner does, where the build is part of the runner's one replay), GPU
microseconds of the prep (kernels + memcpys + memsets, from torch.profiler),
host-to-device bytes and copies (torch.profiler memcpy events) and the bytes of the
record, which the mapped variants' kernels read from host memory instead of an H2D copy
(``record_bytes``; those reads are no memcpy, so the profiler does not see them). Not
measured: the scheduler's own work of building the DecodeStep, and any model forward.

With ``--gap-us G`` each timed step is followed by G microseconds of GPU work and a
synchronize (a model-step stand-in): ``gpu_busy`` launches a one-program Triton kernel that
spins on the GPU's ``%globaltimer`` (nanoseconds, independent of the SM clock) until G us
have passed. CUDA only.

With ``--busy-thread`` a Python thread spins beside the run (pure Python, never blocking), as
a serving process's other threads (transformers' server sends each step's outputs from one) keep
the GIL busy: a host call that drops the GIL (a torch op, a native call released) then waits
to take it back until that thread lets go, up to the interpreter's switch interval (5 ms by
default), so host times count the GIL hand-backs of each variant's step.

The JSON's meta records ``python_loop_ms`` (:func:`python_loop_ms`, before and after the run): the
host's speed, which on a shared machine moves between runs and with it every host figure.

Usage: python bench/bench_prep.py [--sizes 1,8,64,256,512,1024] [--out bench/results]
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import argparse
import datetime as dt
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zos import BucketTable, DecodeBuffers, DeviceMetadataBackend, HostMetadataBackend  # noqa: E402
from zos.buckets import vllm_policy  # noqa: E402
from zos.serving.profiling import gpu_busy, profile_device  # noqa: E402

from workload import SteadyWorkload, workload_steps  # noqa: E402

VARIANTS = ("host", "zos-eager", "zos-graph", "zos-graph-copy")
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
          "block_table", "counts")


def make_backend(variant, wl, device, policy):
    """A backend of ``variant`` over fresh buffers sized for ``wl``; buckets of ``policy`` <= N."""
    buckets = BucketTable([b for b in policy.sizes if b <= wl.n], name=policy.name)
    bufs = DecodeBuffers(wl.n, wl.w, wl.bs, device=device)
    kw = dict(num_kv_blocks=wl.num_kv_blocks, vocab_size=32000, buckets=buckets)
    if variant == "host":
        return HostMetadataBackend(bufs, **kw)
    return DeviceMetadataBackend(bufs, capture_prep=variant.startswith("zos-graph"),
                                 staging="copy" if variant.endswith("-copy") else "mapped",
                                 **kw)


def describe_diff(ref, got):
    """'' if every field of the two StepMetadata is equal, else each differing field with
    its first differing index and both values."""
    out = []
    for f in FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        if a.shape != b.shape:
            out.append(f"{f}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        elif not torch.equal(a, b):
            bad = (a != b).nonzero()
            i = tuple(bad[0].tolist())
            out.append(f"{f}: {len(bad)} entries differ, first at {i}: host {a[i].item()} "
                       f"vs {b[i].item()}")
    return "; ".join(out)


def lockstep(variant, steps, wl, device, policy):
    """Run ``variant`` and a host backend step by step, synchronizing and comparing after
    each (the host never runs ahead of the device); the first step that differs, or
    'no step differs' (a difference seen only in the timed run then needs the host ahead)."""
    host = make_backend("host", wl, device, policy)
    other = make_backend(variant, wl, device, policy)
    for i, s in enumerate(steps):
        ref, got = host.prepare(s), other.prepare(s)
        sync(device)
        diff = describe_diff(ref, got)
        if diff:
            return f"step {i} (N={s.num_reqs}) first differs: {diff}"
    return "no step differs"


def sync(device):
    """Wait for the device (no-op on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def bench_one(variant, steps, wl, device, buckets, warmup, timed, profiled, gap_us=0):
    """Run ``steps`` (an iterator, :func:`workload_steps`) through one backend: warm-up,
    timed steps (host us; the step is built, untimed, right before it), profiled steps (GPU
    us, H2D bytes and copies). Returns (row dict, backend)."""
    backend = make_backend(variant, wl, device, buckets)
    for _ in range(1 + warmup):
        backend.prepare(next(steps))
    sync(device)
    host_us, stage_us, upload = [], [], []
    elapsed = torch.zeros(1, dtype=torch.int64, device=device) if gap_us else None

    def model_step():  # stand-in for a model step, then the sampled-token read: host idle
        if gap_us:
            gpu_busy(gap_us, elapsed)
            torch.cuda.synchronize()

    for _ in range(timed):  # the whole step, as a runner without its own graph calls it
        s = next(steps)
        t0 = time.perf_counter_ns()
        backend.prepare(s)
        host_us.append((time.perf_counter_ns() - t0) / 1e3)
        upload.append(backend.last_upload_bytes)
        model_step()
    for _ in range(timed):  # stage alone, as a runner that captures the build calls it
        s = next(steps)
        t0 = time.perf_counter_ns()
        plan = backend.stage(s)
        stage_us.append((time.perf_counter_ns() - t0) / 1e3)
        backend.build(plan.padded_size)
        model_step()
    sync(device)
    rest = [next(steps) for _ in range(profiled)]
    row = dict(variant=variant, gap_us=gap_us, host_us_median=statistics.median(host_us),
               host_us_p90=sorted(host_us)[int(0.9 * len(host_us))],
               stage_us_median=statistics.median(stage_us),
               backend_upload_bytes_median=statistics.median(upload),
               record_bytes_median=(statistics.median(upload)
                                    if variant != "host" else 0))
    if device == "cuda":
        act = profile_device(lambda: [backend.prepare(s) for s in rest])
        row.update(gpu_us=act.gpu_us / len(rest), h2d_bytes=act.h2d_bytes / len(rest),
                   h2d_copies=act.h2d_copies / len(rest), d2h_bytes=act.d2h_bytes / len(rest))
    else:
        for s in rest:
            backend.prepare(s)
    sync(device)
    ring = getattr(backend, "ring", None)  # stages that waited for a slot (host K steps ahead)
    row["ring_waits"] = ring.waits if ring is not None else 0
    return row, backend


def python_loop_ms(iterations: int = 1_000_000) -> float:
    """Milliseconds of a fixed pure-Python loop (no memory beyond a few objects): the host CPU's
    speed at that moment. On the H200's host it has moved by a third to two thirds, between
    processes started a minute apart on the same core and within one run, and every host figure
    with it."""
    t0, x = time.perf_counter_ns(), 0
    for i in range(iterations):
        x += i
    return (time.perf_counter_ns() - t0) / 1e6


def main(argv=None):
    """Benchmark every size and context, print the table, write the JSON with ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,8,64,256,512,1024")
    ap.add_argument("--contexts", default="32768", help="max context lengths, comma-separated")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profiled", type=int, default=20)
    ap.add_argument("--gap-us", type=int, default=0,
                    help="GPU busy time + synchronize after each timed step (a model step "
                         "stand-in: the host then prepares from idle, as in a synchronous engine)")
    ap.add_argument("--check-steps", action="store_true",
                    help="on a mismatch, rerun that backend in lockstep with a host backend "
                         "(synchronize and compare after every step) and name the first "
                         "step and field that differ")
    ap.add_argument("--busy-thread", action="store_true",
                    help="a Python thread spinning beside the run (a serving process's output "
                         "thread): host times then include waits to take the GIL back")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: print only)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"backends to run, comma-separated, host first (of {VARIANTS})")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if variants[0] != "host" or not set(variants) <= set(VARIANTS):
        ap.error(f"--variants must start with host and name only {VARIANTS}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.gap_us and device != "cuda":
        ap.error("--gap-us needs a GPU (the busy kernel reads the GPU's %globaltimer)")
    buckets = vllm_policy(1024)
    rows, failures = [], []
    probe_start = python_loop_ms()  # the host's speed, without the spinning thread
    spinning = threading.Event()
    spinner = (threading.Thread(target=spin, args=(spinning,), daemon=True)
               if args.busy_thread else None)
    if spinner is not None:
        spinning.set()
        spinner.start()
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for n in [int(x) for x in args.sizes.split(",")]:
            wl = SteadyWorkload(n, max_context=ctx, seed=n)
            count = args.warmup + 2 * args.steps + args.profiled
            backends = {}
            for v in variants:
                row, backends[v] = bench_one(v, workload_steps(n, ctx, count), wl, device,
                                             buckets, args.warmup,
                                             args.steps, args.profiled, args.gap_us)
                rows.append(dict(n=n, max_context=ctx, block_size=wl.bs, **row))
            ref = backends["host"].metadata(backends["host"].plan(n))
            for v in variants[1:]:
                diff = describe_diff(ref, backends[v].metadata(backends[v].plan(n)))
                if diff:
                    waits = rows[-len(variants) + variants.index(v)]["ring_waits"]
                    failures.append(f"{v} differs from host at N={n} after the last step "
                                    f"(ring waits {waits}): {diff}")
                    if args.check_steps:  # which step first differs, host and v in lockstep
                        first = lockstep(v, workload_steps(n, ctx, count), wl, device, buckets)
                        failures.append(f"  lockstep: {first}")
            del backends
    spinning.clear()
    if spinner is not None:
        spinner.join()
    probe_end = python_loop_ms()
    print_table(rows)
    print(f"host speed probe (a 1M-iteration Python loop): {probe_start:.0f} ms before the run, "
          f"{probe_end:.0f} ms after")
    if args.out:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        today = dt.date.today().isoformat()
        meta = dict(gpu=name, date=today, torch=torch.__version__,
                    python_loop_ms=dict(start=probe_start, end=probe_end),
                    triton=__import__("triton").__version__, replace_fraction=0.05,
                    buckets="vllm_policy(1024)", steps=args.steps, warmup=args.warmup,
                    gap_us=args.gap_us, busy_thread=args.busy_thread,
                    gap_kernel="gpu_busy: Triton %globaltimer spin",
                    profiled=args.profiled, record="sparse (rows that change)",
                    ring_slots=4)
        gap = f"_gap{args.gap_us}us" if args.gap_us else ""
        gap += "_busy" if args.busy_thread else ""
        out = Path(args.out) / f"prep_{name.replace(' ', '_')}_{today}{gap}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"wrote {out}")
    assert not failures, "\n".join(failures)  # after the table: the timings stay readable


def spin(running: threading.Event) -> None:
    """Pure Python work until ``running`` is cleared: holds the GIL but for the switch interval."""
    n = 0
    while running.is_set():
        n += 1


def print_table(rows):
    """One line per (N, context, backend): medians, GPU us, H2D bytes, ratio to host-built."""
    head = (f"{'N':>5} {'ctx':>6} {'backend':<14} {'host us':>8} {'p90':>8} {'stage us':>8} "
            f"{'gpu us':>8} "
            f"{'H2D B/step':>11} {'copies':>6} {'record B':>9} {'x host':>7} {'waits':>6}")
    print(head)
    base = {(r["n"], r["max_context"]): r["host_us_median"] for r in rows if r["variant"] == "host"}
    for r in rows:
        ratio = base[(r["n"], r["max_context"])] / r["host_us_median"]
        h2d = r.get("h2d_bytes", r["backend_upload_bytes_median"])
        print(f"{r['n']:>5} {r['max_context']:>6} {r['variant']:<14} "
              f"{r['host_us_median']:>8.1f} {r['host_us_p90']:>8.1f} {r['stage_us_median']:>8.1f} "
              f"{r.get('gpu_us', float('nan')):>8.1f} {h2d:>11.0f} "
              f"{r.get('h2d_copies', float('nan')):>6.1f} {r['record_bytes_median']:>9.0f} "
              f"{ratio:>7.1f} {r.get('ring_waits', 0):>6}")


if __name__ == "__main__":
    main()
