"""Tensor parallelism for the paged Llama: one rank's shard from the full model's weights.

Megatron-LM's split (Shoeybi et al., 2019), as vLLM's ``QKVParallelLinear`` /
``RowParallelLinear`` apply it: with world size P, rank r keeps

* ``qkv_proj`` (column-parallel): q heads [r * Hq/P, (r+1) * Hq/P) and KV heads
  [r * Hkv/P, (r+1) * Hkv/P) of q, k and v, stacked in that order as in the full model;
* ``o_proj`` (row-parallel): the input columns of its q heads; its output is a partial sum;
* ``gate_up_proj`` (column-parallel): rows [r * I/P, (r+1) * I/P) of gate and of up;
* ``down_proj`` (row-parallel): the input columns of its intermediate slice; partial sum;
* embeddings, norms and ``lm_head``: replicated (every rank computes the whole vocabulary's
  logits, so greedy sampling needs no gather and every rank samples the same tokens).

A shard is a plain :class:`LlamaForCausalLM` of the per-rank shape (:func:`tp_config`: Hq/P q
heads, Hkv/P KV heads, I/P intermediate) whose layers all-reduce (sum) the outputs of
``o_proj`` and ``down_proj`` over the tensor-parallel group (``LlamaLayer.tp_group``). GQA
stays aligned: local q head h reads local KV head h // (Hq/Hkv), as in the full model. Its KV
cache holds the rank's Hkv/P heads (``allocate_kv_cache`` with ``config.num_key_value_heads``).
"""
from __future__ import annotations

import dataclasses

import torch

from zos._checks import check_int

from .llama import LlamaConfig, LlamaForCausalLM


def tp_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    """The per-rank shape of ``config`` under tensor parallelism of ``world_size`` ranks.

    Raises:
        TypeError: ``world_size`` not an int (``zos._checks.check_int``).
        ValueError: ``world_size`` < 1, or ``num_attention_heads``, ``num_key_value_heads``
            or ``intermediate_size`` not divisible by it (KV heads are split, never
            replicated, here).
    """
    world_size = check_int("world_size", world_size)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(config, name)
        if v % world_size:
            raise ValueError(f"tensor parallelism: {name} = {v} is not divisible by the "
                             f"world size {world_size}")
    p = world_size
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // p,
                               num_key_value_heads=config.num_key_value_heads // p,
                               intermediate_size=config.intermediate_size // p)


def shard_state_dict(state_dict: dict, config: LlamaConfig, rank: int,
                     world_size: int) -> dict:
    """Rank ``rank``'s slices of a full :class:`LlamaForCausalLM` state dict (split as the
    module docstring says). Tensors keep dtype and device; slices are contiguous copies.

    Raises:
        TypeError: ``rank`` or ``world_size`` not an int.
        ValueError: a shape :func:`tp_config` refuses, or ``rank`` outside [0, world_size).
        KeyError: a weight missing from ``state_dict``.
    """
    local = tp_config(config, world_size)
    if check_int("rank", rank, 0) >= world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    hd = config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    lq, lkv, li = local.num_attention_heads, local.num_key_value_heads, local.intermediate_size

    def rows(w, start, n):
        return w[start:start + n]

    out = {k: v for k, v in state_dict.items() if not k.startswith("layers.")}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = state_dict[p + norm]
        qkv = state_dict[p + "qkv_proj"]
        q, k, v = qkv[:hq * hd], qkv[hq * hd:(hq + hkv) * hd], qkv[(hq + hkv) * hd:]
        out[p + "qkv_proj"] = torch.cat([rows(q, rank * lq * hd, lq * hd),
                                         rows(k, rank * lkv * hd, lkv * hd),
                                         rows(v, rank * lkv * hd, lkv * hd)]).contiguous()
        out[p + "o_proj"] = state_dict[p + "o_proj"][:, rank * lq * hd:(rank + 1) * lq * hd
                                                     ].contiguous()
        gu = state_dict[p + "gate_up_proj"]
        out[p + "gate_up_proj"] = torch.cat([rows(gu[:inter], rank * li, li),
                                             rows(gu[inter:], rank * li, li)]).contiguous()
        out[p + "down_proj"] = state_dict[p + "down_proj"][:, rank * li:(rank + 1) * li
                                                           ].contiguous()
    return out


def tp_llama(state_dict: dict, config: LlamaConfig, rank: int, world_size: int, group=None, *,
             dtype: torch.dtype = torch.float32, device=None) -> LlamaForCausalLM:
    """Rank ``rank``'s tensor-parallel shard of the model whose full weights are
    ``state_dict`` (a :class:`LlamaForCausalLM` state dict of shape ``config``).

    Args:
        group: the ``torch.distributed`` process group the layers all-reduce over (None: the
            default group; it must hold exactly the ``world_size`` ranks of this shard set).
            With ``world_size == 1`` no collective is issued and the model is the full one.
        dtype, device: of the shard's parameters.

    Returns:
        An eval-mode :class:`LlamaForCausalLM` of shape ``tp_config(config, world_size)``.

    Raises:
        ValueError, KeyError: as :func:`shard_state_dict`.
    """
    local = tp_config(config, world_size)
    model = LlamaForCausalLM(local, dtype=dtype, device=device)
    model.load_state_dict(shard_state_dict(state_dict, config, rank, world_size))
    if world_size > 1:
        if group is None:
            group = torch.distributed.group.WORLD
        for layer in model.layers:
            layer.tp_group = group
    return model.eval()
