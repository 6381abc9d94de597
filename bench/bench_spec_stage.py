"""zos's host stage alone for q = 1 + k token rows per request: does it cost more with drafts?

For each N, one DeviceMetadataBackend per k in ``--draft-tokens`` over its own buffers; every
row is staged once as a new row with a whole block row (64 blocks of 16 tokens), then carried:
each timed step is ``backend.stage`` of the N carried rows (the packer's validation and record,
the record's upload enqueued), after handing the packer the previous step's accepted counts
(all q, the worst case it already assumed; ``observe_accepted``, timed on its own). The k are
interleaved step by step, so drift of the host hits them alike, and the device is synchronized
after every step outside the timed region (no GPU work in between: the gap effect of a longer
model step, see README "Speculative decoding, steady state", is left out on purpose). Every 150
steps the rows start again from position 100 (untimed), before they outgrow their blocks.
Reported per (N, k): median stage us, median observe_accepted us, upload bytes.

Not measured: ``build`` (device work, the same kernels for every k) and anything of the model.

Usage: python bench/bench_spec_stage.py [--device cuda] [--sizes 8,64,256]
       [--draft-tokens 0,2,4] [--steps 3000] [--out FILE.json]
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch

from zos import DecodeBuffers, DecodeStep, DeviceMetadataBackend

BLOCK_SIZE, WIDTH, RESTART = 16, 64, 150


def start(backend: DeviceMetadataBackend, n: int) -> None:
    """Every row new: token 7 at position 100, a whole block row of its own."""
    backend.reset()
    rows = {i: (7, 100, list(range(1 + i * WIDTH, 1 + (i + 1) * WIDTH))) for i in range(n)}
    backend.stage(DecodeStep.build(list(range(n)), rows))


def run(n: int, ks: list[int], steps: int, device: str) -> list[dict]:
    backends = {}
    for k in ks:
        b = DecodeBuffers(n, WIDTH, BLOCK_SIZE, uniform_decode_query_len=1 + k, device=device)
        backends[k] = DeviceMetadataBackend(b, num_kv_blocks=n * WIDTH + 1, vocab_size=1000)
    ids = np.arange(n, dtype=np.int64)
    all_accepted = {k: np.full(n, 1 + k, np.int32) for k in ks}
    stage_us = {k: [] for k in ks}
    accept_us = {k: [] for k in ks}
    for t in range(steps):
        for k, be in backends.items():
            if t % RESTART == 0:
                start(be, n)
                continue
            if k:
                t0 = time.perf_counter()
                be.observe_accepted(all_accepted[k], 0)
                accept_us[k].append((time.perf_counter() - t0) * 1e6)
            step = DecodeStep(ids.copy())
            t0 = time.perf_counter()
            be.stage(step)
            stage_us[k].append((time.perf_counter() - t0) * 1e6)
            if device == "cuda":
                torch.cuda.synchronize()
    return [dict(n=n, num_draft_tokens=k, steps=len(stage_us[k]),
                 stage_us_median=statistics.median(stage_us[k]),
                 observe_accepted_us_median=statistics.median(accept_us[k]) if k else 0.0,
                 upload_bytes=int(backends[k].last_upload_bytes)) for k in ks]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sizes", default="8,64,256", help="N values, comma-separated")
    ap.add_argument("--draft-tokens", default="0,2,4", help="k values, comma-separated")
    ap.add_argument("--steps", type=int, default=3000, help="steps per k, restarts included")
    ap.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU: use --device cpu", file=sys.stderr)
        return 2
    ks = [int(x) for x in args.draft_tokens.split(",")]
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for r in run(n, ks, args.steps, args.device):
            rows.append(r)
            print(f"N={r['n']:4d} k={r['num_draft_tokens']}: stage {r['stage_us_median']:6.2f} us, "
                  f"observe_accepted {r['observe_accepted_us_median']:5.2f} us, upload "
                  f"{r['upload_bytes']} B", flush=True)
    if args.out:
        name = (torch.cuda.get_device_name() if args.device == "cuda"
                else platform.processor() or platform.machine())
        with open(args.out, "w") as f:
            json.dump(dict(device=name, date=dt.datetime.now().isoformat(timespec="seconds"),
                           torch=torch.__version__, args=vars(args), rows=rows), f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
