"""transformers' continuous batching at its best against zos inside it.

SmolLM2-135M's shape with random weights (bf16 by default) on one GPU, transformers 5.17 or 5.25,
``generate_batch`` of N requests (default 16, 64, 256; prompts of ``--prompt-len`` +-25% random
tokens, ``--new-tokens`` greedy tokens each, no eos) on a persistent manager: per N and mode a
warm-up run (graph captures, Triton compiles), then ``--repeats`` timed runs and one profiled
run, mode after mode on the same inputs.
Modes (``--modes``):

* ``tf_best``: transformers with ``use_cuda_graph=True`` and ``use_async_batching=True`` (the
  mode a user who wants speed picks; its own ``paged|sdpa`` attention, no flash-attn here);
* ``tf_eager``: transformers with graphs and async off (its default for sdpa);
* ``zos``: ``enable_zos`` with no options (its fastest mode: transformers' graphs on the decode
  path and async on, zos's decode steps one graph replay per vLLM bucket; until 2026-12-01 the
  default had graphs on both paths, which is what ``zos`` in that day's JSON ran);
* ``zos_host``: ``zos`` with ``ZosOptions(metadata_backend="host")``: zos's attention, buckets
  and whole-step graphs, the metadata built on the host and copied every step
  (``HostMetadataBackend``): ``tf_best`` -> ``zos_host`` is what zos's attention and graph buy,
  ``zos_host`` -> ``zos`` what device-side metadata buys;
* ``zos_sync``: zos with graphs on, async off;
* ``zos_dg``: zos with async on and transformers' graphs on the decode path only (its prefill
  eager, as transformers' own default for sdpa), explicitly;
* ``zos_all_graphs``: zos with async on and transformers' graphs on both paths.

Per mode: tokens/s (generated tokens / wall time of the run, prefill included; the best and
the median of the repeats); per decode-only loop iteration (medians): wall time (TPOT), the host
time of transformers' three phases (``prepare_next_batch``, ``_generation_step``,
``update_batch``; under async ``update_batch`` includes its wait for the step in flight) and of
``prepare_batch_tensors`` alone (the metadata); H2D bytes / copies and GPU busy time of a whole
decode iteration from ``torch.profiler`` (``--profile-steps`` decode iterations of a separate
run, after ``--new-tokens // 4`` of them), and the host-link bytes (H2D plus zos's record,
which its prep kernels read from mapped host memory); the first decode iteration after a
prefill (zos stages every row as new);
the wall time ``generate_batch`` spends outside its batches (manager start and stop: its
``stop`` runs ``gc.collect()``, the same for every mode) and tokens/s over the batches alone
(first batch's start to last batch's end, what a long-lived manager sees).
Token agreement of each mode with ``tf_best`` (bf16: near-tied random logits may flip; the
float32 equality is tested in tests/test_hf.py).

Usage: python bench/bench_hf.py [--requests 16,64,256] [--out bench/results]
       (writes hf_<gpu>_<date>.json). CUDA and transformers 5.17 or 5.25 required
       (``--smoke``: a tiny model on the CPU, to check the script; graphs and async are then
       off).
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (zos before transformers: see the integration's docstring)

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from zos.integrations.hf_internals import internals
from zos.integrations.hf_ios import zos_ios_classes
from zos.integrations.transformers import ZosOptions, disable_zos, enable_zos
from zos.serving.profiling import profile_device

# name: (zos's metadata backend, None without zos; use_cuda_graph; use_async_batching), a None
# in the last two: zos's choice (its fastest mode)
MODES = {
    "tf_best": (None, True, True),
    "tf_eager": (None, False, False),
    "zos": ("device", None, None),
    "zos_host": ("host", None, None),
    "zos_sync": ("device", True, False),
    "zos_dg": ("device", (False, True), True),  # decode graphs only (prefill eager), async
    "zos_all_graphs": ("device", True, True),  # graphs on both paths, async
}


def smollm2_shape_model(smoke: bool, dtype: torch.dtype = torch.bfloat16):
    """Random SmolLM2-135M-shape weights in bf16 on CUDA (``smoke``: a 2-layer float32 model of
    hidden size 64 on the CPU, to check the script itself)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    if smoke:
        shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", dtype)
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _med(xs):
    return statistics.median(xs) if xs else None


class LoopRecorder:
    """Wraps transformers' batch processor phases and the IOs' ``prepare_batch_tensors`` (all
    restored by ``close``): per loop iteration, the host time of each phase and whether the
    batch was decode-only. With ``profile_steps`` > 0, that many iterations, from the one after
    ``profile_from`` decode-only iterations on, run under ``torch.profiler`` (kept with their
    decode flag: only decode-only ones are summarised)."""

    PHASES = ("prepare_next_batch", "_generation_step", "update_batch")

    def __init__(self, profile_from: int, profile_steps: int):
        from transformers.generation.continuous_batching import continuous_api as api
        from transformers.generation.continuous_batching import input_outputs as tio
        self.restore = []
        self.iters = []  # dicts: phase -> seconds, "decode", "metadata", "wall", "zos_bytes"
        self.profiled = []
        self.profile_errors = []
        self.loop_span = [None, None]  # perf_counter at the first batch's start, last's end
        self.decode_seen = 0
        rec = self
        cur = {}

        def wrap(owner, name, fn):
            self.restore.append((owner, name, fn))
            setattr(owner, name, fn)

        for phase in self.PHASES:
            original = getattr(api.ContinuousBatchProcessor, phase)

            def timed(bp, *a, _orig=original, _phase=phase, **k):
                t0 = time.perf_counter()
                try:
                    return _orig(bp, *a, **k)
                finally:
                    cur[_phase] = time.perf_counter() - t0
            wrap(api.ContinuousBatchProcessor, phase, timed)

        body = api.ContinuousBatchingManager._generation_loop_body

        def loop_body(manager, bp, bootstrapping):
            cur.clear()
            profile = (profile_steps and rec.decode_seen >= profile_from
                       and len(rec.profiled) < profile_steps)
            t0 = time.perf_counter()
            if profile:
                out = []
                try:
                    act = profile_device(lambda: out.append(body(manager, bp, bootstrapping)))
                except RuntimeError as e:  # the iteration must still run
                    rec.profile_errors.append(repr(e))
                    act = None
                    if not out:
                        out.append(body(manager, bp, bootstrapping))
                result = out[0]
            else:
                result = body(manager, bp, bootstrapping)
            if "_generation_step" in cur:  # an iteration that ran a batch
                end = time.perf_counter()
                rec.iters.append(dict(cur, wall=end - t0))
                rec.loop_span = [rec.loop_span[0] or t0, end]
                rec.decode_seen += bool(cur.get("decode"))
                if profile and act is not None:
                    rec.profiled.append((act, bool(cur.get("decode")), cur.get("zos_bytes", 0)))
            return result
        wrap(api.ContinuousBatchingManager, "_generation_loop_body", loop_body)

        classes = (tio.ContinuousBatchingIOs, tio.ContinuousBatchingAsyncIOs) + zos_ios_classes()
        for cls in classes:
            original = cls.__dict__["prepare_batch_tensors"]

            def prep(io, requests_in_batch, *a, _orig=original, **k):
                t0 = time.perf_counter()
                _orig(io, requests_in_batch, *a, **k)
                cur["metadata"] = time.perf_counter() - t0
                cur["decode"] = all(fs.query_length == 1 and fs.has_new_token
                                    for fs in requests_in_batch)
                zos = getattr(io, "zos", None)
                md = getattr(io, "zos_md", None)
                if isinstance(md, list):
                    md = md[io.current_pair]
                if zos is not None and md is not None:  # read in place from mapped memory;
                    # the host backend's bytes are H2D copies, which the profiler counts
                    cur["zos_bytes"] = 0 if zos.host_built else zos.backend.last_upload_bytes
            wrap(cls, "prepare_batch_tensors", prep)

    def close(self):
        for owner, name, fn in reversed(self.restore):
            setattr(owner, name, fn)

    def summary(self) -> dict:
        dec = [it for it in self.iters if it.get("decode")]
        prof = [(a, b) for a, d, b in self.profiled if d]
        after_prefill = [it for prev, it in zip(self.iters, self.iters[1:])
                         if it.get("decode") and not prev.get("decode")]
        us = (lambda key, its: _med([1e6 * it[key] for it in its if key in it]))
        return dict(
            decode_iterations=len(dec), iterations=len(self.iters),
            batches_s=self.loop_span[1] - self.loop_span[0] if self.iters else None,
            tpot_us=us("wall", dec),
            prepare_next_batch_us=us("prepare_next_batch", dec),
            generation_step_us=us("_generation_step", dec),
            update_batch_us=us("update_batch", dec),
            metadata_host_us=us("metadata", dec),
            first_decode_after_prefill_us=us("wall", after_prefill),
            zos_record_bytes_median=_med([it["zos_bytes"] for it in dec if "zos_bytes" in it]),
            zos_record_bytes_max=max((it["zos_bytes"] for it in self.iters
                                      if "zos_bytes" in it), default=None),
            h2d_bytes_per_iteration=_med([a.h2d_bytes for a, _ in prof]),
            # zos's record is read from mapped host memory by the prep kernels (no copy the
            # profiler sees): host-link bytes count it
            host_link_bytes_per_iteration=_med([a.h2d_bytes + b for a, b in prof]),
            h2d_copies_per_iteration=_med([a.h2d_copies for a, _ in prof]),
            gpu_busy_us_per_iteration=_med([a.busy_us for a, _ in prof]),
            profiled_iterations=len(prof), profile_errors=self.profile_errors)


def config(args, n, inputs, mode):
    from transformers import ContinuousBatchingConfig
    _, graphs, asynchronous = MODES[mode]
    if args.smoke:
        graphs = asynchronous = False
    bs = args.block_size
    max_len = max(len(p) for p in inputs) + args.new_tokens
    return ContinuousBatchingConfig(**{internals().page_field: bs},
                                    num_blocks=n * (-(-max_len // bs) + 1),
                                    max_batch_tokens=args.max_batch_tokens,
                                    max_requests_per_batch=n, use_cuda_graph=graphs,
                                    use_async_batching=asynchronous)


def run_mode(model, inputs, args, n: int, mode: str, repeats: int) -> tuple[dict, list]:
    """Warm-up, then ``repeats`` timed runs of one mode on one persistent manager."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    metadata = MODES[mode][0]
    if metadata is not None:
        enable_zos(model, ZosOptions(metadata_backend=metadata))
    walls, tokens, summary = [], None, None
    try:
        kw = dict(generation_config=gen, continuous_batching_config=config(args, n, inputs, mode),
                  progress_bar=False, persistent_manager=True)
        model.generate_batch(inputs, **kw)  # warm-up: captures, compiles, allocator
        for r in range(repeats):
            rec = LoopRecorder(0, 0)
            try:
                _sync()
                t0 = time.perf_counter()
                out = model.generate_batch(inputs, **kw)
                _sync()
                walls.append(time.perf_counter() - t0)
            finally:
                rec.close()
            if r == 0:
                summary = rec.summary()
                order = sorted(out, key=lambda k: int(k.split("_")[-1]))
                tokens = [out[k].generated_tokens for k in order]
        if args.profile_steps:  # a run of its own: the profiler's cost stays out of the above
            rec = LoopRecorder(args.new_tokens // 4, args.profile_steps)
            try:
                model.generate_batch(inputs, **kw)
            finally:
                rec.close()
            prof = rec.summary()
            for key in ("h2d_bytes_per_iteration", "host_link_bytes_per_iteration",
                        "h2d_copies_per_iteration", "gpu_busy_us_per_iteration",
                        "profiled_iterations", "profile_errors"):
                summary[key] = prof[key]
    finally:
        model.destroy_cached_continuous_batching_manager()
        disable_zos(model)
    if len(tokens) != len(inputs) or any(len(t) != args.new_tokens for t in tokens):
        raise RuntimeError(f"{mode} at N={n} did not finish every request (see the log above)")
    total = sum(len(t) for t in tokens)
    # what generate_batch spends outside its batches: the manager's start and stop (thread,
    # reset, the last 0.1 s poll for requests, gc.collect and empty_cache in stop), request
    # submission and output collection
    outside = walls[0] - summary["batches_s"] if summary["batches_s"] is not None else None
    batches = summary["batches_s"]
    return dict(summary, wall_s=walls, outside_batches_s=outside, generated_tokens=total,
                tokens_per_s_batches=total / batches if batches else None,
                tokens_per_s_best=total / min(walls),
                tokens_per_s_median=total / statistics.median(walls)), tokens


def _line(mode: str, r: dict) -> str:
    us = (lambda k: f"{r[k]:.0f}" if r[k] is not None else "-")
    return (f"{mode} {r['tokens_per_s_best']:.0f} tok/s ({r['tokens_per_s_batches'] or 0:.0f} "
            f"in batches), TPOT {us('tpot_us')} us (prep "
            f"{us('metadata_host_us')}, step {us('generation_step_us')}, update "
            f"{us('update_batch_us')}), host link {r['host_link_bytes_per_iteration']} B")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="16,64,256", help="comma-separated N")
    ap.add_argument("--modes", default="tf_best,tf_eager,zos,zos_host,zos_sync,zos_all_graphs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script on a CPU: tiny float32 model, no profiling")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.smoke:
        args.profile_steps = 0
    elif not torch.cuda.is_available():
        print("bench_hf.py needs CUDA (--smoke runs a tiny model on the CPU)", file=sys.stderr)
        return 2
    import transformers
    model = smollm2_shape_model(args.smoke, getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(args.seed)
    results = []
    for n in [int(x) for x in args.requests.split(",")]:
        lo, hi = max(1, args.prompt_len * 3 // 4), args.prompt_len * 5 // 4
        lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        inputs = [torch.randint(1, model.config.vocab_size, (k,), generator=g).tolist()
                  for k in lens]
        row, toks = dict(requests=n), {}
        for mode in modes:
            row[mode], toks[mode] = run_mode(model, inputs, args, n, mode, args.repeats)
        ref = modes[0]
        row["agreement_with"] = ref
        row["requests_identical"] = {m: sum(a == b for a, b in zip(toks[ref], toks[m]))
                                     for m in modes}
        if "zos" in row and "tf_best" in row:
            row["zos_over_tf_best_tokens_per_s"] = (row["zos"]["tokens_per_s_best"]
                                                   / row["tf_best"]["tokens_per_s_best"])
            a, b = row["tf_best"]["metadata_host_us"], row["zos"]["metadata_host_us"]
            row["metadata_host_ratio_tf_best_over_zos"] = a / b if a and b else None
        if "zos" in row and "zos_host" in row:
            row["zos_over_zos_host_tokens_per_s"] = (row["zos"]["tokens_per_s_best"]
                                                    / row["zos_host"]["tokens_per_s_best"])
        results.append(row)
        print(f"N={n}: " + "; ".join(_line(m, row[m]) for m in modes)
              + f"; identical {row['requests_identical']}", flush=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-smoke"
    gpu = name.replace(" ", "_")
    doc = dict(gpu=name, date=dt.date.today().isoformat(),
               transformers=transformers.__version__, torch=torch.__version__,
               args=vars(args), results=results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" else f"_{args.dtype}"
    path = out / f"hf_{gpu}_{dt.date.today().isoformat()}{suffix}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
