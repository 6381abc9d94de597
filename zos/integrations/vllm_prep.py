"""zos as the decode-step input preparation of one vLLM 0.26 model runner v2 (the device half).

:class:`ZosVllmPrep` belongs to one ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` after
its KV cache is initialised. For every scheduler output it updates zos's mirror
(:class:`~zos.integrations.vllm_steps.VllmDecodeSteps`); for a pure-decode step it replaces what
runner v2's ``prepare_inputs`` and ``prepare_attn`` do on the device (the ``idx_mapping`` and
``query_start_loc`` uploads and the four kernels ``prepare_pos_seq_lens``,
``combine_sampled_and_draft_tokens``, ``gather_block_tables``, ``compute_slot_mappings``) by
zos's staged record, zos's prep and the kernel of
:func:`~zos.integrations.vllm_buffers.write_vllm_decode_inputs` into runner v2's own persistent
tensors (on CUDA captured together, the write as the build's epilogue, in zos's
prep graph of each padded size: one native call stages the record and launches both), and
builds the ``InputBatch`` runner v2 would build (its host fields from vLLM's own
request state, so attention metadata, sampling and output handling stay vLLM's). Prefill and
mixed steps are vLLM's.

zos writes the buffers before vLLM builds the attention metadata and replays its graph, not
inside vLLM's full CUDA graph: FlashAttention-3's builder reads ``seq_lens`` on the device
(``get_scheduler_metadata``, ``vllm/v1/attention/backends/flash_attn.py``) before the replay.

Shadow mode (``shadow=True``): each zos step first runs vLLM's own ``prepare_inputs`` and
``prepare_attn``, keeps a copy of what they wrote, then runs zos's, and compares every field
byte for byte (:meth:`ZosVllmPrep.compare`); ``stats`` counts steps and mismatches.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from zos._C import vllm_batch_arrays
from zos.buckets import BucketTable
from zos.buffers import DecodeBuffers
from zos.device_backend import DeviceMetadataBackend
from zos.integrations.vllm_buffers import VllmDecodeInputs, launch_unchecked
from zos.integrations.vllm_steps import VllmDecodeSteps, VllmStep


def unsupported(runner) -> str | None:
    """Why zos cannot prepare this runner's decode steps (None: it can). Read after
    ``initialize_kv_cache``; each reason names the vLLM setting."""
    groups = runner.kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    from vllm.envs import VLLM_MOE_SKIP_PADDING
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    reasons = {
        "more than one KV-cache group (hybrid or sliding-window model)": len(groups) != 1,
        "a KV-cache group that is not full attention": (
            spec is not None and (type(spec) is not FullAttentionSpec
                                  or getattr(spec, "sliding_window", None) is not None)),
        "kernel block size != KV block size": (
            spec is not None and runner.kernel_block_sizes[0] != spec.block_size),
        "speculative decoding": runner.speculative_config is not None,
        "pipeline parallelism": runner.use_pp,
        "decode context parallelism": runner.use_dcp,
        "prefill context parallelism": runner.pcp_manager is not None,
        "restricted sliding-window attention (rswa_window)":
            runner.model_config.rswa_window is not None,
        "VLLM_MOE_SKIP_PADDING": bool(VLLM_MOE_SKIP_PADDING),
        "an encoder-decoder model": runner.is_encoder_decoder,
        "more than one token per decode row (decode_query_len)": runner.decode_query_len != 1,
        # vLLM frees the KV-cache pool zos's tensors live in when it sleeps
        "sleep mode": runner.model_config.enable_sleep_mode,
    }
    found = [name for name, hit in reasons.items() if hit]
    return ", ".join(found) or None


class ZosVllmPrep:
    """zos's decode prep bound to one runner v2 (see the module docstring).

    Args:
        runner: a ``GPUModelRunner`` (vLLM 0.26, ``vllm/v1/worker/gpu/model_runner.py``) whose
            ``initialize_kv_cache`` has run and for which :func:`unsupported` is None.
        shadow: compare every zos step with vLLM's own preparation of it.

    Attributes:
        stats: ``zos_steps``, ``vllm_steps`` (steps vLLM prepared), ``shadow_steps``,
            ``mismatches`` (fields that differed, summed over steps), ``first_mismatch`` (a
            description or None), ``prep_s`` (host seconds in zos's ``prepare_inputs``),
            ``phase_s`` (two parts of it: ``batch_arrays``, the InputBatch's host arrays and
            the new rows' request indices, one native call; ``prepare``, zos's stage, build
            and write, on CUDA one native call; the rest makes runner v2's ``InputBatch``),
            ``rewrites`` (steps vLLM padded to another size than zos's bucket: the write
            launched a second time).
    """

    def __init__(self, runner, *, shadow: bool = False) -> None:
        self.runner, self.shadow = runner, shadow
        bt = runner.block_tables
        self.block_size = runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.max_reqs = runner.max_num_reqs
        width = bt.input_block_tables[0].shape[1]
        self.steps = VllmDecodeSteps(block_size=self.block_size, max_num_reqs=self.max_reqs,
                                     max_num_blocks_per_req=width)
        dev = runner.device
        capture = [s for s in runner.compilation_config.cudagraph_capture_sizes or ()
                   if s <= self.max_reqs]
        buckets = BucketTable(sorted(set(capture) | {self.max_reqs}), name="vllm")
        self.buffers = DecodeBuffers(self.max_reqs, width, self.block_size, device=dev)
        ib = runner.input_buffers
        self.out = VllmDecodeInputs(ib.input_ids, ib.positions, ib.query_start_loc, ib.seq_lens,
                                    bt.input_block_tables[0], bt.slot_mappings[0])
        # checked once here (write_vllm_decode_inputs's checks): every step launches the
        # kernel over the same tensors, zos's views of one padded size or another
        self._max_tokens = self.out.check()[1]
        self._meta = self.buffers.views(0, self.max_reqs)
        # persistent tensors the InputBatch of a decode step views (never written by vLLM)
        self.idx_mapping = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        cuda = dev.type == "cuda"
        # the write is the epilogue of every zos build: on CUDA inside zos's prep graph of
        # each padded size, so a step's stage, build and write are one native call
        # idx_mapping is zos row state: a new row is staged with its request index as its
        # token, the write copies every row's index into idx_mapping and into zos's sampled
        # tokens (a carried row's next token), so no step uploads it
        meta, carry, idx, sampled, out = (self._meta, self.buffers.sampled, self.idx_mapping,
                                          runner.req_states.last_sampled_tokens, self.out)
        max_reqs, max_tokens = self.max_reqs, self._max_tokens

        def write(padded: int) -> None:
            """The step zos built last into vLLM's tensors, padded to ``padded`` rows
            (``write_vllm_decode_inputs``'s kernel, its checks made above). No reference to
            ``self``: the backend holds it, and a cycle would leave the backend's release to
            the garbage collector."""
            launch_unchecked(meta, carry, idx, sampled, out, padded, max_reqs, max_tokens)
        self._write = write
        # vocab_size: zos's "tokens" are request indices, in [0, max_num_reqs)
        self.backend = DeviceMetadataBackend(
            self.buffers, num_kv_blocks=runner.kv_cache_config.num_blocks,
            vocab_size=self.max_reqs, buckets=buckets, capture_prep=cuda, epilogue=write)
        if not cuda:  # compiled now, not in the first decode step (a CUDA capture did it)
            write(0)
        arange = torch.arange(self.max_reqs + 1, dtype=torch.int32, device=dev)
        arange_i64 = arange.to(torch.int64)
        zeros = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        # the views an InputBatch of n rows padded to p rows and t tokens holds, made once
        rows = range(self.max_reqs + 1)
        self._views_n = [(self.idx_mapping[:n], zeros[:n], arange_i64[:n],
                          arange[:n + 1]) for n in rows]
        self._views_p = [(ib.query_start_loc[:p + 1], ib.seq_lens[:p]) for p in rows]
        self._views_t = {}
        self.pending: VllmStep | None = None
        self.stats = dict(zos_steps=0, vllm_steps=0, shadow_steps=0, mismatches=0,
                          first_mismatch=None, prep_s=0.0, rewrites=0,
                          phase_s=dict(batch_arrays=0.0, prepare=0.0))

    def observe(self, scheduler_output) -> None:
        """Every scheduler output, in order, before the runner reads it: the mirror follows
        it, and a pure-decode step becomes the one :meth:`prepare_inputs` prepares."""
        self.pending = self.steps.step(scheduler_output)

    def finish_step(self) -> None:
        """After ``execute_model``: a zos step that was not prepared (the runner returned
        before ``prepare_inputs``) carries no row into the next one."""
        if self.pending is not None:
            self.steps.forget()
            self.pending = None

    def prepare_inputs(self, scheduler_output, batch_desc, vllm_prepare_inputs,
                       vllm_prepare_attn):
        """runner v2's ``InputBatch`` for this step, or None when it is vLLM's to prepare.
        Writes the step's six fields into the runner's persistent tensors. In shadow mode
        calls vLLM's ``vllm_prepare_inputs(runner, scheduler_output, batch_desc)`` and
        ``vllm_prepare_attn(runner, batch)`` first and compares."""
        vstep, self.pending = self.pending, None
        if vstep is None:
            self.stats["vllm_steps"] += 1
            return None
        ref = None
        if self.shadow:
            ref_batch = vllm_prepare_inputs(self.runner, scheduler_output, batch_desc)
            vllm_prepare_attn(self.runner, ref_batch)
            fields = self._fields(ref_batch.num_reqs, ref_batch.num_reqs_after_padding)
            ref = (ref_batch, *(t.clone() for t in fields))
            for t in fields:  # a word zos fails to write must not keep vLLM's value
                t.fill_(-7)
        t0 = time.perf_counter()
        batch = self._prepare(vstep, scheduler_output, batch_desc)
        self.stats["prep_s"] += time.perf_counter() - t0
        self.stats["zos_steps"] += 1
        if ref is not None:
            self.compare(ref, batch)
        return batch

    def prepare_attn(self, batch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """runner v2's ``prepare_attn`` result for a zos step (what :meth:`prepare_inputs`
        wrote): the block tables of the padded rows and the padded tokens' slot mapping."""
        bt = self.runner.block_tables
        return ((bt.input_block_tables[0][:batch.num_reqs_after_padding],),
                bt.slot_mappings[:, :batch.num_tokens_after_padding])

    def _prepare(self, vstep: VllmStep, so, batch_desc):
        from vllm.v1.worker.gpu.input_batch import InputBatch
        runner, req_ids, step = self.runner, vstep.req_ids, vstep.step
        n = len(req_ids)
        padded = batch_desc.num_reqs or n
        num_tokens_padded = batch_desc.num_tokens
        clock, phase = time.perf_counter, self.stats["phase_s"]
        t0 = clock()
        rs = runner.req_states
        (idx_np, num_computed, upper, prefill_len, computed_prefill, is_prefilling, scheduled,
         query_start_loc_np, cu_num_logits_np) = vllm_batch_arrays(
            req_ids, rs.req_id_to_index, rs.num_computed_tokens_np, rs.prefill_len.np,
            rs.num_computed_prefill_tokens, padded, step.new_rows, step.new_tokens)
        t1 = clock()
        md = self.backend.prepare(step)  # its write pads to zos's padded size
        if md.padded_size != padded:  # vLLM padded otherwise: its padding written again
            self._write(padded)
            self.stats["rewrites"] += 1
        t2 = clock()
        phase["batch_arrays"] += t1 - t0
        phase["prepare"] += t2 - t1
        idx_mapping, zeros, logits_indices, cu_num_logits = self._views_n[n]
        query_start_loc, seq_lens = self._views_p[padded]
        tokens = self._views_t.get(num_tokens_padded)
        if tokens is None:
            ib = runner.input_buffers
            tokens = self._views_t[num_tokens_padded] = tuple(
                t[:num_tokens_padded] for t in (ib.input_ids, ib.positions, ib.is_padding))
        return InputBatch(
            req_ids=req_ids, num_reqs=n, num_reqs_after_padding=padded,
            idx_mapping=idx_mapping, idx_mapping_np=idx_np,
            expanded_idx_mapping=idx_mapping, expanded_local_pos=zeros,
            num_scheduled_tokens=scheduled, num_tokens=n,
            num_tokens_after_padding=num_tokens_padded, num_draft_tokens=0,
            num_draft_tokens_per_req=None,
            query_start_loc=query_start_loc,
            query_start_loc_np=query_start_loc_np,
            seq_lens=seq_lens, seq_lens_cpu_upper_bound=torch.from_numpy(upper),
            dcp_local_seq_lens=None, num_computed_tokens_np=num_computed,
            prefill_len_np=prefill_len, num_computed_prefill_tokens_np=computed_prefill,
            is_prefilling_np=is_prefilling, max_seq_len_np=None,
            input_ids=tokens[0], positions=tokens[1], is_padding=tokens[2],
            logits_indices=logits_indices, cu_num_logits=cu_num_logits,
            cu_num_logits_np=cu_num_logits_np,
            has_structured_output_reqs=so.has_structured_output_requests, prompt_lens=None)

    _FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table",
               "slot_mapping")

    def _fields(self, n: int, padded: int) -> tuple[torch.Tensor, ...]:
        """Views of what a decode step of ``n`` rows padded to ``padded`` writes (``_FIELDS``):
        the real rows' input ids and positions (the padded token rows keep what they held,
        in both), the whole query_start_loc, seq_lens and slot mapping, the padded rows' block
        tables."""
        o = self.out
        return (o.input_ids[:n], o.positions[:n], o.query_start_loc, o.seq_lens,
                o.block_table[:padded], o.slot_mapping)

    def compare(self, ref, batch) -> None:
        """Count the fields of ``batch`` (zos's) that differ from ``ref`` (vLLM's batch and
        the copies of its writes, after which the written words were set to -7): host fields,
        the device tensors of the batch, :meth:`_fields` (a real row's block-table columns up
        to its block count: past them vLLM's gather leaves stale words)."""
        ref_batch, *ref_fields = ref
        n, padded = ref_batch.num_reqs, ref_batch.num_reqs_after_padding
        diffs = [f"{name}: vllm {getattr(ref_batch, name)} zos {getattr(batch, name)}"
                 for name in ("req_ids", "num_reqs", "num_reqs_after_padding", "num_tokens",
                              "num_tokens_after_padding", "num_draft_tokens",
                              "has_structured_output_reqs")
                 if getattr(ref_batch, name) != getattr(batch, name)]
        if diffs:  # the device fields would not line up
            self._mismatch(diffs, n)
            return
        for name in ("idx_mapping_np", "query_start_loc_np", "num_computed_tokens_np",
                     "prefill_len_np", "num_computed_prefill_tokens_np", "cu_num_logits_np",
                     "is_prefilling_np", "num_scheduled_tokens"):
            a, b = getattr(ref_batch, name), getattr(batch, name)
            if a.dtype != b.dtype or not np.array_equal(a, b):
                diffs.append(f"{name}: vllm {a} ({a.dtype}) zos {b} ({b.dtype})")
        for name in ("seq_lens_cpu_upper_bound", "idx_mapping", "expanded_idx_mapping",
                     "expanded_local_pos", "logits_indices", "cu_num_logits"):
            a, b = getattr(ref_batch, name), getattr(batch, name)
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                diffs.append(f"InputBatch.{name}")
        num_blocks = self.runner.block_tables.num_blocks.gpu[0, ref_batch.idx_mapping]
        for name, a, b in zip(self._FIELDS, ref_fields, self._fields(n, padded)):
            if name == "block_table":
                cols = torch.arange(a.shape[1], device=a.device)
                keep = torch.ones_like(a, dtype=torch.bool)
                keep[:n] = cols[None, :] < num_blocks[:, None]
                a, b = torch.where(keep, a, 0), torch.where(keep, b, 0)
            if not torch.equal(a, b):
                bad = (a != b).nonzero()[:4].tolist()
                diffs.append(f"{name} (first differing indices {bad})")
        self.stats["shadow_steps"] += 1
        if diffs:
            self._mismatch(diffs, n)

    def _mismatch(self, diffs: list[str], n: int) -> None:
        self.stats["mismatches"] += len(diffs)
        if self.stats["first_mismatch"] is None:
            self.stats["first_mismatch"] = (f"zos step {self.stats['zos_steps']} ({n} rows): "
                                            + "; ".join(diffs))
