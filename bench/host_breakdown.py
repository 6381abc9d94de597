"""Where the host time of one zos step goes, and the floor of each part (H200 notes in
bench/NOTES.md).

Runs the steady workload of bench_prep.py (5% of rows replaced per step) through
DeviceMetadataBackend with prep graphs, for both ways the record reaches the prep kernels
("mapped": packed into a slot of the zero-copy ring, which the graph reads in place;
"copy": packed into a pinned buffer and copied by one H2D copy), and times ``prepare`` of
each step (one native call stages the step and launches its prep graph), then ``stage``,
``build`` and ``metadata`` called apart (a runner that captures the build with its model
calls ``stage`` alone), then each call they are made of, alone:

- pack alone (C++): ``StepPacker.pack_step`` of the same steps into a numpy buffer, its work
  O(changed rows) (``rows_visited`` gives the rows it visited);
- ring acquire alone: ``acquire`` + ``commit`` of a second ring whose slots are free (the
  done word read, no driver call: what a stage pays while the device keeps up);
- upload alone (copy path): one native H2D copy and its fence;
- graph launch alone: one ``cuGraphLaunch`` of the bucket's prep graph (``zos._C.launch_graph``,
  what ``build`` does), and ``torch.cuda.CUDAGraph.replay`` of it (which also refills the
  random generators' state: two fills per replay);
- Python in stage: stage less pack and the ring acquire or upload (argument passing, plan
  lookup, owner check).

Each part's floor is the cheapest call that does it, measured too: for the pack, the pack of
an empty step (the call and its argument checks) and a memcpy of the record's words; for the
build, the launch of a one-kernel graph; for any native call, a call that does nothing (a
property read through pybind11).

Every figure is taken in two conditions. **warm**: the calls follow one another (steps built
beforehand), so the host's caches and branch predictors hold zos's code and data. **after
scheduler**: before each timed call one step of a second workload is built (Python and numpy,
the work bench_prep.py does between two timed steps, as a scheduler does in a serving loop),
which evicts them; bench_prep.py's figures are taken this way. The device is synchronized
after each step (untimed), so no stage waits for a ring slot. Prints medians in
microseconds and, with ``--out``, writes them as JSON. CUDA only.

Usage: python bench/host_breakdown.py [--sizes 1,8,64,256,512,1024] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zos import (  # noqa: E402
    BucketTable,
    DecodeBuffers,
    DecodeStep,
    DeviceMetadataBackend,
    StepPacker,
    staging,
)
from zos._C import PinnedUpload, launch_graph  # noqa: E402
from zos.staging_ring import StagingRing  # noqa: E402

from workload import SteadyWorkload, workload_steps  # noqa: E402

CONDITIONS = ("warm", "after scheduler")


def med_us(fn, between=None, reps=600, sync_every=0):
    """Median microseconds of ``fn()`` over ``reps`` calls; ``between()`` (untimed) runs
    before each call; with ``sync_every`` the device is synchronized (untimed) every that
    many calls, so that a call that enqueues GPU work never waits for a full launch queue."""
    ts = []
    for i in range(reps):
        if between is not None:
            between()
        if sync_every and i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def acquire_once(ring, stream_handle):
    """One step's slot work alone on a native ``MappedRing`` whose slots are free: read the
    done word, take the slot (as ``StepPacker.stage_call``'s function does around the pack)."""
    ring.acquire(stream_handle)
    ring.commit()


def backend(n, mode, wl):
    """A fresh DeviceMetadataBackend with a prep graph for ``n`` rows."""
    bufs = DecodeBuffers(n, wl.w, wl.bs, device="cuda")
    return DeviceMetadataBackend(bufs, num_kv_blocks=wl.num_kv_blocks, vocab_size=32000,
                                 buckets=BucketTable([n]), capture_prep=True, staging=mode)


def prepare_steps(n, mode, wl, step_iter):
    """Median us of ``prepare`` (one native call: stage and graph launch) of a fresh backend
    over ``step_iter`` (its first step untimed)."""
    be = backend(n, mode, wl)
    be.prepare(next(step_iter))
    ts = []
    for s in step_iter:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        be.prepare(s)
        ts.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) / 1e3


def run_steps(n, mode, wl, step_iter):
    """stage / build / metadata medians (us) of a fresh backend over ``step_iter`` (its first
    step untimed), called apart, and the backend."""
    be = backend(n, mode, wl)
    be.prepare(next(step_iter))
    t_stage, t_build, t_meta = [], [], []
    for s in step_iter:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        plan = be.stage(s)
        t1 = time.perf_counter_ns()
        be.build(plan.padded_size)
        t2 = time.perf_counter_ns()
        be.metadata(plan)
        t_stage.append(t1 - t0)
        t_build.append(t2 - t1)
        t_meta.append(time.perf_counter_ns() - t2)
    torch.cuda.synchronize()
    return [statistics.median(t) / 1e3 for t in (t_stage, t_build, t_meta)], be


def pack_alone(n, wl, step_iter):
    """Medians of ``pack_step`` over ``step_iter`` (first untimed): us, rows visited, bytes."""
    packer = StepPacker(n, 1, wl.bs, wl.w, wl.num_kv_blocks, 32000)
    out = np.zeros(staging.capacity_words(n, wl.w), np.int32)
    packer.pack_step(next(step_iter), out)
    t, visited, words = [], [], []
    for s in step_iter:
        t0 = time.perf_counter_ns()
        words.append(packer.pack_step(s, out))
        t.append(time.perf_counter_ns() - t0)
        visited.append(packer.rows_visited)
    return statistics.median(t) / 1e3, statistics.median(visited), 4 * statistics.median(words)


def breakdown(n, mode, steps, count, tiny_graph, condition):
    """Medians (us) of one backend's step and of its parts, for batch size ``n``."""
    wl = SteadyWorkload(n, seed=n)
    if condition == "warm":
        between, fresh = None, lambda: iter(steps)
    else:  # each step built right before it is timed, as in bench_prep.py; before each
        # timed floor call, one step of another workload is built (untimed)
        between = workload_steps(n, wl.max_ctx, 1 << 30).__next__
        fresh = lambda: workload_steps(n, wl.max_ctx, count)  # noqa: E731
    prepare = prepare_steps(n, mode, wl, fresh())
    (stage, build, meta), be = run_steps(n, mode, wl, fresh())
    pack, visited, nbytes = pack_alone(n, wl, fresh())
    empty = DecodeStep.build([])
    floor_packer = StepPacker(n, 1, wl.bs, wl.w, wl.num_kv_blocks, 32000)
    out = np.zeros(staging.capacity_words(n, wl.w), np.int32)
    src, dst = out[: int(nbytes) // 4].copy(), np.zeros(int(nbytes) // 4, np.int32)
    handle, dev_index = be.stream.cuda_stream, be.buffers.device.index or 0
    graph_exec = be.prep_graphs[n].raw_cuda_graph_exec()
    tiny_exec = tiny_graph.raw_cuda_graph_exec()
    row = {
        "prepare (stage + graph launch in one native call)": prepare,
        "stage": stage,
        "build (cuGraphLaunch of the prep graph)": build,
        "metadata (memoised views)": meta,
        "step (stage + build + metadata)": stage + build + meta,
        "pack alone (C++)": pack,
        "rows visited by pack": visited,
        "record bytes": nbytes,
        "graph launch alone (cuGraphLaunch)": med_us(
            lambda: launch_graph(graph_exec, handle, dev_index), between, sync_every=64),
        "graph replay alone (torch replay)": med_us(be.prep_graphs[n].replay, between,
                                                    sync_every=64),
        "floor: pack of an empty step (call + checks)": med_us(
            lambda: floor_packer.pack_step(empty, out), between),
        "floor: memcpy of the record's words": med_us(lambda: np.copyto(dst, src), between),
        "floor: cuGraphLaunch of a one-kernel graph": med_us(
            lambda: launch_graph(tiny_exec, handle, dev_index), between, sync_every=64),
        "floor: a native call that does nothing (pybind11 property read)": med_us(
            lambda: floor_packer.prev_num_reqs, between),
    }
    if mode == "mapped":
        ring = StagingRing(4, 64, be.buffers.device)
        fences = row["ring acquire alone (done word read)"] = med_us(
            lambda: acquire_once(ring.fences, handle), between)
        ring.synchronize()
    else:
        nbytes = 4 * staging.total_words(0, 0, 0)  # a second upload on the same stream
        dst = torch.zeros(nbytes // 4, dtype=torch.int32, device=be.buffers.device)
        src = [torch.zeros(nbytes // 4, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        up = PinnedUpload(dst.data_ptr(), src[0].data_ptr(), src[1].data_ptr(), nbytes,
                          be.buffers.device.index or 0)
        fences = row["upload alone (copy + fence)"] = med_us(
            lambda: up.submit(up.acquire(), nbytes, handle), between, sync_every=64)
        up.synchronize()
    row["python in stage (stage - pack - ring acquire or upload)"] = stage - pack - fences
    torch.cuda.synchronize()
    return row


def main(argv=None):
    """Print the breakdown for each N, mode and condition; ``--out`` writes the JSON there."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,8,64,256,512,1024")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    x = torch.zeros(1, device="cuda")
    x.add_(1)  # warm-up outside the capture
    torch.cuda.synchronize()
    tiny_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tiny_graph):
        x.add_(1)
    for n in [int(x) for x in args.sizes.split(",")]:
        wl = SteadyWorkload(n, seed=n)
        steps = list(workload_steps(n, wl.max_ctx, args.steps))
        for mode, condition in itertools.product(("mapped", "copy"), CONDITIONS):
            row = breakdown(n, mode, steps, args.steps, tiny_graph, condition)
            results.append(dict(n=n, mode=mode, condition=condition, **row))
            print(f"N={n} staging={mode} ({condition})")
            for name, us in row.items():
                print(f"  {name:<46} {us:9.2f}")
    if args.out:
        name = torch.cuda.get_device_name().replace(" ", "_")
        today = dt.date.today().isoformat()
        out = Path(args.out) / f"host_breakdown_{name}_{today}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), date=today, torch=torch.__version__,
                    steps=args.steps, conditions=CONDITIONS,
                    unit="us (rows visited and record bytes: counts)")
        out.write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
