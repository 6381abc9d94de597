"""Where the host time of one zos step goes (H200 notes in bench/NOTES.md).

Runs the steady workload of bench_prep.py (5% of rows replaced per step) through
DeviceMetadataBackend with prep graphs, for both ways the record reaches the prep kernels
("mapped": packed into a slot of the zero-copy ring, which the graph reads in place;
"copy": packed into a pinned buffer and copied by one H2D copy), and times per step
``stage`` and ``build`` (graph replay), then each call they are made of, alone:

- pack alone (C++): ``StepPacker.pack`` of the same steps into a numpy buffer, its work
  O(changed rows) (``rows_visited`` gives the rows it visited);
- ring fences alone: ``acquire`` + ``commit`` of a second ring on the same stream (one
  cuEventRecord of the slot staged last and one cuEventQuery of the next slot);
- upload alone (copy path): one native H2D copy and its fence;
- graph replay alone: ``torch.cuda.CUDAGraph.replay`` of the bucket's prep graph;
- Python: stage less pack and fences (argument passing, plan lookup, owner check);
- the stage once the build ordering is on (``zos.stream_order``: after one build off the
  backend's stream, as any captured build turns it on; the second half of the steps): one
  more native event wait per stage (mapped), or a wait and a record (copy).

Each part's floor is the cheapest call that does it, measured too: for the pack, the pack of
an empty step (the call and its argument checks) and a memcpy of the record's words; for the
replay, the replay of a one-kernel graph; for the fences, one record and one query of a CUDA
event (the fences alone). Prints medians in microseconds and,
with ``--out``, writes them as JSON. CUDA only.

Usage: python bench/host_breakdown.py [--sizes 1,8,64,256,512,1024] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime as dt
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
from zos._C import PinnedUpload  # noqa: E402
from zos.staging_ring import StagingRing  # noqa: E402

from workload import SteadyWorkload, workload_steps  # noqa: E402


def med_us(fn, reps=2000):
    """Median microseconds of ``fn()`` over ``reps`` calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def fences_once(ring, stream_handle):
    """One step's fence work alone on a native ``MappedRing``: fence the slot staged last,
    wait for the next one (as ``StepPacker.stage_into_ring`` does around the pack)."""
    ring.acquire(stream_handle)
    ring.commit()


def breakdown(n, mode, steps):
    """Medians (us) of one backend's step and of its parts, for batch size ``n``."""
    wl_w, wl_bs, kv = steps["w"], steps["bs"], steps["num_kv_blocks"]
    bufs = DecodeBuffers(n, wl_w, wl_bs, device="cuda")
    be = DeviceMetadataBackend(bufs, num_kv_blocks=kv, vocab_size=32000,
                               buckets=BucketTable([n]), capture_prep=True, staging=mode)
    seq = steps["steps"]  # prebuilt: each part is timed with the host's caches warm
    be.prepare(seq[0])
    t_stage, t_build, t_meta, t_ordered = [], [], [], []
    half = len(seq) // 2
    side = torch.cuda.Stream()
    for i, s in enumerate(seq[1:], 1):
        t0 = time.perf_counter_ns()
        plan = be.stage(s)
        t1 = time.perf_counter_ns()
        if i == half:  # one build off the backend's stream: its stages order builds from now
            side.wait_stream(be.stream)
            with torch.cuda.stream(side):
                be.build(plan.padded_size)
            be.stream.wait_stream(side)
            continue
        be.build(plan.padded_size)
        t2 = time.perf_counter_ns()
        be.metadata(plan)
        if i > half:
            t_ordered.append(t1 - t0)
            continue
        t_stage.append(t1 - t0)
        t_build.append(t2 - t1)
        t_meta.append(time.perf_counter_ns() - t2)
    assert be.build_order.joined
    torch.cuda.synchronize()
    packer = StepPacker(n, 1, wl_bs, wl_w, kv, 32000)
    out = np.zeros(staging.capacity_words(n, wl_w), np.int32)
    t_pack, visited, words = [], [], []
    for s in seq:
        t0 = time.perf_counter_ns()
        w = packer.pack_step(s, out)
        t_pack.append(time.perf_counter_ns() - t0)
        visited.append(packer.rows_visited)
        words.append(w)
    empty = DecodeStep.build([])
    floor_packer = StepPacker(n, 1, wl_bs, wl_w, kv, 32000)
    words_med = int(statistics.median(words[1:]))
    src, dst = out[:words_med].copy(), np.zeros(words_med, np.int32)
    row = {
        "stage": statistics.median(t_stage) / 1e3,
        "stage, build ordering on (after a build off its stream)": statistics.median(
            t_ordered) / 1e3,
        "build (graph replay)": statistics.median(t_build) / 1e3,
        "metadata (memoised views)": statistics.median(t_meta) / 1e3,
        "pack alone (C++)": statistics.median(t_pack[1:]) / 1e3,
        "rows visited by pack": statistics.median(visited[1:]),
        "record bytes": 4 * statistics.median(words[1:]),
        "graph replay alone": med_us(be.prep_graphs[n].replay),
        "floor: pack of an empty step (call + checks)": med_us(
            lambda: floor_packer.pack_step(empty, out)),
        "floor: memcpy of the record's words": med_us(lambda: np.copyto(dst, src)),
        "floor: replay of a one-kernel graph": med_us(steps["tiny_graph"].replay),
    }
    handle = be.stream.cuda_stream
    if mode == "mapped":
        ring = StagingRing(4, 64, bufs.device)
        row["ring fences alone (record + query)"] = med_us(lambda: fences_once(ring.fences,
                                                                               handle))
        ring.synchronize()
        fences = row["ring fences alone (record + query)"]
    else:
        nbytes = 4 * staging.total_words(0, 0, 0)  # a second upload on the same stream
        dst = torch.zeros(nbytes // 4, dtype=torch.int32, device=bufs.device)
        src = [torch.zeros(nbytes // 4, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        up = PinnedUpload(dst.data_ptr(), src[0].data_ptr(), src[1].data_ptr(), nbytes,
                          bufs.device.index or 0)
        row["upload alone (copy + fence)"] = med_us(lambda: up.submit(up.acquire(), nbytes,
                                                                      handle))
        up.synchronize()
        fences = row["upload alone (copy + fence)"]
    row["python in stage (stage - pack - fences)"] = row["stage"] - row["pack alone (C++)"] - fences
    row["step (stage + build + metadata)"] = (row["stage"] + row["build (graph replay)"]
                                              + row["metadata (memoised views)"])
    torch.cuda.synchronize()
    return row


def main(argv=None):
    """Print the breakdown for each N and mode; ``--out`` writes the JSON there."""
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
        steps = dict(steps=list(workload_steps(n, wl.max_ctx, args.steps)),
                     w=wl.w, bs=wl.bs, num_kv_blocks=wl.num_kv_blocks, tiny_graph=tiny_graph)
        for mode in ("mapped", "copy"):
            row = breakdown(n, mode, steps)
            results.append(dict(n=n, mode=mode, **row))
            print(f"N={n} staging={mode}")
            for name, us in row.items():
                print(f"  {name:<42} {us:9.2f}")
    if args.out:
        name = torch.cuda.get_device_name().replace(" ", "_")
        today = dt.date.today().isoformat()
        out = Path(args.out) / f"host_breakdown_{name}_{today}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), date=today, torch=torch.__version__,
                    steps=args.steps, unit="us (rows visited and record bytes: counts)")
        out.write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
