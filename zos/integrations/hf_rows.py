"""zos's side of one transformers batch processor: the decode rows it prepares.

:class:`ZosDecodeRows` is what the synchronous and the asynchronous IOs of
:mod:`zos.integrations.hf_ios` share: zos's static buffers and backend, the request -> row
state of the last zos step, and the three calls of a zos decode step inside transformers:

* :meth:`ZosDecodeRows.build_step` (host, in ``prepare_batch_tensors``): the
  :class:`~zos.step.DecodeStep` of a decode-only batch from what changed since the last zos
  step, or None when the batch is not one zos serves (then transformers' own path runs);
* :meth:`ZosDecodeRows.stage` (host): the packer validates and packs it into zos's staging
  ring (mapped host memory the prep kernels read in place; a slot is rewritten once the done
  word the prep kernels write shows its build finished), nothing written if the step is
  refused;
* :meth:`ZosDecodeRows.in_graph` (device, inside the step's CUDA graph when transformers
  captures one): the previous step's sampled tokens into ``buffers.sampled``, the prep
  kernels, the logits row each sampled row reads (``logits_rows``: row 0 past N, as
  transformers pads), and the tokens still in flight for rows new to zos (asynchronous
  batching).

With ``ZosOptions(metadata_backend="host")`` the same steps go through
:class:`~zos.host_backend.HostMetadataBackend` instead (the host-built baseline: rows rebuilt
on the host, every field copied each step), everything else unchanged: zos's attention and
whole-step graphs with host-built metadata, so a benchmark can tell what each part buys.

transformers calls ``carry_over_tokens`` of its IO object first thing inside the function it
captures (``ModelRunner._forward_process_and_sample``); the IOs route it to ``in_graph``, so one
graph replay per bucket runs zos's prep, the model, the logits processors and the sampling.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from zos._C import PinnedUpload
from zos.buckets import POLICIES
from zos.buffers import DecodeBuffers, StepMetadata
from zos.device_backend import DeviceMetadataBackend
from zos.host_backend import HostMetadataBackend
from zos.integrations.hf_internals import internals
from zos.step import DecodeStep

TMP_TOKEN_ID = -1  # transformers' placeholder for a token still being sampled (requests.py)


@dataclass
class BuiltStep:
    """A decode-only batch as zos stages it (host only).

    Attributes:
        step: what changed since the last zos step.
        rows: request id -> (state, position, zos id, block list zos holds for it) of every
            row, the reference of the next step's carry check.
        carry: None, or (row, index of the request's token in the previous batch's output)
            pairs of new rows whose token is still in flight (asynchronous batching only).
    """

    step: DecodeStep
    rows: dict
    carry: list | None


class ZosDecodeRows:
    """zos's buffers, backend and row state inside one transformers batch processor.

    Args:
        cache: transformers' ``PagedAttentionCache`` (one full-attention group), read through
            :func:`~zos.integrations.hf_internals.internals` (block ids scaled to zos's page
            ids where the release interleaves layers' pages).
        config: the model's text config (``vocab_size``, ``max_position_embeddings``).
        max_requests: rows held (transformers' ``max_requests_per_batch``).
        device: the model's device.
        stream: the compute stream (None on a CPU): where the stage's device work goes (the
            device backend's ``stream``, where a stage that waits for its ring slot places its
            fence; the host backend's copies; the carry map's copy).
        options: the model's ``ZosOptions``.
        graphed: whether transformers captures decode steps in CUDA graphs: zos's prep kernels
            then run inside those graphs (``capture_prep`` off); otherwise, on CUDA with a
            bucket policy, zos replays its own prep graph per bucket (device backend only).
        async_carry: asynchronous batching: rows new to zos may carry a token still in flight,
            taken on the device from the previous batch's output.

    Raises:
        ValueError: the cache is not one full-attention group (sliding-window layers).
    """

    def __init__(self, cache, config, max_requests: int, device: torch.device, stream,
                 options, *, graphed: bool, async_carry: bool) -> None:
        tfi = internals()
        why = tfi.unservable(cache)
        if why is not None:
            raise ValueError(why)
        bs = tfi.page_size(cache)
        w = options.max_num_blocks_per_req
        if w is None:
            max_pos = getattr(config, "max_position_embeddings", None) or tfi.max_tokens_read(cache)
            w = min(-(-max_pos // bs), tfi.num_blocks(cache))
        self.cache, self.options, self.tfi = cache, options, tfi
        self.block_size = bs
        self.id_scale = tfi.block_id_scale(cache)
        self.buffers = DecodeBuffers(max_requests, w, bs, device=device,
                                     padding=tfi.padding_profile(cache))
        buckets = None
        if options.bucket_policy is not None:
            # Every policy's largest size counts requests at q = 1: its own maximum keyword,
            # then max_requests itself a bucket (as the engine's make_buckets).
            buckets = POLICIES[options.bucket_policy].build(max_requests).with_max(max_requests)
        cuda = device.type == "cuda"
        kw = dict(num_kv_blocks=tfi.num_kv_blocks(cache), vocab_size=config.vocab_size,
                  buckets=buckets)
        self.host_built = options.metadata_backend == "host"
        self.stream = stream
        if self.host_built:  # carried rows' tokens gathered on the device, from ``sampled``
            self.backend = HostMetadataBackend(self.buffers, input_ids_from_device=True, **kw)
        else:
            self.backend = DeviceMetadataBackend(
                self.buffers, capture_prep=cuda and buckets is not None and not graphed,
                stream=stream, **kw)
        self._row_ids = torch.arange(max_requests, dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(max_requests, dtype=torch.int32, device=device)
        # (id(md), num_sampled) -> (md, args, (input ids, positions) [1, P], logits rows, args)
        self._views: dict = {}
        self.carry = self._carry_upload = None
        if async_carry:  # -1: the row's token came with the record
            self.carry = torch.full((max_requests,), -1, dtype=torch.int32, device=device)
            self._carry_host = [torch.full((max_requests,), -1, dtype=torch.int32,
                                           pin_memory=cuda) for _ in range(2)]
            self._carry_np = [h.numpy() for h in self._carry_host]  # filled by numpy: no GIL drop
            if cuda:  # the map's copy issued natively, the GIL kept (see ``stage``)
                index = device.index if device.index is not None else torch.cuda.current_device()
                self._carry_upload = PinnedUpload(
                    self.carry.data_ptr(), self._carry_host[0].data_ptr(),
                    self._carry_host[1].data_ptr(), 4 * max_requests, index)
                self._stream_handle = (stream or torch.cuda.current_stream(index)).cuda_stream
        self.forget()

    def __del__(self) -> None:
        upload = getattr(self, "_carry_upload", None)
        if upload is not None:
            try:  # no copy may read a pinned carry map once it is freed (teardown: see
                upload.synchronize(teardown=True)  # DeviceMetadataBackend.__del__)
            except RuntimeError:  # at interpreter exit the CUDA context may be gone
                pass

    def forget(self) -> None:
        """No row is carried into the next zos step (after a transformers step, or a reset):
        its rows are all new."""
        self.prev: dict = {}
        self.next_id = 0
        self.backend.reset()

    def build_step(self, requests, prev_positions: dict | None) -> BuiltStep | None:
        """The step of a decode-only batch, or None (not decode-only, a request past the
        block table's width, more requests than rows, or a token in flight that the previous
        batch does not hold): transformers' path then runs that step.

        A request is carried when it is the same request state one position later as in the
        last zos step (plus the blocks it crossed into, appended); if any block column zos holds
        for it changed since, other than by an append (prefix-sharing swaps, swap-in after CPU
        offload: compared by value, every column), it is a rewritten row with the runner's
        list; any other request is a new row (its token, position and block list). One pass
        over the requests; the packer validates the whole step in C++ before anything is
        written.

        Args:
            requests: transformers' ``FutureRequestState`` list, in batch order.
            prev_positions: asynchronous batching: the previous batch's
                ``req_id_to_new_token_position`` (the other IO pair's): its keys are the
                requests that sampled, in the order of their tokens in the output (its values
                are input positions, not output indices); None in synchronous batching (every
                token is known on the host).
        """
        n = len(requests)
        if n == 0 or n > self.buffers.max_num_reqs:
            return None
        bs = self.block_size
        max_pos = self.buffers.max_num_blocks_per_req * bs
        tables = self.tfi.block_tables(self.cache)  # looked up each step: never a stale dict
        prev_get = self.prev.get
        ids, rows, carry = [], {}, []
        new_rows, new_tokens, new_positions, indptr, flat = [], [], [], [0], []
        app_rows, app_blocks = [], []
        rw_rows, rw_indptr, rw_flat = [], [0], []
        next_id = self.next_id
        out_index = None
        for i, fs in enumerate(requests):
            st = fs.state
            rid, pos = st.request_id, st.position_offset
            blocks = tables.get(rid)
            need = pos // bs + 1
            if (fs.query_length != 1 or not fs.has_new_token or pos >= max_pos
                    or blocks is None or len(blocks) < need):
                return None
            prev = prev_get(rid)
            if prev is not None and prev[0] is st and prev[1] == pos - 1:
                zid, held = prev[2], prev[3]  # held: the row's blocks as zos has them
                k = len(held)
                # Every column, by value (a C-level list compare): transformers rewrites a live
                # request's list in place (prefix sharing swaps complete blocks for shared
                # ones, then frees them) or replaces it (swap-in after CPU offload).
                if (blocks if len(blocks) == k else blocks[:k]) == held:
                    if need > k:  # blocks crossed since the last step
                        app_rows.extend([i] * (need - k))
                        app_blocks.extend(blocks[k:need])
                        held = held + blocks[k:need]  # a new list: a refused step keeps prev
                else:  # the runner's list is the truth for this row
                    held = blocks[:need]
                    rw_rows.append(i)
                    rw_flat.extend(held)
                    rw_indptr.append(len(rw_flat))
            else:
                zid = next_id
                next_id += 1
                held = blocks[:need]
                token = st.tokens_to_process[0]
                if prev_positions is not None and rid in prev_positions:
                    # Sampled by the batch in flight. transformers' update of the batch before
                    # it may have overwritten the placeholder with that batch's (stale) token.
                    if out_index is None:  # transformers samples in the order of the dict
                        out_index = {r: k for k, r in enumerate(prev_positions)}
                    carry.append((i, out_index[rid]))
                    token = 0  # a valid id for the packer; the device overwrites it
                elif token == TMP_TOKEN_ID:  # in flight, but from no batch we can read
                    return None
                new_rows.append(i)
                new_tokens.append(token)
                new_positions.append(pos)
                flat.extend(held)
                indptr.append(len(flat))
            ids.append(zid)
            rows[rid] = (st, pos, zid, held)
        self.next_id = next_id
        i32, scale = np.int32, self.id_scale

        def pages(blocks):  # transformers' block ids -> zos's page ids
            return np.array(blocks, i32) * scale if scale != 1 else np.array(blocks, i32)

        step = DecodeStep(np.array(ids, np.int64), np.array(new_rows, i32),
                          np.array(new_tokens, i32), np.array(new_positions, i32),
                          np.array(indptr, i32), pages(flat),
                          np.array(app_rows, i32), pages(app_blocks),
                          np.array(rw_rows, i32), np.array(rw_indptr, i32), pages(rw_flat))
        return BuiltStep(step, rows, carry or None)

    def stage(self, built: BuiltStep, *, prev_output_ids: torch.Tensor | None = None
              ) -> StepMetadata:
        """Validate, pack and upload ``built.step`` on the backend's stream; returns the
        step's metadata views (padded to its bucket). The device work is :meth:`in_graph`.

        ``prev_output_ids``: transformers' output tensor of the previous batch (int32
        ``[rows, max_batch_tokens + 1]``, on the device); only the host backend needs it here
        (the device backend reads it in :meth:`in_graph`). The host backend's stage gathers
        carried rows' tokens from ``buffers.sampled`` and copies every field: it gets
        ``buffers.sampled`` from ``prev_output_ids`` here, and both go on the compute stream
        (after the previous step, which may still read the buffers under asynchronous
        batching, and before this one).

        Raises:
            ValueError, TypeError: the packer refused the step (nothing was written, except,
                with the host backend, ``buffers.sampled``: a copy of the previous output that
                every step rewrites); ValueError: the host backend got no ``prev_output_ids``.
        """
        if self.host_built:
            if prev_output_ids is None:
                raise ValueError("prev_output_ids: the host backend stages from the previous "
                                 "batch's output, got None")
            with self._on_stream():
                self.buffers.sampled.copy_(prev_output_ids[0, :self.buffers.max_num_reqs])
                plan = self.backend.stage(built.step)
        else:
            plan = self.backend.stage(built.step)
        if built.carry is not None:
            # The map is written with numpy and, on CUDA, uploaded by one native call that
            # keeps the GIL (``PinnedUpload``: two pinned buffers in turn, each fenced by an
            # event after its copy, so a buffer is rewritten only once its copy is done). A
            # torch op drops the GIL, which a busy Python thread (the server's output thread)
            # may then keep for up to its switch interval: ~1 ms per step under load.
            upload = self._carry_upload
            turn = upload.acquire() if upload is not None else 0
            host = self._carry_np[turn]
            host.fill(-1)
            rows, srcs = zip(*built.carry)
            host[list(rows)] = srcs
            if upload is not None:
                upload.submit(turn, host.nbytes, self._stream_handle)
            else:  # CPU: a plain copy
                self.carry.copy_(self._carry_host[0])
        self.prev = built.rows
        return self.backend.metadata(plan)

    def _on_stream(self):
        """The compute stream as the current stream (nothing on a CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def in_graph(self, md: StepMetadata, prev_output_ids: torch.Tensor) -> None:
        """The device part of a zos step, on the compute stream (captured with the model when
        transformers captures the step).

        Writes ``buffers.sampled`` (int32 [R]) from ``prev_output_ids[0, :R]`` (transformers'
        int32 ``[rows, max_batch_tokens + 1]`` output of the previous batch: row i of a zos step
        samples at logits index i; the host backend's stage did it already), rebuilds the step's
        metadata in place (prep kernels), writes ``logits_rows`` (int32 [R]: r for rows r < N, 0
        past them; the static logits indices of :meth:`model_kwargs`), then, for rows whose
        token was in flight, ``input_ids[row] = prev_output_ids[0, src]`` and resets those
        entries of the carry map to -1.
        """
        if not self.host_built:  # the host backend's stage did it
            self.buffers.sampled.copy_(prev_output_ids[0, :self.buffers.max_num_reqs])
        self.backend.build(md.padded_size)
        # the logits row each sampled row reads: its own below N, row 0 past it (transformers
        # pads its logits_indices so): no dummy row reaches the processors or the sampler
        torch.mul(self._row_ids, self._row_ids < md.counts[:1], out=self.logits_rows)
        if self.carry is not None:
            carry = self.carry[: md.padded_size]
            taken = prev_output_ids[0, carry.long()]  # -1 reads the static 0 at the end
            md.input_ids.copy_(torch.where(carry >= 0, taken, md.input_ids))
            carry.fill_(-1)

    def model_kwargs(self, md: StepMetadata, cache, logits_processor_args,
                     num_sampled: int) -> dict:
        """The model's keyword arguments for a zos step (transformers' ``PagedAttentionArgs``
        names). The model runs ``md.padded_size`` rows; logits processors and the sampler run
        ``num_sampled`` rows, the count transformers' own IOs would sample for this batch
        (``ContinuousBatchingIOs._get_num_sequences``), rows past N reading row 0's logits as
        transformers' padded rows do (``logits_rows``, written in :meth:`in_graph`): the sampler
        draws random numbers for every element of its ``[num_sampled, vocab]`` probabilities,
        so with the same rows and inputs a seeded run samples the same tokens as transformers'
        (zos's buckets differ from transformers' padded sizes). ``logits_processor_args``:
        transformers' per-request processor arguments, at least ``num_sampled`` columns."""
        hit = self._views.get((id(md), num_sampled))
        if hit is None or hit[0] is not md or hit[1] is not logits_processor_args:
            # views made once (each torch call may drop the GIL); the dict is built fresh
            # each step, as transformers writes into it and into what it holds
            hit = self._views[(id(md), num_sampled)] = (
                md, logits_processor_args, (md.input_ids.unsqueeze(0), md.positions.unsqueeze(0)),
                self.logits_rows[:num_sampled], logits_processor_args[:, :num_sampled])
        return self.tfi.decode_kwargs(md, *hit[2:], cache)


def num_sampled(requests, num_q_tokens: int, max_requests: int, use_padding: bool) -> int:
    """The rows transformers' IOs sample for a decode batch of ``requests``
    (``ContinuousBatchingIOs._get_num_sequences``: with padding, transformers' padded size)."""
    return min(num_q_tokens, max_requests) if use_padding else len(requests)


def graph_key(md: StepMetadata, num_sampled: int) -> tuple:
    """The key of a zos step's graph in transformers' graph store (never one of its own)."""
    return ("zos", md.padded_size, num_sampled)


def varlen_graph_key(num_q_tokens: int) -> tuple:
    """The key of a prefill or mixed step's graph in transformers' graph store when zos's varlen
    attention runs it (never one of transformers' own): its padded query tokens only.
    transformers' own key adds the padded past tokens read and ``max_seqlen_k``, which size its
    mask and key gather; zos's attention reads the whole read-index row in place whatever those
    are (:func:`~zos.integrations.hf_ios.varlen_graphed`), so one graph per padded query size
    serves every step of that size."""
    return ("zos_varlen", num_q_tokens)
