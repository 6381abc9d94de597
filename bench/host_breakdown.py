"""Where the host time of one zos step goes (H200 notes in bench/NOTES.md).

Runs the steady workload of bench_prep.py through DeviceMetadataBackend with
prep graphs and times ``stage`` (pack + one H2D copy + fence) and ``build``
(graph replay) per step, then the calls that make them up, each alone, and the
public stream query that the backend's cached stream handle saves per step.
Prints medians in microseconds. CUDA only.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zos import BucketTable, DecodeBuffers, DeviceMetadataBackend, StepPacker, staging  # noqa: E402

from workload import SteadyWorkload  # noqa: E402


def med_us(fn, reps=2000):
    """Median microseconds of ``fn()`` over ``reps`` calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def upload_once(up, nbytes, stream_handle):
    """One native upload alone: wait for the next pinned buffer, enqueue its copy of
    ``nbytes`` on the raw stream ``stream_handle`` (int) and fence it."""
    up.submit(up.acquire(), nbytes, stream_handle)


def stream_handle(device_index):
    """The public per-step stream query that DeviceMetadataBackend avoids by caching the
    handle of its stream at construction."""
    return torch.cuda.current_stream(device_index).cuda_stream


def main():
    """Print the breakdown for each N given as the first argument (default 1,64,1024)."""
    for n in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,64,1024").split(",")]:
        wl = SteadyWorkload(n, seed=n)
        steps = [wl.first_step()] + [wl.next_step() for _ in range(600)]
        bufs = DecodeBuffers(n, wl.w, wl.bs, device="cuda")
        be = DeviceMetadataBackend(bufs, num_kv_blocks=wl.num_kv_blocks, vocab_size=32000,
                                   buckets=BucketTable([n]), capture_prep=True)
        be.prepare(steps[0])
        t_stage, t_build, t_meta, t_pack = [], [], [], []
        for s in steps[1:301]:
            t0 = time.perf_counter_ns()
            plan = be.stage(s)
            t1 = time.perf_counter_ns()
            be.build(plan.padded_size)
            t2 = time.perf_counter_ns()
            be.metadata(plan)
            t_stage.append(t1 - t0)
            t_build.append(t2 - t1)
            t_meta.append(time.perf_counter_ns() - t2)
        packer = StepPacker(n, 1, wl.bs, wl.w, wl.num_kv_blocks, 32000)
        out = be._pinned_np[0].copy()
        for s in steps[:301]:
            t0 = time.perf_counter_ns()
            packer.pack(s.req_ids, s.new_rows, s.new_tokens, s.new_positions, s.new_block_indptr,
                        s.new_block_ids, s.append_rows, s.append_block_ids, out)
            t_pack.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        dev = bufs.device.index or 0
        # A record of n carried rows, 8 + 2n words, on the backend's stream (its
        # handle as stage passes it).
        upload_alone = functools.partial(upload_once, be._upload, 4 * staging.total_words(n, 0, 0),
                                         be.stream.cuda_stream)
        rows = {
            "stage (pack+copy+fence)": statistics.median(t_stage) / 1e3,
            "build (graph replay)": statistics.median(t_build) / 1e3,
            "metadata (memoised views)": statistics.median(t_meta) / 1e3,
            "pack alone (C++)": statistics.median(t_pack[1:]) / 1e3,
            "upload alone (C++ driver)": med_us(upload_alone),
            "current_stream() handle": med_us(functools.partial(stream_handle, dev)),
            "graph replay alone": med_us(be._graphs[n].replay),
        }
        torch.cuda.synchronize()
        print(f"N={n}")
        for name, us in rows.items():
            print(f"  {name:<28} {us:8.2f} us")


if __name__ == "__main__":
    main()
