"""Write the steps of bench_prep.py's workload to a binary file, for the C++ pack benchmark
(bench/pack_floor.cpp), which reads them without Python in the way.

Layout (little-endian): five int64 (N, block_size, max_num_blocks_per_req, num_kv_blocks,
count of steps), then per step eight arrays, each an int64 length and its elements: req_ids
(int64), then new_rows, new_tokens, new_positions, new_block_indptr, new_block_ids,
append_rows, append_block_ids (int32). The first step makes every row new.

Usage: python bench/dump_steps.py --n 1024 --steps 400 --out /tmp/steps1024.bin
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import SteadyWorkload, workload_steps  # noqa: E402

FIELDS = ("req_ids", "new_rows", "new_tokens", "new_positions", "new_block_indptr",
          "new_block_ids", "append_rows", "append_block_ids")


def main(argv=None):
    """Dump the first step and ``--steps`` more of a SteadyWorkload of ``--n`` rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1024, help="request rows")
    ap.add_argument("--steps", type=int, default=400, help="steps after the first")
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--out", required=True, help="binary file to write")
    args = ap.parse_args(argv)
    wl = SteadyWorkload(args.n, max_context=args.max_context, seed=args.n)
    with open(args.out, "wb") as f:
        np.array([args.n, wl.bs, wl.w, wl.num_kv_blocks, args.steps + 1], np.int64).tofile(f)
        for step in workload_steps(args.n, args.max_context, args.steps):
            for name in FIELDS:
                a = getattr(step, name)
                np.array([len(a)], np.int64).tofile(f)
                a.tofile(f)
    print(f"wrote {args.out}: N = {args.n}, {args.steps + 1} steps")


if __name__ == "__main__":
    main()
