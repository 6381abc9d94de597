"""How long a server takes to be ready, and how its first requests after that fare.

Per server (``--servers``, those of ``bench_serve.py``): the seconds from its process start to
``/health`` answering (``zos serve`` warms its manager up before it listens: its report line,
graphs, seconds and memory per kind, is copied from its log), then ``--burst`` streaming chat
requests sent together right after ready (prompts and output lengths from the Azure trace, as
``bench_serve.py`` sends them), and once they all ended the same burst again: time to first
token p50 / p90 of each burst and the ratio first / second (transformers' server creates its
manager, and captures its graphs, on the first request). Not measured: tokens/s under load
(``bench_serve.py``).

Usage: python bench/serve_ready.py [--models smollm2] [--servers zos,tf_graphs_async]
[--out bench/results] (CUDA; writes serve_ready_<gpu>_<date>.json). ``--smoke``: tiny model,
float32, CPU.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_serve import (  # noqa: E402
    SERVERS,
    _pct,
    add_server_args,
    model_dir,
    run_level,
    start_server,
    stop_server,
    workload,
)


def ttft(records: list[dict]) -> dict:
    """Time to first token of a burst's requests (ms): p50, p90, and the failures."""
    ms = [1000 * (r["first"] - r["sent"]) for r in records if r["first"] and not r["error"]]
    return dict(p50=_pct(ms, 50), p90=_pct(ms, 90), requests=len(records),
                errors=sum(1 for r in records if r["error"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--servers", default="zos,tf_graphs_async", help=f"of {SERVERS}")
    ap.add_argument("--burst", type=int, default=48, help="requests sent together")
    add_server_args(ap, max_output=64)
    args = ap.parse_args(argv)
    args.profile, args.ramp = False, 0.0
    if args.smoke:
        args.models, args.device, args.dtype, args.burst = "tiny", "cpu", "float32", 4
        args.num_blocks, args.max_batch_tokens, args.max_output, args.max_prompt = 256, 256, 8, 48
        args.servers = "tf_graphs,zos"
    import torch
    import transformers
    from transformers import AutoTokenizer

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="zos-ready-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu-smoke"
    path = out / f"serve_ready_{gpu.replace(' ', '_')}_{dt.date.today().isoformat()}.json"
    results = []
    for name in args.models.split(","):
        mdir = model_dir(name, root, args.dtype, args.tokenizer)
        tok = AutoTokenizer.from_pretrained(mdir)
        bursts = [[(0.0, items) for _, items in workload(tok, args.burst, args.burst, args,
                                                         seed)] for seed in (11, 12)]
        for kind in args.servers.split(","):
            log = out / f"serve_ready_{name}_{kind}.log"
            t0 = time.perf_counter()
            proc, port = start_server(kind, mdir, args, log)
            ready = time.perf_counter() - t0
            try:
                first = ttft(run_level(port, mdir, bursts[0], args.client_procs)[0])
                later = ttft(run_level(port, mdir, bursts[1], args.client_procs)[0])
            finally:
                stop_server(proc)
            report = re.findall(r"zos: ready in .*", log.read_text())
            row = dict(model=name, server=kind, ready_s=round(ready, 2),
                       warmup=report[0] if report else None, first_burst_ttft_ms=first,
                       later_burst_ttft_ms=later,
                       first_over_later_p50=(round(first["p50"] / later["p50"], 2)
                                             if first["p50"] and later["p50"] else None))
            results.append(row)
            print(json.dumps(row), flush=True)
            path.write_text(json.dumps(dict(gpu=gpu, date=dt.date.today().isoformat(),
                                            transformers=transformers.__version__,
                                            torch=torch.__version__, args=vars(args),
                                            results=results), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
