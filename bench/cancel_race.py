"""transformers 5.17's cancel-in-flight fault under asynchronous batching, with and without zos.

A request cancelled while a batch holding it is in flight is removed (its blocks freed) when the
next batch is prepared, but its status stays DECODING; the in-flight batch's ``update_batch``
then looks it up in the block table when one of its blocks filled up in that batch
(``KeyError`` in ``mark_shareable_blocks_as_complete``), and the manager's thread dies.
``zos.integrations.hf_manager.finish_cancelled`` marks such requests FINISHED for zos-enabled
managers. This script runs the same workload (a tiny random Llama, blocks of 4 tokens, 24
streaming requests, 16 cancelled after their third token) on transformers' own manager with
graphs and async on, and on a zos-enabled one, ``--trials`` times each, and prints how often the
manager died. CUDA only (asynchronous batching needs it).

Usage: python bench/cancel_race.py [--trials 5]
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (before transformers imports triton)

import argparse
import sys

import torch


def trial(with_zos: bool, seed: int) -> str:
    """'ok', or the manager's fatal error (one line)."""
    from transformers import (
        ContinuousBatchingConfig,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from zos.integrations.hf_internals import internals
    from zos.integrations.transformers import disable_zos, enable_zos

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to("cuda").eval()
    model.set_attn_implementation("sdpa")
    gen = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(**{internals().page_field: 4}, num_blocks=256,
                                  max_requests_per_batch=24, max_batch_tokens=128,
                                  use_cuda_graph=(False, True), use_async_batching=True)
    if with_zos:
        enable_zos(model)
    g = torch.Generator().manual_seed(seed)
    try:
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb)
        manager.start()
        for i in range(24):
            manager.add_request(torch.randint(1, 97, (2 + (5 * i) % 13,), generator=g).tolist(),
                                request_id=f"r{i}", streaming=True)
        done, cancel = set(), {f"r{i}" for i in range(24) if i % 3}
        while len(done) < 8:
            res = manager.get_result(timeout=30)
            if res is None:
                break
            if res.request_id in cancel and len(res.generated_tokens) == 3:
                manager.cancel_request(res.request_id)
            if res.is_finished():
                done.add(res.request_id)
        manager.stop(block=True, timeout=30)
        error = manager.background_thread_status.fatal_error
        return "ok" if error is None and len(done) == 8 else repr(error)[:160]
    finally:
        if with_zos:
            disable_zos(model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cancel_race.py needs CUDA (asynchronous batching)", file=sys.stderr)
        return 2
    for with_zos in (False, True):
        outcomes = [trial(with_zos, seed) for seed in range(args.trials)]
        dead = [o for o in outcomes if o != "ok"]
        print(f"{'zos' if with_zos else 'transformers'}: manager died in {len(dead)} of "
              f"{len(outcomes)} trials{': ' + dead[0] if dead else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
