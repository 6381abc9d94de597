"""zos inside Hugging Face transformers' continuous batching (``generate_batch``,
``ContinuousBatchingManager``), transformers 5.17.0 only (``pip install -e ".[hf]"``).

Plug-in point. transformers 5.17 builds every step's inputs in one method,
``ContinuousBatchingIOs.prepare_batch_tensors`` (continuous_batching/input_outputs.py): a Python
loop over the scheduled requests, then one ``torch.tensor`` + copy per field (input ids,
positions, cumulative lengths, logits indices, read/write indices into the paged cache, and for
sdpa a 4-D mask). The model reads them through ``get_model_kwargs``; the paged attention function
(``AttentionInterface``, key ``"paged|sdpa"`` etc.) reads the cache from the ``cache`` kwarg. So
zos replaces that one object: :func:`enable_zos` wraps ``ContinuousBatchingManager.
_create_batch_processor`` so that the batch processor of a zos-enabled model gets a
:class:`ZosIOs` (a ``ContinuousBatchingIOs`` subclass) in place of its IOs, and registers
``"paged|zos"`` in ``AttentionInterface``. Nothing else of transformers changes: its scheduler,
block manager, preemption (offloading), sampler, logits processors and output handling run as
they do. The batch order is transformers' (row i of a step is ``requests_in_batch[i]``).

Per step, :class:`ZosIOs.prepare_batch_tensors` decides the path:

* decode-only (every request has one query token and samples; the request's position fits the
  block table; N <= max_requests_per_batch): zos. A :class:`~zos.step.DecodeStep` is built from
  what changed (a request that was in the previous zos step at the previous position is carried:
  two record words plus an appended block id when it crosses a block; any other request is a new
  row with its token, position and block list), staged by :class:`~zos.DeviceMetadataBackend`
  (C++ remap, validation, one H2D copy) and built in zos's static buffers by the prep kernels.
  The previous step's sampled tokens are copied on the device from transformers' ``output_ids``
  into ``buffers.sampled`` first (N int32, device to device). The model gets the buffers' views;
  attention (``"paged|zos"``) writes K/V at ``slot_mapping`` and runs zos's paged decode kernel
  (:func:`zos.attention.paged_decode_attention_kv`) on transformers' per-layer key/value tensors,
  viewed as ``[num_blocks + 2, block_size, num_kv_heads, head_dim]`` (no copy), through zos's
  ``block_table`` and ``seq_lens``.
* prefill or mixed: transformers' own ``prepare_batch_tensors`` and ``paged|sdpa`` attention
  (with its 4-D mask, which this class allocates since transformers only does so for its own
  attention names). The next zos step then stages every row as new: 5 record words, 2 row words
  and the row's block ids per request (at N = 256 requests of 2k tokens and blocks of 256 tokens,
  256 x (7 + 8) x 4 = 15 KB, against 2 words per carried row, 2 KB, in steady decode).

Block ids: transformers hands out blocks 0 .. num_blocks - 1 and keeps two blocks past them
(``cache.read_trash_index``: a zeroed block never written; ``write_trash_index``: written by
padding, never read). zos's buffers use :meth:`zos.PaddingProfile.transformers`: the null block
is the read-trash block and the pad slot the write-trash slot, so ids map one to one and no block
transformers hands out is reserved (the packer accepts block 0 under that profile).

Limits (each a clear error when zos is enabled or the batch processor is created): transformers
5.17.0 only; the model's attention must be ``sdpa`` / ``paged|sdpa`` (or already ``paged|zos``)
with full attention in every layer (no sliding window); synchronous batching (no
``use_async_batching``), no transformers CUDA graphs or torch.compile (``use_cuda_graph=False``);
no beam search / ``num_return_sequences`` > 1 forks are special-cased (forked requests are new
rows to zos).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from zos.attention import paged_decode_attention_kv
from zos.buckets import POLICIES
from zos.buffers import DecodeBuffers, PaddingProfile, StepMetadata
from zos.device_backend import DeviceMetadataBackend
from zos.step import DecodeStep

SUPPORTED_TRANSFORMERS = "5.17.0"
ATTN_IMPLEMENTATION = "paged|zos"
_ACCEPTED_ATTN = ("sdpa", "paged|sdpa", ATTN_IMPLEMENTATION)


def _transformers():
    """The transformers module, or RuntimeError naming the installed and the supported version."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise RuntimeError(f"zos.integrations.transformers needs transformers=="
                           f"{SUPPORTED_TRANSFORMERS} (pip install -e \".[hf]\")") from e
    if transformers.__version__ != SUPPORTED_TRANSFORMERS:
        raise RuntimeError(f"zos.integrations.transformers supports transformers=="
                           f"{SUPPORTED_TRANSFORMERS} only (its continuous-batching internals "
                           f"change between releases), found {transformers.__version__}")
    return transformers


@dataclass(frozen=True)
class ZosOptions:
    """Options of a zos-enabled model.

    Attributes:
        max_num_blocks_per_req: block-table width W of zos's buffers; a decode batch with a
            request at position >= W * block_size runs transformers' path. None: enough for
            ``config.max_position_embeddings``, capped by the cache's block count.
        timings: if not None, a list to which each step appends ``(path, seconds)``: the host
            time of ``prepare_batch_tensors``, path ``"zos"`` or ``"transformers"``.
        bucket_policy: None (default): a zos step runs N rows, its prep kernels launched from
            Python. A name in ``zos.buckets.POLICIES`` (e.g. ``"vllm"``): steps are padded
            to its buckets (up to max_requests_per_batch) and, on CUDA, the prep kernels of each
            bucket are captured once in a CUDA graph and replayed (the model then runs the
            padded rows too: they write KV to transformers' write-trash slot and read its
            zeroed read-trash block; their sampled tokens are never read).
    """

    max_num_blocks_per_req: int | None = None
    timings: list | None = None
    bucket_policy: str | None = None


def zos_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """The ``"paged|zos"`` attention function (transformers' ``AttentionInterface`` signature).

    With a ``zos_metadata`` kwarg (a decode step built by zos): writes this step's K/V
    (``key``/``value``: ``[1, num_kv_heads, T, head_dim]``) into the layer's cache tensors of
    ``cache`` (a ``PagedAttentionCache``: ``key_cache[j]`` ``[(num_blocks + 2) * block_size,
    num_kv_heads, head_dim]``) at ``slot_mapping`` (int64 [T]; dummy rows: the write-trash
    slot), in place, then returns the paged decode attention of ``query`` (``[1, num_heads, T,
    head_dim]``) over ``block_table`` / ``seq_lens`` as ``([1, T, num_heads, head_dim], None)``.
    Without it (prefill, mixed batches): transformers' ``paged|sdpa`` with its mask.

    Raises:
        ValueError: the layer's group is not the cache's only group (sliding windows).
    """
    md: StepMetadata | None = kwargs.get("zos_metadata")
    if md is None:
        from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward
        return sdpa_attention_paged_forward(module, query, key, value, attention_mask,
                                            dropout=dropout, scaling=scaling, **kwargs)
    cache = kwargs["cache"]
    group, j = cache.layer_index_to_group_indices[module.layer_idx]
    if group != 0:
        raise ValueError(f"paged|zos: layer {module.layer_idx} is in cache group {group}; zos "
                         f"supports one full-attention group")
    kc, vc = cache.key_cache[j], cache.value_cache[j]
    kc.index_copy_(0, md.slot_mapping, key[0].transpose(0, 1))
    vc.index_copy_(0, md.slot_mapping, value[0].transpose(0, 1))
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    scale = float(scaling if scaling is not None else module.scaling)
    out = paged_decode_attention_kv(query[0].transpose(0, 1), kc.view(shape), vc.view(shape),
                                    md.block_table, md.seq_lens, scale)
    return out.unsqueeze(0), None


def _io_base():
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    return ContinuousBatchingIOs


def _make_zos_ios_class():
    """ZosIOs is defined on first use, so that importing this module needs no transformers."""
    base = _io_base()
    from transformers.generation.continuous_batching.requests import TMP_TOKEN_ID

    class ZosIOs(base):
        """``ContinuousBatchingIOs`` whose decode-only batches are prepared by zos (see the module
        docstring). Same constructor arguments as the base, plus ``options`` (ZosOptions).

        Raises:
            ValueError: the cache has more than one layer group (sliding-window layers).
        """

        def __init__(self, *, options: ZosOptions, **kw) -> None:
            super().__init__(**kw)
            cache = self.cache
            if cache.num_groups != 1 or cache.num_sliding_attention_groups:
                raise ValueError(f"zos supports models whose layers all use full attention (one "
                                 f"cache group), got {cache.num_groups} groups")
            bs = cache.block_size
            w = options.max_num_blocks_per_req
            if w is None:
                max_pos = getattr(self.config, "max_position_embeddings", None) or cache.num_pages
                w = min(-(-max_pos // bs), cache.num_blocks)
            self.zos_options = options
            self.zos_buffers = DecodeBuffers(
                self.max_requests_per_batch, w, bs, device=self.device,
                padding=PaddingProfile.transformers(cache.num_blocks, bs))
            cuda = self.device.type == "cuda"
            buckets = None
            if options.bucket_policy is not None:
                # Every policy's largest size counts requests at q = 1: its own maximum keyword,
                # then max_requests_per_batch itself a bucket (as the engine's make_buckets).
                buckets = POLICIES[options.bucket_policy].build(
                    self.max_requests_per_batch).with_max(self.max_requests_per_batch)
            self.zos_backend = DeviceMetadataBackend(
                self.zos_buffers, num_kv_blocks=cache.num_blocks,
                vocab_size=self.config.vocab_size, buckets=buckets,
                capture_prep=cuda and buckets is not None,
                stream=self.compute_stream if cuda else None)
            self._zos_rows = torch.arange(self.max_requests_per_batch, dtype=torch.int32,
                                          device=self.device)
            self._zos_reset_rows()

        def _setup_static_tensors(self, logit_processor) -> None:
            super()._setup_static_tensors(logit_processor)
            if self.attention_mask is None:  # transformers allocates it for its own names only
                n = self.cache.max_batch_tokens
                shape = (1, 1, n, self.cache.num_blocks * self.cache.block_size + n)
                self.attention_mask = {t: torch.empty(shape, dtype=self.model_dtype,
                                                      device=self.device)
                                       for t in self.cumulative_seqlens_k}

        def _zos_reset_rows(self) -> None:
            self._zos_md: StepMetadata | None = None
            self._zos_prev: dict = {}  # request id -> (state, position, zos id, blocks, last)
            self._zos_prev_n = 0
            self._zos_next_id = 0
            self.zos_backend.packer.reset()

        def reset(self) -> None:
            super().reset()
            self._zos_reset_rows()

        def _zos_step(self, requests):
            """The DecodeStep of a decode-only batch and its rows' record, or None (then the
            batch is not decode-only, or does not fit zos's buffers: transformers' path).

            One pass over the requests, no per-row validation here (the packer validates the
            whole step in C++ before anything is written), arrays built once per field."""
            n = len(requests)
            if n == 0 or n > self.zos_buffers.max_num_reqs:
                return None
            bs = self.cache.block_size
            max_pos = self.zos_buffers.max_num_blocks_per_req * bs
            tables = self.cache.group_cache_managers[0].block_table
            prev_get = self._zos_prev.get
            ids, rows = [], {}
            new_rows, new_tokens, new_positions, indptr, flat = [], [], [], [0], []
            app_rows, app_blocks = [], []
            next_id = self._zos_next_id
            for i, fs in enumerate(requests):
                st = fs.state
                rid, pos = st.request_id, st.position_offset
                blocks = tables.get(rid)
                need = pos // bs + 1
                if (fs.query_length != 1 or not fs.has_new_token or pos >= max_pos
                        or blocks is None or len(blocks) < need):
                    return None
                prev = prev_get(rid)
                if (prev is not None and prev[0] is st and prev[1] == pos - 1
                        and blocks[prev[3] - 1] == prev[4]):
                    zid = prev[2]
                    for c in range(prev[3], need):  # a block crossed since the last step
                        app_rows.append(i)
                        app_blocks.append(blocks[c])
                else:
                    zid = next_id
                    next_id += 1
                    new_rows.append(i)
                    new_tokens.append(st.tokens_to_process[0])
                    new_positions.append(pos)
                    flat.extend(blocks[:need])
                    indptr.append(len(flat))
                ids.append(zid)
                rows[rid] = (st, pos, zid, need, blocks[need - 1])
            self._zos_next_id = next_id
            i32 = np.int32
            step = DecodeStep(np.array(ids, np.int64), np.array(new_rows, i32),
                              np.array(new_tokens, i32), np.array(new_positions, i32),
                              np.array(indptr, i32), np.array(flat, i32),
                              np.array(app_rows, i32), np.array(app_blocks, i32))
            return step, rows

        def prepare_batch_tensors(self, requests_in_batch, logits_processors,
                                  use_decode_fast_path, num_q_tokens, max_kv_read,
                                  use_padding) -> None:
            """transformers' method, with decode-only batches prepared by zos (module docstring).
            Same arguments; raises ValueError for an empty batch (as transformers does) and the
            packer's ValueError if a step is inconsistent (nothing is then written)."""
            t0 = time.perf_counter()
            built = None if use_padding else self._zos_step(requests_in_batch)
            if built is None:
                self._zos_md, self._zos_prev, self._zos_prev_n = None, {}, 0
                super().prepare_batch_tensors(requests_in_batch, logits_processors,
                                              use_decode_fast_path, num_q_tokens, max_kv_read,
                                              use_padding)
                path = "transformers"
            else:
                self._zos_prepare(requests_in_batch, logits_processors, *built)
                path = "zos"
            if self.zos_options.timings is not None:
                self.zos_options.timings.append((path, time.perf_counter() - t0))

        def _zos_prepare(self, requests, logits_processors, step, rows) -> None:
            n, prev_n = len(requests), self._zos_prev_n
            stream = self.compute_stream
            ctx = torch.cuda.stream(stream) if stream is not None else _null()
            with ctx:
                if prev_n:  # carried rows read the token sampled for them last step
                    self.zos_buffers.sampled[:prev_n].copy_(self.output_ids[0, :prev_n])
                plan = self.zos_backend.stage(step)
                self.zos_backend.build(plan.padded_size)
            self._zos_md = self.zos_backend.metadata(plan)
            self._zos_prev, self._zos_prev_n = rows, n
            # transformers' bookkeeping of a prepared batch (what its loop does per request).
            # num_q_tokens / max_kv_read keep the last transformers step's values: its next
            # step resets (``_reset_static_tensors``) the region of its own tensors and mask
            # that step wrote, which zos steps never touch.
            self.num_request_in_batch = n
            self.requests_in_batch = list(requests)
            positions = self.req_id_to_new_token_position = {}
            for i, fs in enumerate(requests):
                st = fs.state
                st.position_offset += 1
                st.tokens_to_process = [TMP_TOKEN_ID]
                positions[st.request_id] = i
            if logits_processors.tensors_required:
                logits_processors.prepare_tensor_args(
                    requests_in_batch=requests,
                    arg_storage=self._bulk_input_tensor[self.static_inputs:])

        def get_model_kwargs(self, use_padding: bool = False):
            md = self._zos_md
            if md is None:
                return super().get_model_kwargs(use_padding=use_padding)
            n = md.padded_size  # the model runs the padded rows; transformers reads num_reqs
            return dict(input_ids=md.input_ids.unsqueeze(0),
                        position_ids=md.positions.unsqueeze(0),
                        cu_seq_lens_q=md.query_start_loc, cu_seq_lens_k=md.query_start_loc,
                        max_seqlen_q=1, max_seqlen_k=1, logits_indices=self._zos_rows[:n],
                        logits_processor_args=self._bulk_input_tensor[self.static_inputs:, :n],
                        attention_mask=None, read_index=[], write_index=[], cache=self.cache,
                        block_table=None, use_cache=False, zos_metadata=md)

    return ZosIOs


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_ZOS_IOS = None


def zos_ios_class():
    """The :class:`ZosIOs` class (built once, on first use; needs transformers 5.17.0)."""
    global _ZOS_IOS
    if _ZOS_IOS is None:
        _transformers()
        _ZOS_IOS = _make_zos_ios_class()
    return _ZOS_IOS


def _install_manager_hook() -> None:
    """Wrap ``ContinuousBatchingManager._create_batch_processor`` once: the batch processor of a
    model with ``_zos_options`` gets a ZosIOs (others are untouched)."""
    from transformers.generation.continuous_batching import continuous_api as api
    manager = api.ContinuousBatchingManager
    if getattr(manager._create_batch_processor, "_zos_hook", False):
        return
    original = manager._create_batch_processor

    def _create_batch_processor(self):
        bp = original(self)
        options = getattr(self.model, "_zos_options", None)
        ios_cls = zos_ios_class()
        if options is None or isinstance(bp.inputs_and_outputs, ios_cls):
            return bp
        if bp.use_async_batching:
            raise ValueError("zos supports synchronous continuous batching only: pass "
                             "ContinuousBatchingConfig(use_async_batching=False)")
        if bp.model_runner.pad_inputs:
            raise ValueError("zos prepares decode metadata in its own static buffers: pass "
                             "ContinuousBatchingConfig(use_cuda_graph=False) and no compile "
                             "configs")
        ios = ios_cls(cache=bp.cache, config=bp.config, continuous_batching_config=bp.cb_config,
                      device=bp.model_device, model_dtype=bp.model_dtype,
                      logit_processor=bp.logit_processor, options=options)
        bp.inputs_and_outputs = ios
        bp.model_runner.inputs_and_outputs = ios
        if hasattr(bp.offloading_manager, "compute_stream"):
            bp.offloading_manager.compute_stream = ios.compute_stream
        return bp

    _create_batch_processor._zos_hook = True
    manager._create_batch_processor = _create_batch_processor


def _triton_interpreted() -> bool:
    """Whether triton.language's own jit functions run in the interpreter (set at its import)."""
    import triton.language as tl
    return type(tl.standard.max).__name__ == "InterpretedFunction"


def enable_zos(model, options: ZosOptions | None = None) -> None:
    """Make ``model.generate_batch`` / its ``ContinuousBatchingManager`` prepare decode-only
    batches with zos, and decode through zos's paged attention (``"paged|zos"``).

    Call before the manager is created (a manager cached with ``persistent_manager=True``
    keeps its IOs: destroy it first). :func:`disable_zos` undoes it.

    Args:
        model: a transformers ``PreTrainedModel`` with continuous batching (``generate_batch``)
            whose attention is ``"sdpa"`` or ``"paged|sdpa"``.
        options: :class:`ZosOptions` (defaults when None).

    Raises:
        RuntimeError: transformers is not 5.17.0; or, on a CPU, triton was imported before zos
            (its interpreter is then off).
        ValueError: another attention implementation, sliding-window / mixed layer types, or an
            unknown ``options.bucket_policy``.
        TypeError: options is not a ZosOptions.
    """
    tf = _transformers()
    options = ZosOptions() if options is None else options
    if not isinstance(options, ZosOptions):
        raise TypeError(f"options must be a ZosOptions, got {type(options).__name__}")
    if options.bucket_policy is not None and options.bucket_policy not in POLICIES:
        raise ValueError(f"options.bucket_policy must be None or one of {list(POLICIES)}, got "
                         f"{options.bucket_policy!r}")
    impl = model.config._attn_implementation
    if impl not in _ACCEPTED_ATTN:
        raise ValueError(f"zos supports attn_implementation in {_ACCEPTED_ATTN} (prefill runs "
                         f"transformers' paged|sdpa), got {impl!r}")
    text = model.config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    if getattr(text, "sliding_window", None) is not None or any(
            t != "full_attention" for t in layer_types):
        raise ValueError("zos supports full attention in every layer; this model has "
                         "sliding-window layers")
    if model.device.type == "cpu" and not _triton_interpreted():
        raise RuntimeError("a model on the CPU needs Triton's interpreter for zos's kernels, "
                           "chosen before triton is imported: import zos before transformers "
                           "(its model classes import triton) on a machine without CUDA, or set "
                           "TRITON_INTERPRET=1 in the environment")
    tf.AttentionInterface.register(ATTN_IMPLEMENTATION, zos_paged_attention)
    _install_manager_hook()
    model._zos_options = options
    if getattr(model, "_zos_previous_attn", None) is None:  # a second call keeps the first's
        model._zos_previous_attn = impl if impl != ATTN_IMPLEMENTATION else "sdpa"
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def disable_zos(model) -> None:
    """Undo :func:`enable_zos`: the model's attention goes back to what it was."""
    if getattr(model, "_zos_options", None) is None:
        return
    model.set_attn_implementation(model._zos_previous_attn)
    del model._zos_options, model._zos_previous_attn
