"""Paged Llama decoder of the serving harness: attention over a paged KV cache, the model,
weight loading."""
from .attention import allocate_kv_cache, decode_attention, prefill_attention, store_kv
from .llama import LlamaConfig, LlamaForCausalLM
from .weights import (
                      from_hf_model,
                      load_smollm2,
                      load_smollm2_hf,
                      random_llama,
                      smollm2_config,
                      smollm2_gguf_path,
)

__all__ = [
    "allocate_kv_cache", "decode_attention", "prefill_attention", "store_kv", "LlamaConfig",
    "LlamaForCausalLM", "from_hf_model", "load_smollm2", "load_smollm2_hf", "random_llama",
    "smollm2_config", "smollm2_gguf_path",
]
