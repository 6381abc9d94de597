"""``zos demo --tp P`` / ``--dp P``: the demo's trace slice over P processes (one GPU each).

Under ``torchrun --nproc-per-node P -m zos.serving.cli demo --tp P`` every process runs
:func:`rank_main`; started without torchrun, :func:`run_dist_demo` spawns the P processes
itself (``torch.multiprocessing``, a file store in a temporary directory). NCCL on CUDA (rank r
on GPU LOCAL_RANK), gloo on a CPU; host-side collectives on a gloo group
(:mod:`zos.serving.distributed`).

TP: the model (SmolLM2-135M's real weights need 9 / 3 heads to split: they do not, so TP takes
random weights of SmolLM2-135M's shape with 8 q heads and 2 KV heads, or ``--tiny``) is
sharded over the P ranks; rank 0 schedules the whole slice. DP: request i goes to rank i mod P,
every rank a full model. Each backend (host, zos) runs the slice in turn after a short warm-up;
the tokens of both must be identical on every rank. ``--spec ngram`` works under both (TP: rank
0 sends the accepted counts to the followers' packers). ``--transport`` picks how the step and
the agreement travel (:mod:`zos.serving.dist_transport`; default: shared memory on one host).
Rank 0 prints the table and writes ``report.json`` under ``--out``: per backend the tokens,
tokens/s (all ranks' tokens over the slowest rank's wall time), decode steps, metadata us per
decode step (median), the cost of the per-step coordination (TP: the step broadcast; DP: the
padded-size agreement), host us, and the transport it ran on.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from zos.serving import demo
from zos.serving import trace as ztrace
from zos.serving.distributed import dp_generate, init_distributed, shutdown_distributed, tp_generate
from zos.serving.engine import Engine, Request
from zos.serving.report import first_mismatch

BACKENDS = ("host", "zos")


def tp_random_config():
    """SmolLM2-135M's shape with 8 q heads and 2 KV heads of 64 (its 9 / 3 do not split)."""
    from zos.serving.models import smollm2_config

    return dataclasses.replace(smollm2_config(), num_attention_heads=8, num_key_value_heads=2)


def _model(s: dict, tp: int, ctx):
    """This rank's model: the demo's model (DP, or TP of the tiny model), or TP's shard of
    random weights of :func:`tp_random_config`. ValueError for ``--weights real`` under TP."""
    from zos.serving.models import random_llama
    from zos.serving.models.parallel import tp_llama

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    if tp == 1:
        return demo.load_model(s, ctx.device)
    if s["tiny"]:
        cfg, info = demo.tiny_config(), dict(model="tiny random Llama", weights="random")
    elif s["weights"] == "real":
        raise ValueError("--weights real: SmolLM2-135M's 9 q / 3 KV heads do not split over "
                         "--tp ranks; use --weights random (8 / 2 heads) or --tiny")
    else:
        cfg = tp_random_config()
        info = dict(model="SmolLM2-135M shape, 8 q / 2 KV heads", weights="random")
    full = random_llama(cfg, seed=s["seed"], dtype=dtype, device=ctx.device)
    model = tp_llama(full.state_dict(), cfg, ctx.rank, ctx.world_size, dtype=dtype,
                     device=ctx.device)
    del full
    info["dtype"] = str(dtype).replace("torch.", "")
    return model, None, info


def _run(model, s, backend, device, reqs, tp, ctx):
    """One backend over ``reqs``; returns this rank's summary dict."""
    engine = Engine(model, demo.engine_config(s, backend), device, overlap=s["overlap"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=ctx.cpu_group)
    t0 = time.perf_counter()
    if tp > 1:
        result, extra = tp_generate(engine, reqs, ctx, transport=s["transport"])
        outputs = result.outputs if result is not None else {}
        coll = extra.broadcast_us if ctx.rank == 0 else []
        dummy, kind = 0, extra.channel.kind if ctx.rank == 0 else None
    else:
        outputs, stats = dp_generate(engine, reqs, ctx, transport=s["transport"])
        coll, dummy, kind = stats.agree_us, sum(stats.dummy), engine.runner.agreement.kind
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    dec = [r for r in engine.records if r.kind == "decode"]
    return dict(outputs={str(k): v for k, v in outputs.items()}, wall_s=wall,
                tokens=sum(len(v) for v in outputs.values()), decode_steps=len(dec),
                dummy_steps=dummy, graphs=engine.graphs_captured,
                metadata_us=statistics.median([r.metadata_us for r in dec]) if dec else None,
                collective_us=statistics.median(coll) if coll else None,
                collective_calls=len(coll), transport=kind)


def rank_main(args) -> dict | None:
    """One rank of the demo (see the module docstring). Returns the report on rank 0."""
    tp, dp = args.tp, args.dp
    ctx = init_distributed()
    if ctx.world_size != tp * dp:
        raise ValueError(f"--tp {tp} --dp {dp}: needs {tp * dp} processes, torch.distributed "
                         f"has {ctx.world_size}")
    cuda = ctx.device.type == "cuda"
    s = demo.resolve_settings(args, cuda)
    s["transport"] = getattr(args, "transport", "auto")
    model, tokenizer, info = _model(s, tp, ctx)
    slice_ = ztrace.trace_slice(s["trace"], s["start"], s["num_requests"], s["scale"],
                                max_prompt=s["max_prompt"], max_output=s["max_output"])
    if s["num_kv_blocks"] is None:
        s["num_kv_blocks"] = demo.auto_num_blocks(slice_, s["block_size"], s["max_num_seqs"],
                                                  s["max_model_len"])
    prompts, source = demo.build_prompts([r.prompt_len for r in slice_], tokenizer,
                                         model.config.vocab_size, s["seed"])
    mine = [i for i in range(len(slice_)) if tp > 1 or i % dp == ctx.rank]

    def requests(n=None):
        ids = mine if n is None else mine[:n]
        return [Request(i, list(prompts[i]) if n is None else list(prompts[i][:8]),
                        slice_[i].output_len if n is None else 2, slice_[i].arrival)
                for i in ids]

    runs = {}
    for backend in BACKENDS:
        _run(model, dict(s, graphs=False), backend, ctx.device, requests(2), tp, ctx)  # warm-up
        runs[backend] = _run(model, s, backend, ctx.device, requests(), tp, ctx)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, runs, group=ctx.cpu_group)
    shutdown_distributed(ctx)
    if ctx.rank != 0:
        return None
    return _report(s, info, source, tp, dp, gathered, ctx, args.out)


def _report(s, info, source, tp, dp, gathered, ctx, out) -> dict:
    """Rank 0: identical-token check, the table, report.json."""
    ranks = range(tp * dp) if dp > 1 else [0]  # under TP only rank 0 holds the outputs
    mismatch = next((f"rank {r}: {m}" for r in ranks for m in [first_mismatch(
        gathered[r]["host"]["outputs"], gathered[r]["zos"]["outputs"])] if m), None)
    table = {}
    for b in BACKENDS:
        rows = [gathered[r][b] for r in ranks]  # TP: rank 0 schedules and counts
        tokens, wall = sum(x["tokens"] for x in rows), max(x["wall_s"] for x in rows)
        table[b] = dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall if wall else 0,
                        decode_steps=[x["decode_steps"] for x in rows],
                        dummy_steps=[x["dummy_steps"] for x in rows],
                        metadata_us=[x["metadata_us"] for x in rows],
                        collective_us=[x["collective_us"] for x in rows], graphs=rows[0]["graphs"],
                        transport=rows[0]["transport"])
    mode = f"tp{tp}" if tp > 1 else f"dp{dp}"
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    report = dict(mode=mode, device=str(ctx.device.type), device_name=name,
                  date=datetime.datetime.now().isoformat(timespec="seconds"),
                  torch=torch.__version__, backend=ctx.backend, info=info,
                  prompt_source=source, settings={k: v for k, v in s.items()},
                  identical=mismatch is None, mismatch=mismatch, backends=table)
    coll = "step broadcast" if tp > 1 else "padded-size agreement"
    spec = f", spec {s['spec']} k={s['num_draft_tokens']}" if s.get("spec") else ""
    print(f"zos demo --{mode[:2]} {mode[2:]} on {ctx.device.type} ({ctx.backend}): "
          f"{info['model']}, {len(gathered)} ranks, {s['num_requests']} requests{spec}, "
          f"{coll} over {table['zos']['transport']}")
    print(f"{'backend':<8} {'tokens':>7} {'tokens/s':>9} {'decode steps/rank':>18} "
          f"{'dummy':>7} {'metadata us':>14}  {coll} us per step (median, per rank)")
    for b, t in table.items():
        us = "/".join(f"{x:.0f}" if x is not None else "-" for x in t["metadata_us"])
        cu = "/".join(f"{x:.0f}" if x is not None else "-" for x in t["collective_us"])
        print(f"{b:<8} {t['tokens']:>7} {t['tokens_per_s']:>9.1f} "
              f"{'/'.join(map(str, t['decode_steps'])):>18} "
              f"{'/'.join(map(str, t['dummy_steps'])):>7} {us:>14}  {cu}")
    print(f"identical tokens (host vs zos): {'YES' if mismatch is None else 'NO: ' + mismatch}")
    path = os.path.join(out, "report.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"report: {path}")
    return report


def _spawned(rank: int, world: int, store: str, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            init_method=f"file://{store}", rank=rank, world_size=world)
    report = rank_main(args)
    if report is not None:
        with open(os.path.join(os.path.dirname(store), "report.json"), "w") as f:
            json.dump(report, f, default=str)


def run_dist_demo(args) -> dict:
    """``zos demo --tp P`` / ``--dp P``: under torchrun (WORLD_SIZE set) this process is one
    rank; otherwise spawn P ranks here. Returns rank 0's report (other torchrun ranks: a dict
    with ``identical`` True, so only rank 0 decides the exit status). ValueError: both
    ``--tp`` and ``--dp`` above 1, or ``--out`` not writable."""
    if args.tp > 1 and args.dp > 1:
        raise ValueError(f"--tp {args.tp} --dp {args.dp}: one kind of parallelism at a time")
    demo.check_out_dir(args.out)
    world = args.tp * args.dp
    if "WORLD_SIZE" in os.environ:
        report = rank_main(args)
        return report if report is not None else dict(identical=True)
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        raise ValueError(f"--tp/--dp: {world} ranks need {world} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        mp.start_processes(_spawned, args=(world, store, args), nprocs=world, join=True,
                           start_method="spawn")
        with open(os.path.join(d, "report.json"), encoding="utf-8") as f:
            report = json.load(f)
    sys.stdout.flush()
    return report
