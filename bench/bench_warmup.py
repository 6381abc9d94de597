"""zos's warm-up of a continuous-batching manager shaped as ``zos serve``'s on SmolLM2-135M:
how long the server waits for its graphs, per query-padding interval.

SmolLM2-135M's shape with random weights (bf16, sdpa, zos enabled), a KV cache of 8,192 blocks
of 32 tokens, 2,048 batch tokens (``zos serve``'s documented options), zos's fastest mode
(graphs on both paths, async batching). Per ``--intervals`` value (0: transformers' own, 64
tokens; 128: ``zos serve``'s), in a fresh process each (the first runs with whatever Triton
cache the machine has, later ones with Triton's disk cache warm): ``--managers`` managers one
after another, each created and warmed up by ``_warm_up_zos`` as ``start`` does it. Per manager:
the wall seconds of the warm-up, and its report (graphs, seconds and reserved memory per kind).
Not measured: model loading and the server's own start-up (``serve_ready.py`` times the whole
server), the padding's cost in tokens/s (``bench_serve.py``).

Usage: python bench/bench_warmup.py [--intervals 128,0,128] [--managers 2] [--out bench/results]
(CUDA; writes warmup_<gpu>_<date>.json).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True)


def measure(interval: int, managers: int) -> list[dict]:
    """Warm up ``managers`` managers in this process, one after another (module docstring)."""
    import zos._interpret  # noqa: F401  (before transformers imports triton)

    import torch
    from transformers import (
        ContinuousBatchingConfig,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from zos.integrations import hf_manager
    from zos.integrations.transformers import ZosOptions, enable_zos

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16).cuda().eval()
    model.config._attn_implementation = "sdpa"
    enable_zos(model, ZosOptions(q_padding_interval_size=interval or None))
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    rows = []
    for _ in range(managers):
        cb = ContinuousBatchingConfig(num_blocks=8192, block_size=32, max_batch_tokens=2048)
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb)
        manager.batch_processor = bp = manager._create_batch_processor()
        t0 = time.perf_counter()
        report = hf_manager._warm_up_zos(bp, model)
        rows.append(dict(
            seconds=round(time.perf_counter() - t0, 2),
            q_padding_interval_size=manager.continuous_batching_config.q_padding_interval_size,
            kinds={k: dict(graphs=r.graphs, seconds=round(r.seconds, 2),
                           reserved_gib=round(r.reserved_bytes / 2**30, 3))
                   for k, r in report.items()},
            line=hf_manager.describe_warmup(report)))
        del manager, bp
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", default="128,0,128",
                    help="query-padding intervals in tokens, one fresh process each (0: "
                         "transformers' own)")
    ap.add_argument("--managers", type=int, default=2, help="managers per process")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print("RESULT", json.dumps(measure(args.child, args.managers)))
        return 0
    import torch

    results = []
    for interval in (int(v) for v in args.intervals.split(",")):
        done = subprocess.run([sys.executable, __file__, "--child", str(interval),
                               "--managers", str(args.managers)],
                              capture_output=True, text=True, check=False)
        found = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if not found:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            return 1
        managers = json.loads(found[0][7:])
        results.append(dict(interval=interval, managers=managers))
        print(f"interval {interval or 'transformers (64)'}: "
              + " | ".join(f"{m['seconds']} s: {m['line']}" for m in managers), flush=True)
    gpu = torch.cuda.get_device_name()
    today = dt.date.today().isoformat()
    doc = dict(gpu=gpu, date=today, torch=torch.__version__,
               transformers=__import__("transformers").__version__, args=vars(args),
               shape="SmolLM2-135M, bf16, 8192 blocks of 32, 2048 batch tokens",
               results=results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"warmup_{gpu.replace(' ', '_')}_{today}.json"
    path.write_text(json.dumps(doc, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
