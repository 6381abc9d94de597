"""transformers' IO objects with zos's decode steps: synchronous (:class:`ZosIOs`) and
asynchronous (:class:`ZosAsyncIOs`) batching, with or without transformers' CUDA graphs.

Both subclass transformers' own IO class and change four of its methods for decode-only
batches (:class:`~zos.integrations.hf_rows.ZosDecodeRows` says which):

* ``prepare_batch_tensors``: zos stages the step (its record into zos's staging ring, whose
  slots the prep kernels release through its done word) and does transformers' per-request
  bookkeeping (positions, placeholder tokens, output positions);
* ``get_model_kwargs``: the model reads zos's buffers (zos's attention: ``"paged|zos"``;
  ``"zos"`` in 5.25);
* ``carry_over_tokens``: transformers calls it first inside the function it runs or captures
  (``ModelRunner._forward_process_and_sample``): zos's device work goes there, so with
  transformers' graphs on, prep, model, logits processors and sampling are one replay;
* the graph key: ``("zos", padded size, sampled rows)`` in transformers' graph store
  (``use_block_table`` reads True, so the decode graph setting applies). The logits processors
  and the sampler run the rows transformers' own IOs would sample for the batch (its padded
  size with graphs, N without), so a seeded sampling run draws the same random numbers and
  samples the same tokens as transformers' (``ZosDecodeRows.model_kwargs``) wherever both
  capture the same graphs outside requests (transformers' run captures a varlen graph inside
  a request, with its eager run's draws, whenever the request meets a key its warm-up did not;
  zos's run never does).

Prefill and mixed batches are transformers' own methods; under zos's attention transformers
builds no 4-D mask for them: zos's varlen attention reads its ``cu_seq_lens_*`` and cache
indices instead (:func:`zos.integrations.transformers.zos_paged_attention`). With transformers'
varlen graphs on, ``get_model_kwargs`` passes such a step the whole read-index row and the graph
key is its padded query size alone (:func:`varlen_graphed`): one graph per size, captured in
the warm-up, where transformers' own key also holds the padded past and ``max_seqlen_k`` (up
to hundreds of keys, each captured on first use, inside users' requests).
Classes are built on first use so that importing zos needs no transformers.
"""
from __future__ import annotations

import time

import torch

from zos.integrations.hf_rows import (
    TMP_TOKEN_ID,
    ZosDecodeRows,
    graph_key,
    num_sampled,
    varlen_graph_key,
)

_CLASSES = None


def _bookkeeping(io, requests, logits_processors, sampled: int) -> None:
    """What transformers' ``prepare_batch_tensors`` records per request, for a zos step whose
    row i is ``requests[i]`` and samples at logits index i, on ``io`` (the synchronous IOs, or
    the asynchronous IOs' host side of the current pair). The processors' argument columns of
    the rows sampled past the requests (``len(requests) .. sampled``: transformers' padded
    rows, which read row 0's logits) get the processors' defaults, not what an earlier step
    left there (transformers resets those columns only when its IOs are reset)."""
    io.num_request_in_batch = len(requests)
    io.requests_in_batch = list(requests)
    positions = io.req_id_to_new_token_position = {}
    for i, fs in enumerate(requests):
        st = fs.state
        st.position_offset += 1
        st.tokens_to_process = [TMP_TOKEN_ID]  # sampled by this step
        positions[st.request_id] = i
    if logits_processors.tensors_required:
        args = io._bulk_input_tensor[io.static_inputs:]
        logits_processors.prepare_tensor_args(requests_in_batch=requests, arg_storage=args)
        if sampled > len(requests):
            args[:, len(requests):sampled] = io.logits_processors_defaults


def _build_step(zos, requests, prev_positions):
    """zos's step of this batch, or None: transformers' path runs it, and the next zos step's
    rows are all new (``zos`` None: zos serves no step of this run)."""
    if zos is None:
        return None
    built = zos.build_step(requests, prev_positions)
    if built is None:
        zos.forget()
    return built


def _zos_rows(serves: bool, kw: dict, max_requests: int, stream, *, async_carry: bool):
    """The IOs' :class:`ZosDecodeRows` (None when zos serves no step of the run), from the IO
    constructor's keyword arguments ``kw``."""
    if not serves:
        return None
    return ZosDecodeRows(kw["cache"], kw["config"], max_requests, kw["device"], stream,
                         kw["options"], async_carry=async_carry,
                         graphed=kw["continuous_batching_config"].cuda_graph_booleans[1])


def varlen_graphed(zos, io) -> bool:
    """Whether ``io``'s step (transformers' IOs that the model reads: the synchronous IOs, or the
    asynchronous IOs' device side of the current pair) is a prefill or mixed step that zos's
    varlen attention runs inside transformers' varlen CUDA graph (``zos``: the IOs'
    :class:`ZosDecodeRows`, None when zos serves no step: the model then runs transformers'
    ``paged|sdpa``, whose mask is sized by the read index). Such a step reads the cache: its
    ``max_kv_read`` is > 0 (transformers sets 0 for a block-table step, and with padding, which
    graphs imply, pads any other past to at least one interval)."""
    return zos is not None and io.use_cuda_graph_varlen and io.max_kv_read > 0


def _whole_read_index(io, kwargs):
    """``kwargs`` (transformers' model kwargs of ``io``'s step) with each group's read index the
    whole row of ``io.read_index_storage`` (int64, the most tokens a request reads plus
    ``max_batch_tokens``) instead of its first ``max_kv_read + num_q_tokens`` entries, a size a
    graph would bake in. zos's varlen attention reads entries ``cu_seq_lens_k[s] ..`` of it
    only, all below ``cu_seq_lens_k[-1]``, which transformers wrote for this step."""
    kwargs["read_index"] = [io.read_index_storage[g] for g in range(len(kwargs["read_index"]))]
    return kwargs


def _transformers_step(zos, io, kwargs: dict) -> dict:
    """The model kwargs of a step transformers' methods built (``kwargs``, from ``io``: the IOs
    the model reads) when zos serves the run (``zos`` not None): in the release's form for
    zos's attention (:meth:`~zos.integrations.hf_internals.TF517.to_model`), with the whole
    read-index row when the step runs in a varlen graph (:func:`varlen_graphed`)."""
    if zos is None:
        return kwargs
    kwargs = zos.tfi.to_model(kwargs)
    return _whole_read_index(io, kwargs) if varlen_graphed(zos, io) else kwargs


def _timed(options, path: str, t0: float) -> None:
    if options.timings is not None:
        options.timings.append((path, time.perf_counter() - t0))


def _build():
    from transformers.generation.continuous_batching.input_outputs import (
        ContinuousBatchingAsyncIOs,
        ContinuousBatchingIOs,
    )

    class ZosIOs(ContinuousBatchingIOs):
        """transformers' synchronous IOs with zos's decode steps (module docstring). Same
        arguments as the base, plus ``options`` (``ZosOptions``) and ``serves`` (False: every
        step is transformers' own, e.g. under torch.compile configs, which run the model on
        transformers' ``"paged|sdpa"``).

        Raises:
            ValueError: the cache has more than one layer group (sliding-window layers).
        """

        def __init__(self, *, options, serves: bool = True, **kw) -> None:
            super().__init__(**kw)
            self.zos_options = options
            self.zos = _zos_rows(serves, dict(kw, options=options), self.max_requests_per_batch,
                                 self.compute_stream, async_carry=False)
            self.zos_md = None
            self.zos_sampled = 0  # rows transformers would sample for this step
            self._zos_args = (None, None)  # (transformers' bulk input tensor, its args view)

        def reset(self) -> None:
            super().reset()
            if self.zos is not None:
                self.zos.forget()
            self.zos_md = None

        def prepare_batch_tensors(self, requests_in_batch, logits_processors,
                                  use_decode_fast_path, num_q_tokens, max_kv_read,
                                  use_padding) -> None:
            """transformers' method; decode-only batches are staged by zos. Raises ValueError
            for an empty batch (as transformers does) and the packer's ValueError for an
            inconsistent step (nothing is then written)."""
            t0 = time.perf_counter()
            built = _build_step(self.zos, requests_in_batch, None)
            if built is None:
                self.zos_md = None
                super().prepare_batch_tensors(requests_in_batch, logits_processors,
                                              use_decode_fast_path, num_q_tokens, max_kv_read,
                                              use_padding)
                return _timed(self.zos_options, "transformers", t0)
            self.zos_md = self.zos.stage(built, prev_output_ids=self.output_ids)
            self.zos_sampled = num_sampled(requests_in_batch, num_q_tokens,
                                           self.max_requests_per_batch, use_padding)
            _bookkeeping(self, requests_in_batch, logits_processors, self.zos_sampled)
            self.use_block_table = True  # transformers' runner: the decode graph setting
            _timed(self.zos_options, "zos", t0)

        def carry_over_tokens(self, input_ids, carry_over_ids, prev_output_ids) -> None:
            if self.zos_md is not None:
                self.zos.in_graph(self.zos_md, prev_output_ids)

        def get_model_kwargs(self, use_padding: bool = False):
            md = self.zos_md
            if md is None:
                return _transformers_step(self.zos, self,
                                          super().get_model_kwargs(use_padding=use_padding))
            bulk = self._bulk_input_tensor
            if self._zos_args[0] is not bulk:  # the processors' columns, one view per tensor
                self._zos_args = (bulk, bulk[self.static_inputs:])
            return self.zos.model_kwargs(md, self.cache, self._zos_args[1], self.zos_sampled)

        def _get_graph_key(self):
            if self.zos_md is not None:
                return graph_key(self.zos_md, self.zos_sampled)
            if varlen_graphed(self.zos, self):
                return varlen_graph_key(self.num_q_tokens)
            return super()._get_graph_key()

    class ZosAsyncIOs(ContinuousBatchingAsyncIOs):
        """transformers' asynchronous IOs (two host/device IO pairs, H2D, compute and D2H
        streams) with zos's decode steps. zos keeps one set of buffers for both pairs: zos's prep
        runs on the compute stream, in step order. A zos step transfers no transformers input
        tensor: its record is read in place from zos's mapped staging ring, and only the logits
        processors' per-request arguments (when a processor needs them, into ``zos_args``) and
        the rows of tokens still in flight are copied. Its graph reads and writes no tensor of
        its pair: the previous step's tokens and its own sampled ones are in ``zos_out`` (the
        previous pair's outputs copied there first when the step before was transformers'; the
        step's rows copied to its pair's outputs before transformers' D2H copy), so one graph
        per zos key serves both pairs (``shares_decode_graphs``), captured once. Same arguments
        as the base, plus ``options`` and ``serves`` (as :class:`ZosIOs`).

        Raises:
            ValueError: the cache has more than one layer group (sliding-window layers).
            RuntimeError: no CUDA (transformers' asynchronous batching needs it).
        """

        shares_decode_graphs = True  # one graph per zos key serves both IO pairs

        def __init__(self, *, options, serves: bool = True, **kw) -> None:
            super().__init__(**kw)
            self.zos_options = options
            self.cache = kw["cache"]
            self.zos = _zos_rows(serves, dict(kw, options=options),
                                 self.io_pairs[0].host_io.max_requests_per_batch,
                                 self.compute_stream, async_carry=True)
            self.zos_md = [None, None]  # per IO pair: its step's metadata if a zos step
            self.zos_sampled = [0, 0]  # per IO pair: rows transformers would sample
            dev = self.io_pairs[0].device_io
            # What a zos step's graph reads and writes instead of its pair's tensors, so that
            # one graph serves both pairs: the previous step's sampled tokens, then this one's
            # (read before written, in stream order), and the processors' arguments.
            self.zos_out = torch.zeros_like(dev.output_ids)
            self.zos_args = torch.zeros_like(dev._bulk_input_tensor[dev.static_inputs:])

        def reset(self) -> None:
            super().reset()
            if self.zos is not None:
                self.zos.forget()
            self.zos_md = [None, None]

        def prepare_batch_tensors(self, requests_in_batch, logits_processors,
                                  use_decode_fast_path, num_q_tokens, max_kv_read,
                                  use_padding) -> None:
            """transformers' method; decode-only batches are staged by zos (its rows whose
            token is still in flight take it on the device, as transformers' carry-over)."""
            t0 = time.perf_counter()
            cur = self.current_pair
            prev = self.io_pairs[1 - cur].host_io.req_id_to_new_token_position
            built = _build_step(self.zos, requests_in_batch, prev)
            if built is None:
                self.zos_md[cur] = None
                super().prepare_batch_tensors(requests_in_batch, logits_processors,
                                              use_decode_fast_path, num_q_tokens, max_kv_read,
                                              use_padding)
                return _timed(self.zos_options, "transformers", t0)
            prev_out = self.io_pairs[1 - cur].device_io.output_ids
            self.zos_md[cur] = self.zos.stage(built, prev_output_ids=prev_out)
            host = self.io_pairs[cur].host_io
            self.zos_sampled[cur] = num_sampled(requests_in_batch, num_q_tokens,
                                                host.max_requests_per_batch, use_padding)
            _bookkeeping(host, requests_in_batch, logits_processors, self.zos_sampled[cur])
            with torch.cuda.stream(self.compute_stream):
                if logits_processors.tensors_required:
                    self.zos_args.copy_(host._bulk_input_tensor[host.static_inputs:],
                                        non_blocking=True)
                if self.zos_md[1 - cur] is None:  # the step before was transformers'
                    self.zos_out.copy_(prev_out)
            _timed(self.zos_options, "zos", t0)

        def get_model_kwargs(self, use_padding: bool = False):
            cur = self.current_pair
            md = self.zos_md[cur]
            if md is None:
                return _transformers_step(self.zos, self.io_pairs[cur].device_io,
                                          super().get_model_kwargs(use_padding=use_padding))
            return self.zos.model_kwargs(md, self.cache, self.zos_args, self.zos_sampled[cur])

        def get_cb_kwargs(self):
            """transformers' ``(carry_over_ids, prev_output_ids, output_ids)`` of the step; a
            zos step reads the previous step's tokens from ``zos_out`` and samples into it."""
            carry, prev, out = super().get_cb_kwargs()
            if self.zos_md[self.current_pair] is None:
                return carry, prev, out
            return carry, self.zos_out, self.zos_out

        def retrieve_device_outputs(self) -> None:
            """transformers' method (the copy of the step's outputs to the host, then the
            switch of pair), after a zos step's sampled rows are copied from ``zos_out`` into
            its pair's outputs on the compute stream: what transformers' update and the next
            step's carry-over read there."""
            cur = self.current_pair
            if self.zos_md[cur] is not None:
                n = self.zos_sampled[cur]
                with torch.cuda.stream(self.compute_stream):
                    self.io_pairs[cur].device_io.output_ids[:, :n].copy_(self.zos_out[:, :n])
            super().retrieve_device_outputs()

        def carry_over_tokens(self, input_ids, carry_over_ids, prev_output_ids) -> None:
            md = self.zos_md[self.current_pair]
            if md is None:
                return super().carry_over_tokens(input_ids, carry_over_ids, prev_output_ids)
            self.zos.in_graph(md, prev_output_ids)

        @property
        def use_block_table(self) -> bool:
            if self.zos_md[self.current_pair] is not None:
                return True
            return self.io_pairs[self.current_pair].host_io.use_block_table

        def _zos_graph_key(self):
            """The current pair's step's key in zos's key space, or None (transformers')."""
            md = self.zos_md[self.current_pair]
            if md is not None:
                return graph_key(md, self.zos_sampled[self.current_pair])
            dev = self.io_pairs[self.current_pair].device_io
            return varlen_graph_key(dev.num_q_tokens) if varlen_graphed(self.zos, dev) else None

        def _zos_graphs(self):
            """The graph store of the current step's zos key: the first pair's for a decode
            step (one graph serves both pairs), the current pair's for a varlen step."""
            pair = 0 if self.zos_md[self.current_pair] is not None else self.current_pair
            return self.io_pairs[pair].device_io.graphs

        def get_graph(self):
            key = self._zos_graph_key()
            if key is None:
                return super().get_graph()
            return self._zos_graphs().get_graph(key)

        def set_graph(self, graph) -> None:
            key = self._zos_graph_key()
            if key is None:
                return super().set_graph(graph)
            self._zos_graphs().set_graph(key, graph)

    return ZosIOs, ZosAsyncIOs


def zos_ios_classes():
    """``(ZosIOs, ZosAsyncIOs)``, built once on first use (needs a tested transformers,
    :func:`~zos.integrations.hf_internals.internals`)."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _build()
    return _CLASSES
