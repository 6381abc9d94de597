"""Speculative decoding benchmark: tokens/s, prep host time, acceptance and the host-built
baseline's wait for accepted counts, for k = 0 (plain decode) and k draft tokens.

SmolLM2-135M's shape with random weights, bf16, one GPU. For each N (request rows), each k in
``--draft-tokens`` (0 = plain decode) and each backend (host-built, zos), a decode-only steady
state with the synchronous engine: N requests admitted with a repetitive prompt of ~``--context``
tokens (``Engine.admit_prefilled``: their KV taken as already in the cache), buckets of exactly
N * (1 + k) token rows (one CUDA graph), ``--steps`` timed decode steps after ``--warmup``.
Per combination:

* tokens/s: tokens kept (1 + accepted drafts per row and step) over the wall time;
* prep host us per decode step (median over every timed step of ``--repeats`` runs, each
  (k, backend) run once per repeat in rotated order; each repeat's median is kept to show the
  spread): ``backend.stage`` (+ build when eager), as the engine
  records it; for the host-built baseline with k > 0 this includes its synchronous read-back of
  the accepted counts, reported on its own as ``accepted_wait_us_per_step``;
* acceptance rate (accepted drafts / proposed) and tokens per row and step. With random weights
  the acceptance says nothing about real text: only the real-weight CPU demo
  (``zos demo --spec ngram``) gives a meaningful figure.

Target of issue 8: prep host time for k = 2 and 4 within 2 us of k = 0 (zos backend).

Usage: python bench/bench_spec.py --out $OUT/spec_h200.json [--sizes 8,64,256]
       [--draft-tokens 0,2,4] [--context 1024]
CUDA required (``--smoke`` runs a tiny random Llama on the CPU, to check the script only).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time

import torch

from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.models import LlamaConfig, random_llama, smollm2_config

BLOCK_SIZE = 16


def make_engine(model, device, backend: str, k: int, n: int, ctx: int, steps: int) -> Engine:
    """N rows of a repetitive ~ctx-token prompt each, admitted as prefilled."""
    q = 1 + k
    new = steps * q + 2
    max_len = ctx + new + 1
    per_req = -(-(max_len + k) // BLOCK_SIZE)
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=n * per_req + 1, max_num_seqs=n,
                       max_model_len=max_len, backend=backend, buckets=[n * q],
                       num_draft_tokens=k)
    engine = Engine(model, cfg, device)
    vocab = model.config.vocab_size
    for i in range(n):
        pattern = [(7 * i + j) % vocab for j in range(5 + i % 7)]
        prompt = (pattern * (ctx // len(pattern) + 1))[:ctx - i % 13]
        engine.admit_prefilled(Request(i, prompt, new), first_token=pattern[len(prompt) %
                                                                            len(pattern)])
    return engine


def run_combo(model, device, backend: str, k: int, n: int, args) -> dict:
    engine = make_engine(model, device, backend, k, n, args.context, args.warmup + args.steps)
    for _ in range(args.warmup):
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first, rows0, tok0 = len(engine.records), engine.spec_rows, engine.spec_tokens
    wait0 = getattr(engine.backend, "accepted_wait_seconds", 0.0)
    out0 = sum(len(r.output) for r in engine.rows if r is not None)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    recs = [r for r in engine.records[first:] if r.kind == "decode"]
    assert len(recs) == args.steps and all(r.num_reqs == n for r in recs), "not steady state"
    tokens = sum(len(r.output) for r in engine.rows if r is not None) - out0
    rows, kept = engine.spec_rows - rows0, engine.spec_tokens - tok0
    wait = getattr(engine.backend, "accepted_wait_seconds", 0.0) - wait0
    return dict(backend=backend, num_draft_tokens=k, n=n, tokens=tokens, wall_s=wall,
                graph_steps=sum(r.path == "graph" for r in recs),
                prep_us=[r.metadata_us for r in recs],
                upload_bytes=[r.upload_bytes for r in recs], wait_s=wait, rows=rows, kept=kept)


def pooled(runs: list[dict], args) -> dict:
    """One (N, k, backend) over its repeats: medians over every timed step of every repeat,
    tokens/s over their summed wall time, and each repeat's own prep median (the spread)."""
    r0, k = runs[0], runs[0]["num_draft_tokens"]
    steps = args.steps * len(runs)
    prep = [u for r in runs for u in r["prep_us"]]
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    rows, kept = sum(r["rows"] for r in runs), sum(r["kept"] for r in runs)
    return dict(backend=r0["backend"], num_draft_tokens=k, n=r0["n"], context=args.context,
                repeats=len(runs), steps=steps, graph_steps=sum(r["graph_steps"] for r in runs),
                tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                step_us=wall / steps * 1e6,
                prep_us_median=statistics.median(prep), prep_us_mean=statistics.mean(prep),
                prep_us_median_per_repeat=[statistics.median(r["prep_us"]) for r in runs],
                upload_bytes_median=statistics.median(
                    b for r in runs for b in r["upload_bytes"]),
                accepted_wait_us_per_step=sum(r["wait_s"] for r in runs) / steps * 1e6,
                tokens_per_row=(kept / rows) if k else 1.0,
                acceptance_rate=((kept - rows) / (k * rows)) if k else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,64,256", help="N values, comma-separated")
    ap.add_argument("--draft-tokens", default="0,2,4", help="k values, comma-separated")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=6, help="decode steps before timing")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every (k, backend) per N, in rotated order (drift and the "
                         "first run's costs spread over all of them)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (script check)")
    args = ap.parse_args()
    for name in ("repeats", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if args.smoke:
        device = torch.device("cpu")
        model = random_llama(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=4096), seed=0, device=device)
    elif not torch.cuda.is_available():
        print("bench_spec.py needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        model = random_llama(smollm2_config(), seed=0, device=device, dtype=torch.bfloat16)
    rows = []
    ks = [int(x) for x in args.draft_tokens.split(",")]
    for n in (int(x) for x in args.sizes.split(",")):
        runs: dict[tuple[int, str], list[dict]] = {}
        for rep in range(args.repeats):
            combos = [(k, b) for k in ks for b in ("host", "zos")]
            shift = rep * len(combos) // args.repeats
            for k, backend in combos[shift:] + combos[:shift]:
                runs.setdefault((k, backend), []).append(
                    run_combo(model, device, backend, k, n, args))
        for (k, backend), rs in sorted(runs.items()):
            r = pooled(rs, args)
            rows.append(r)
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            spread = "/".join(f"{u:.1f}" for u in r["prep_us_median_per_repeat"])
            print(f"N={n:4d} k={k} {backend:4s}: {r['tokens_per_s']:10.1f} tok/s, prep "
                  f"{r['prep_us_median']:7.1f} us (median; per repeat {spread}), accepted "
                  f"wait {r['accepted_wait_us_per_step']:7.1f} us/step, acceptance {acc}, "
                  f"{r['tokens_per_row']:.2f} tok/row/step", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    with open(args.out, "w") as f:
        json.dump(dict(device=name, date=dt.datetime.now().isoformat(timespec="seconds"),
                       torch=torch.__version__, weights="random (acceptance not meaningful)",
                       args=vars(args), rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
