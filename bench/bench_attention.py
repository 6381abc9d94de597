"""Paged decode attention benchmark: KV bytes read per second of zos.attention (flash-decoding).

For each model shape (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64; and a larger one:
32 / 8 / 128), each N (request rows, default 64 and 256) and each context (default 1k, 4k,
16k tokens, the same for every row), bf16, block size 16, q_len 1: one layer's cache holds
exactly the rows' blocks (plus the null block 0) in shuffled order, and
``paged_decode_attention`` is captured in a CUDA graph with the default ``num_splits``
(optionally also each value of ``--splits``). Timed: the graph replay, median of
``triton.testing.do_bench`` (which clears the L2 cache before every call), and the eager call.

Metric: KV bytes = N * context * num_kv_heads * head_dim * 2 (K and V) * 2 bytes, the bytes the
kernel must read (q, the block table and the outputs are ignored; they are < 1% here), over
the median time. Reported as TB/s and as a fraction of (a) the HBM bandwidth measured in the
same run, a ~4 GB device-to-device ``dst.copy_(src)`` counted as read + write bytes, and (b) the
H200 datasheet 4.8 TB/s. Each configuration is also checked against a float32 torch reference
on two rows (max abs error in the JSON).

Usage: python bench/bench_attention.py [--sizes 64,256] [--contexts 1024,4096,16384]
       [--splits 1,2,4,8] [--out bench/results/attention.json]
CUDA required.
"""
import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from zos.attention import default_num_splits, paged_decode_attention

SHAPES = {
    "smollm2-135m": dict(num_heads=9, num_kv_heads=3, head_dim=64),
    "h32-kv8-d128": dict(num_heads=32, num_kv_heads=8, head_dim=128),
}
DATASHEET_BPS = 4.8e12  # H200 SXM HBM3e
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def measure_hbm(nbytes: int, warmup: int, rep: int) -> dict:
    """Device-to-device copy of ``nbytes``: median time, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=warmup, rep=rep, return_mode="median")
    return dict(copy_bytes=nbytes, copy_ms=ms, bytes_per_s=2 * nbytes / (ms * 1e-3))


def reference_rows(q, kv, bt, seq_lens, scale, rows):
    """float32 attention of request rows ``rows`` (q_len 1): [len(rows), num_heads, head_dim]."""
    _, _, bs, hkv, hd = kv.shape
    group = q.shape[1] // hkv
    outs = []
    for r in rows:
        seq_len = int(seq_lens[r])
        nb = -(-seq_len // bs)
        idx = bt[r, :nb].long()
        k = kv[0, idx].reshape(nb * bs, hkv, hd)[:seq_len].float().repeat_interleave(group, 1)
        v = kv[1, idx].reshape(nb * bs, hkv, hd)[:seq_len].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[r].float(), k) * scale
        outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def bench_config(shape_name, shape, n, ctx, splits_list, warmup, rep, seed):
    """Time one (shape, N, context) for the default split count and each of ``splits_list``."""
    hq, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    w = -(-ctx // BLOCK_SIZE)
    num_blocks = 1 + n * w
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.empty(2, num_blocks, BLOCK_SIZE, hkv, hd, dtype=DTYPE, device="cuda")
    kv.normal_(generator=g)
    kv[:, 0] = 0  # null block
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1
    bt = perm.to(torch.int32).reshape(n, w).contiguous()
    seq_lens = torch.full((n,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(n, hq, hd, dtype=DTYPE, device="cuda", generator=g)
    out = torch.empty_like(q)
    scale = hd ** -0.5
    kv_bytes = n * ctx * hkv * hd * 2 * kv.element_size()
    default = default_num_splits(n, hkv, w, BLOCK_SIZE)
    tiles = triton.cdiv(w * BLOCK_SIZE, 64)  # the launcher caps num_splits here (BLOCK_N 64)
    rows = []
    extra = sorted({min(s, tiles) for s in splits_list} - {default})
    for splits in [None] + extra:
        def call(splits=splits):
            paged_decode_attention(q, kv, bt, seq_lens, scale, out=out, num_splits=splits)

        call()  # compile outside the capture
        torch.cuda.synchronize()
        check = [0, n - 1]
        err = (out[check].float() - reference_rows(q, kv, bt, seq_lens, scale, check)).abs()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        ms = do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
        eager_ms = do_bench(call, warmup=warmup, rep=rep, return_mode="median")
        del graph
        rows.append(dict(
            shape=shape_name, num_heads=hq, num_kv_heads=hkv, head_dim=hd, n=n, context=ctx,
            block_size=BLOCK_SIZE, dtype=str(DTYPE).removeprefix("torch."), q_len=1,
            num_splits=default if splits is None else splits,
            default_splits=splits is None, kv_bytes=kv_bytes, graph_us=ms * 1e3,
            eager_us=eager_ms * 1e3, kv_bytes_per_s=kv_bytes / (ms * 1e-3),
            max_abs_err=err.max().item()))
    return rows


def main(argv=None):
    """Measure the HBM copy bandwidth, then every configuration; print a table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256", help="N (request rows), comma-separated")
    ap.add_argument("--contexts", default="1024,4096,16384", help="tokens per row")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    ap.add_argument("--splits", default="",
                    help="extra num_splits values to time besides the default (e.g. 1,2,4,8)")
    ap.add_argument("--copy-gb", type=float, default=4.0, help="size of the HBM copy test, GB")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    ap.add_argument("--out", default="bench/results",
                    help="JSON file path, or a folder for attention_<gpu>_<date>.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    sizes = [int(x) for x in args.sizes.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    splits_list = [int(x) for x in args.splits.split(",") if x]
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            sys.exit(f"unknown shape {s!r}; known: {list(SHAPES)}")

    hbm = measure_hbm(int(args.copy_gb * 1e9), args.warmup, args.rep)
    torch.cuda.empty_cache()
    print(f"HBM copy: {hbm['bytes_per_s'] / 1e12:.2f} TB/s (read + write of "
          f"{hbm['copy_bytes'] / 1e9:.1f} GB in {hbm['copy_ms']:.3f} ms)")
    rows = []
    seed = 0
    for shape_name in shapes:
        for n in sizes:
            for ctx in contexts:
                seed += 1
                for row in bench_config(shape_name, SHAPES[shape_name], n, ctx, splits_list,
                                        args.warmup, args.rep, seed):
                    row["frac_measured_hbm"] = row["kv_bytes_per_s"] / hbm["bytes_per_s"]
                    row["frac_datasheet"] = row["kv_bytes_per_s"] / DATASHEET_BPS
                    rows.append(row)
                    print_row(row)
                torch.cuda.empty_cache()  # this configuration's cache is freed on return

    name = torch.cuda.get_device_name()
    today = dt.date.today().isoformat()
    meta = dict(gpu=name, date=today, torch=torch.__version__, triton=triton.__version__,
                dtype=str(DTYPE).removeprefix("torch."), block_size=BLOCK_SIZE, q_len=1,
                timing="do_bench median of a CUDA-graph replay (L2 cleared before each call)",
                metric="KV bytes (N*ctx*Hkv*D*2*2) / median time",
                hbm_copy=hbm, datasheet_bytes_per_s=DATASHEET_BPS,
                warmup_ms=args.warmup, rep_ms=args.rep)
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"attention_{name.replace(' ', '_')}_{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")


def print_row(r):
    """One line: shape, N, context, splits, time, TB/s, fractions, error."""
    print(f"{r['shape']:<13} N={r['n']:>4} ctx={r['context']:>6} splits={r['num_splits']:>3}"
          f"{'*' if r['default_splits'] else ' '} graph {r['graph_us']:>9.1f} us "
          f"(eager {r['eager_us']:>9.1f})  {r['kv_bytes_per_s'] / 1e12:5.2f} TB/s  "
          f"{100 * r['frac_measured_hbm']:5.1f}% of copy  {100 * r['frac_datasheet']:5.1f}% of "
          f"4.8 TB/s  err {r['max_abs_err']:.1e}")


if __name__ == "__main__":
    main()
