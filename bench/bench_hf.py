"""transformers' continuous batching with and without zos (zos/integrations/transformers.py).

SmolLM2-135M's shape with random weights in bfloat16 on one GPU, transformers 5.17.0,
``generate_batch`` of N requests (default 16, 64, 256; prompts of ``--prompt-len`` +-25% random
tokens, ``--new-tokens`` greedy tokens each, no eos), synchronous batching, no transformers CUDA
graphs (``use_cuda_graph=False``: zos replaces the metadata of those steps, not the model's
graphs). For each N, in one process: a warm-up run per mode, then a timed run per mode on the
same persistent manager:

* per decode-only step, the host time of ``prepare_batch_tensors`` (``time.perf_counter`` around
  it): transformers' own (its Python loop, ``torch.tensor`` uploads, the sdpa mask build) against
  zos's (a ``DecodeStep`` from the request states, C++ pack, one H2D copy, prep kernels replayed
  from a CUDA graph per bucket of ``--bucket-policy``); median and p90 over the decode steps
  that were not profiled;
* H2D bytes and copies of one decode step's preparation, from ``torch.profiler``
  (``zos.serving.profiling.profile_device``) over ``--profile-steps`` decode steps in the middle
  of the run (medians), and for zos the staged record's bytes of every decode step (median and
  max: the first decode step after a prefill stages every row as new);
* tokens/s: generated tokens / wall time of the timed ``generate_batch`` (prefill included);
* whether both modes generated the same tokens (in bf16 the two decode attentions round
  differently, so a near-tie may flip a token: the number of identical requests and where the
  others first differ are reported; tests/test_hf.py checks exact equality in float32).

Usage: python bench/bench_hf.py [--requests 16,64,256] [--out bench/results]
       (writes hf_<gpu>_<date>.json). CUDA and transformers 5.17.0 required.
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

from zos.integrations.transformers import ZosOptions, disable_zos, enable_zos, zos_ios_class
from zos.serving.profiling import profile_device


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


class StepRecorder:
    """Wraps ``cls.prepare_batch_tensors`` (restored by ``close``): host time of every decode-only
    step, and device activity of a few of them under the profiler."""

    def __init__(self, cls, profile_from: int, profile_steps: int, zos: bool):
        self.cls, self.original = cls, cls.prepare_batch_tensors
        self.host_s, self.profiled, self.profile_errors = [], [], []
        self.record_bytes = []
        self.decode_steps = 0
        recorder = self

        def wrapped(io, *args, **kwargs):
            requests = kwargs["requests_in_batch"] if "requests_in_batch" in kwargs else args[0]
            decode = all(fs.query_length == 1 and fs.has_new_token for fs in requests)
            k = recorder.decode_steps
            profile = decode and profile_from <= k < profile_from + profile_steps
            if profile:
                _sync()
                ran = []
                try:
                    act = profile_device(
                        lambda: ran.append(recorder.original(io, *args, **kwargs)))
                    recorder.profiled.append(act)
                except RuntimeError as e:  # the profiler failed: the step itself must still run
                    recorder.profile_errors.append(repr(e))
                    if not ran:
                        recorder.original(io, *args, **kwargs)
            else:
                t0 = time.perf_counter()
                recorder.original(io, *args, **kwargs)
                dt_s = time.perf_counter() - t0
            if zos:  # decode-only batches that zos did not take (none expected) are not counted
                decode = decode and io._zos_md is not None
            if decode:
                recorder.decode_steps += 1
                if zos:  # the staged record, exactly (the profiler's H2D bytes include it)
                    recorder.record_bytes.append(io.zos_backend.last_upload_bytes)
                if not profile:
                    recorder.host_s.append(dt_s)

        cls.prepare_batch_tensors = wrapped

    def close(self):
        self.cls.prepare_batch_tensors = self.original

    def summary(self) -> dict:
        us = sorted(1e6 * s for s in self.host_s)
        p90 = us[int(0.9 * (len(us) - 1))] if us else None
        med = (lambda xs: statistics.median(xs) if xs else None)
        return dict(decode_steps=self.decode_steps,
                    metadata_host_us_median=med(us), metadata_host_us_p90=p90,
                    h2d_bytes_per_decode_step=med([a.h2d_bytes for a in self.profiled]),
                    h2d_copies_per_decode_step=med([a.h2d_copies for a in self.profiled]),
                    profiled_steps=len(self.profiled), profile_errors=self.profile_errors,
                    zos_record_bytes_median=med(self.record_bytes),
                    zos_record_bytes_max=max(self.record_bytes, default=None))


def run(model, inputs, args, n: int, zos: bool) -> tuple[dict, list]:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    bs = args.block_size
    max_len = max(len(p) for p in inputs) + args.new_tokens
    cb = ContinuousBatchingConfig(block_size=bs, num_blocks=n * (-(-max_len // bs) + 1),
                                  max_batch_tokens=args.max_batch_tokens,
                                  max_requests_per_batch=n, use_cuda_graph=False,
                                  use_async_batching=False)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    if zos:
        enable_zos(model, ZosOptions(bucket_policy=args.bucket_policy))
    try:
        kw = dict(generation_config=gen, continuous_batching_config=cb, progress_bar=False,
                  persistent_manager=True)
        model.generate_batch(inputs, **kw)  # warm-up: Triton compile, prep graphs, allocator
        recorder = StepRecorder(zos_ios_class() if zos else ContinuousBatchingIOs,
                                args.new_tokens // 2, args.profile_steps, zos)
        try:
            _sync()
            t0 = time.perf_counter()
            out = model.generate_batch(inputs, **kw)
            _sync()
            wall = time.perf_counter() - t0
        finally:
            recorder.close()
    finally:
        model.destroy_cached_continuous_batching_manager()
        disable_zos(model)
    order = sorted(out, key=lambda k: int(k.split("_")[-1]))
    tokens = [out[k].generated_tokens for k in order]
    if len(tokens) != len(inputs) or any(len(t) != args.new_tokens for t in tokens):
        raise RuntimeError(f"{'zos' if zos else 'transformers'} run at N={n} did not finish "
                           f"every request (see the log above)")
    total = sum(len(t) for t in tokens)
    res = dict(recorder.summary(), wall_s=wall, generated_tokens=total, tokens_per_s=total / wall)
    return res, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="16,64,256", help="comma-separated N")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--bucket-policy", default="vllm",
                    help="zos's bucket policy (prep graphs per bucket); 'none' for eager prep")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script on a CPU: tiny float32 model, no profiling")
    args = ap.parse_args(argv)
    if args.bucket_policy == "none":
        args.bucket_policy = None
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
        base, base_tokens = run(model, inputs, args, n, zos=False)
        ours, our_tokens = run(model, inputs, args, n, zos=True)
        ratio = (base["metadata_host_us_median"] / ours["metadata_host_us_median"]
                 if base["metadata_host_us_median"] and ours["metadata_host_us_median"] else None)
        # bf16: the two decode attentions round differently, so near-tied logits may flip
        # a token (and the rest of that request); report where each request first differs.
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(base_tokens, our_tokens)]
        row = dict(requests=n, transformers=base, zos=ours, metadata_host_ratio=ratio,
                   tokens_per_s_ratio=ours["tokens_per_s"] / base["tokens_per_s"],
                   tokens_equal=base_tokens == our_tokens,
                   requests_identical=sum(d is None for d in first_diff),
                   first_difference_per_request=first_diff)
        results.append(row)
        print(f"N={n}: metadata host us/step transformers {base['metadata_host_us_median']:.0f}"
              f" zos {ours['metadata_host_us_median']:.1f} ({ratio:.1f}x); H2D B/step "
              f"{base['h2d_bytes_per_decode_step']} / {ours['h2d_bytes_per_decode_step']}; "
              f"tokens/s {base['tokens_per_s']:.0f} / {ours['tokens_per_s']:.0f}; "
              f"identical requests {row['requests_identical']}/{n}", flush=True)
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
