"""Helpers shared by the tests (no fixtures here: those are in conftest.py)."""
from __future__ import annotations

import dataclasses

import torch

from zos import StepMetadata


def attention_meta(slot_mapping, seq_lens, query_start_loc, block_table, *,
                   query_lens_host=None, seq_lens_host=None) -> StepMetadata:
    """A StepMetadata for calling attention directly: input ids and positions are zeros (the
    attention functions do not read them), counts None, padded size = real size."""
    t, r = slot_mapping.numel(), block_table.shape[0]
    zeros = torch.zeros(t, dtype=torch.int32, device=slot_mapping.device)
    return StepMetadata(input_ids=zeros, positions=zeros, slot_mapping=slot_mapping,
                        seq_lens=seq_lens, query_start_loc=query_start_loc,
                        block_table=block_table, counts=None, num_reqs=r, num_tokens=t,
                        padded_size=t, query_lens_host=query_lens_host,
                        seq_lens_host=seq_lens_host)


def to_device(meta: StepMetadata, device) -> StepMetadata:
    """A copy of ``meta`` with every tensor on ``device``."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device)
                                        for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})
