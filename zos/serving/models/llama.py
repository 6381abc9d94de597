"""A paged Llama decoder (RMSNorm, RoPE, GQA, SwiGLU), capturable in decode.

Weights: ``qkv_proj`` is q, k, v stacked along the output dim; ``gate_up_proj`` is gate then up.
The decode path (``is_prefill=False``) has static shapes and no host synchronisation.
Matmuls are torch; the elementwise work is three fused Triton kernels (:mod:`.fused`, vLLM
style): RMSNorm with the residual add fused in, RoPE + paged KV write, SiLU-and-mul. A layer
launches 10 kernels in decode (norm, qkv, rope/KV, 2 attention, o_proj, add+norm, gate_up,
silu_and_mul, down); the residual stream is carried from layer to layer as ``(hidden,
residual)`` and added inside the next norm.

Which kernels run (``LlamaForCausalLM(kernels=...)``, :func:`model_ops`): on CUDA the Triton
ones (fused ops, :func:`zos.attention.paged_decode_attention`); on a CPU, where Triton would run
them in its interpreter, the same ops in plain torch (:mod:`.torch_ops`: torch RMSNorm, RoPE,
SiLU, attention through the block table). zos's prep kernels are not the model's: they run in
Triton (compiled, or the interpreter on a CPU) either way.
"""
from __future__ import annotations

from zos._interpret import check_triton_device

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

from zos.buffers import StepMetadata

from . import fused, torch_ops
from .attention import decode_attention, prefill_attention

KERNELS = ("triton", "torch")  # the model's kernel sets (LlamaForCausalLM's ``kernels``)
_OPS = {
    "triton": SimpleNamespace(name="triton", rms_norm=fused.rms_norm,
                              rope_and_store_kv=fused.rope_and_store_kv,
                              silu_and_mul=fused.silu_and_mul, decode_attention=decode_attention),
    "torch": SimpleNamespace(name="torch", rms_norm=torch_ops.rms_norm,
                             rope_and_store_kv=torch_ops.rope_and_store_kv,
                             silu_and_mul=torch_ops.silu_and_mul,
                             decode_attention=torch_ops.decode_attention),
}


def model_ops(kernels: str | None, device: torch.device) -> SimpleNamespace:
    """The model's ops (``rms_norm``, ``rope_and_store_kv``, ``silu_and_mul``,
    ``decode_attention``, and ``name``) for ``kernels``: "triton" (:mod:`.fused` and zos's
    paged attention), "torch" (:mod:`.torch_ops`), or None: "torch" for CPU tensors, else
    "triton". ValueError for another name."""
    if kernels is None:
        kernels = "torch" if torch.device(device).type == "cpu" else "triton"
    if kernels not in _OPS:
        raise ValueError(f"kernels: expected one of {list(KERNELS)} or None, got {kernels!r}")
    if kernels == "triton":
        check_triton_device(device, "LlamaForCausalLM(kernels='triton')")
    return _OPS[kernels]


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama model (a subset of transformers' ``LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf_config) -> LlamaConfig:
        """From a transformers ``LlamaConfig`` (4.x ``rope_theta`` or 5.x ``rope_parameters``).

        Raises NotImplementedError for RoPE scaling other than ``default`` and for attention/MLP
        biases, which this model does not implement.
        """
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling",
                                                                      None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"LlamaConfig.from_hf: rope_type {rope_type!r}")
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise NotImplementedError("LlamaConfig.from_hf: attention/MLP biases")
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = hf_config.eos_token_id
        return cls(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(theta), tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            bos_token_id=hf_config.bos_token_id,
            eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 8192)),
        )


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32 (as transformers).

    One Triton launch (:func:`.fused.rms_norm`), or torch ops on a CPU
    (:func:`.torch_ops.rms_norm`); the residual add can be fused in.
    """

    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops=None):
        """x ``[T, size]`` -> ``[T, size]`` of x's dtype, equal to the torch formula
        ``weight * (xf * rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)`` with
        ``xf = x.float()``. With ``residual`` ``[T, size]``: returns ``(norm(s), s)`` for
        ``s = x + residual`` (vLLM's ``fused_add_rms_norm``). ``ops``: :func:`model_ops`'
        result (None: chosen by x's device). Errors: see :func:`.fused.rms_norm`.
        """
        ops = ops if ops is not None else model_ops(None, x.device)
        return ops.rms_norm(x, self.weight, self.eps, residual)


def _linear(n_out: int, n_in: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(n_out, n_in, dtype=dtype, device=device))


class LlamaLayer(nn.Module):
    """One decoder layer: pre-norm GQA attention over the paged cache, pre-norm SwiGLU MLP.

    ``tp_group``: None (one process), or the ``torch.distributed`` process group of a
    tensor-parallel shard (:mod:`.parallel`): the outputs of ``o_proj`` and ``down_proj``
    (row-parallel, partial sums) are all-reduced (sum) over it in place, Megatron-LM's rule.
    """

    tp_group = None

    def __init__(self, c: LlamaConfig, dtype, device):
        super().__init__()
        self.c = c
        qkv_out = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.qkv_proj = _linear(qkv_out, c.hidden_size, dtype, device)
        self.o_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.gate_up_proj = _linear(2 * c.intermediate_size, c.hidden_size, dtype, device)
        self.down_proj = _linear(c.hidden_size, c.intermediate_size, dtype, device)

    def forward(self, x, residual, cos, sin, kv_cache, meta, is_prefill: bool, ops=None):
        """One layer on the residual stream ``x + residual`` (vLLM style).

        Args:
            x: ``[T, hidden]``, the previous layer's MLP output (the embeddings for layer 0).
            residual: ``[T, hidden]`` residual stream before adding ``x``, or None for layer 0.
            cos, sin: ``[T, head_dim]`` RoPE rows in the model dtype.
            kv_cache, meta, is_prefill: as :meth:`LlamaForCausalLM.forward`; this step's K/V
                are written into ``kv_cache`` at ``meta.slot_mapping``.
            ops: the kernels, :func:`model_ops`' result (None: chosen by x's device).

        Returns:
            ``(mlp_out, residual)``, both ``[T, hidden]``: this layer's output hidden state is
            ``mlp_out + residual`` (the add is fused into the next norm).
        """
        c = self.c
        t = x.shape[0]
        hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        ops = ops if ops is not None else model_ops(None, x.device)
        if residual is None:
            h, residual = self.input_layernorm(x, ops=ops), x
        else:
            h, residual = self.input_layernorm(x, residual, ops=ops)
        qkv = F.linear(h, self.qkv_proj)
        q = ops.rope_and_store_kv(qkv, cos, sin, kv_cache, meta.slot_mapping, hq, hkv, hd)
        attn = prefill_attention if is_prefill else ops.decode_attention
        o = attn(q, kv_cache, meta, hd ** -0.5)
        h, residual = self.post_attention_layernorm(
            self._reduce(F.linear(o.reshape(t, hq * hd), self.o_proj)), residual, ops=ops)
        gate_up = F.linear(h, self.gate_up_proj)
        return self._reduce(F.linear(ops.silu_and_mul(gate_up), self.down_proj)), residual

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x itself in one process; under tensor parallelism x summed over ``tp_group``."""
        if self.tp_group is not None:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x


class LlamaForCausalLM(nn.Module):
    """Paged Llama causal LM.

    Parameters are allocated uninitialised (fill them with ``load_state_dict`` or
    :func:`zos.serving.models.weights.random_llama`). Buffers ``rope_cos`` / ``rope_sin`` float32
    ``[max_position_embeddings, head_dim]`` are precomputed at init.

    ``kernels`` (also an attribute, settable): "triton", "torch" or None (default): the kernels
    of each forward are chosen by the device of its inputs, Triton on CUDA, plain torch on a CPU
    (:func:`model_ops`). "triton" on a CPU runs the model's kernels in Triton's interpreter (for
    tests: slow); "torch" reads device values on the host, so it is not CUDA-graph capturable.
    ValueError for another value.
    """

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32, device=None,
                 kernels: str | None = None):
        super().__init__()
        if kernels not in (None, *KERNELS):
            raise ValueError(f"kernels: expected one of {list(KERNELS)} or None, got "
                             f"{kernels!r}")
        self.kernels = kernels
        c = self.config = config
        if c.num_attention_heads % c.num_key_value_heads or c.head_dim % 2:
            raise ValueError("LlamaForCausalLM: num_attention_heads must be a multiple of "
                             "num_key_value_heads and head_dim even")
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype,
                                                     device=device))
        self.layers = nn.ModuleList(LlamaLayer(c, dtype, device)
                                    for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = (None if c.tie_word_embeddings
                        else _linear(c.vocab_size, c.hidden_size, dtype, device))
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64,
                                                         device=device).float() / c.head_dim))
        pos = torch.arange(c.max_position_embeddings, device=device).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: StepMetadata,
                is_prefill: bool) -> torch.Tensor:
        """Run the decoder over T token rows.

        Args:
            input_ids: int32/int64 ``[T]`` token ids (dummy rows: any valid id).
            positions: int32/int64 ``[T]`` positions in ``[0, max_position_embeddings)``.
            kv_caches: one ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]`` cache per
                layer, model dtype; this step's K/V are written in place at ``meta.slot_mapping``.
            meta: :class:`StepMetadata` for this step.
            is_prefill: True: eager :func:`prefill_attention` (needs the host lists); False:
                uniform-decode attention of the model's kernels (capturable with "triton").

        Returns:
            Final-normed hidden states ``[T, hidden_size]`` in the model dtype.

        Raises:
            ValueError: wrong number of caches or mismatched row counts (plus the attention
            and fused-kernel launchers' errors).
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"forward: kv_caches has {len(kv_caches)} layers, model "
                             f"{len(self.layers)}")
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"forward: input_ids and positions must both be [T], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        x = F.embedding(input_ids, self.embed_tokens)
        ops = model_ops(self.kernels, x.device)
        dtype = x.dtype
        cos = self.rope_cos.index_select(0, positions).to(dtype)
        sin = self.rope_sin.index_select(0, positions).to(dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, cache, meta, is_prefill, ops)
        if residual is None:  # no layers
            return self.norm(x, ops=ops)
        return self.norm(x, residual, ops=ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden_size]`` (model dtype) -> float32 logits ``[T, vocab_size]``."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, w).float()
