"""Bucket tables: the sizes a CUDA graph is captured for, and rounding an actual size up to one.

Unit: token rows (``N * q`` with ``q = 1 + k`` for k draft tokens), for every policy. A size above
the largest bucket has no bucket: that step runs eagerly. ``POLICIES`` is the one registry of
named policies (vLLM, DeepInfer, SGLang, TensorRT-LLM): the CLI, ``from_policy`` and the engine's
``make_buckets`` all read it.

Draft dimension: with k > 0 draft tokens every policy's default table is *uniform decode*: each
size is a multiple of q, so a bucket of B token rows holds exactly B / q requests of q rows each
(vLLM's "uniform decode" batches, vllm docs/design/cuda_graphs.md) and can be captured by a
runner of ``uniform_decode_query_len`` q. vLLM makes its sizes multiples of q by rounding each up
(``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``, vllm/config/compilation.py: round
up, drop those above the max, ``[q]`` if none is left); zos applies the same rule to DeepInfer's
token-row table (``spec_rounding``), while SGLang and TensorRT-LLM list batch sizes, which are
multiplied by q. A step where some rows carry no drafts still runs in the q-uniform bucket: those
rows get zero-length drafts (docs/ZOS.md, "Buckets").
numpy + stdlib only (no torch) so this can run on the host at start-up.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from zos._checks import check_int

# spec_rounding values of vllm_policy and deepinfer_policy; the first is the default. "none"
# keeps the system's raw sizes, not multiples of q: a table a q-uniform runner refuses, kept to
# show what the rounding changes.
SPEC_ROUNDINGS = ("round_up", "filter", "none")
LLAMACPP_NOTE = (
    "llama.cpp keeps no bucket list: it caches CUDA graphs by graph structure, updates an "
    "instantiated graph in place (cudaGraphExecUpdate) when only kernel parameters changed, "
    "re-captures when the structure changed, and evicts graphs unused for a while; no padding."
)


def _spec_sizes(raw, q: int, mx: int, spec_rounding: str, field: str) -> set[int]:
    """``raw`` sizes made multiples of q by ``spec_rounding`` (one of SPEC_ROUNDINGS), those
    above mx dropped: "round_up" rounds each up to a multiple of q (vLLM's
    ``adjust_cudagraph_sizes_for_spec_decode``), "filter" keeps the multiples, "none" keeps all.
    ValueError naming ``field`` for an unknown rounding."""
    if spec_rounding == "round_up":
        sizes = {-(-s // q) * q for s in raw}
    elif spec_rounding == "filter":
        sizes = {s for s in raw if s % q == 0}
    elif spec_rounding == "none":
        sizes = set(raw)
    else:
        raise ValueError(f"{field}: expected one of {SPEC_ROUNDINGS}, got {spec_rounding!r}")
    return {s for s in sizes if s <= mx}


@dataclass(frozen=True)
class Interval:
    """Sizes ``lo..hi`` (inclusive, in the table's unit) all padded to ``bucket`` (== hi); the worst
    case is ``worst_n`` with waste ``worst_waste = (bucket - worst_n) / bucket``."""

    lo: int
    hi: int
    bucket: int
    worst_n: int
    worst_waste: float


class BucketTable:
    """Validated, increasing capture sizes with O(1) round-up through a lookup array.

    ``sizes``: positive ints, strictly increasing, each divisible by ``alignment`` and, when
    ``uniform_decode`` is true, by ``uniform_decode_query_len`` q (every request contributes
    exactly q token rows; vLLM's name).
    Raises TypeError for a non-int (bool included) and ValueError naming the field otherwise.
    """

    def __init__(self, sizes, *, uniform_decode_query_len: int = 1, alignment: int = 1,
                 uniform_decode: bool = True, name: str = "explicit"):
        q = self._q = check_int("uniform_decode_query_len", uniform_decode_query_len)
        self._alignment = check_int("alignment", alignment)
        sizes = list(sizes)
        if not sizes:
            raise ValueError("sizes: must be non-empty, got []")
        for i, s in enumerate(sizes):
            check_int(f"sizes[{i}]", s)
            if i and s <= sizes[i - 1]:
                raise ValueError(f"sizes[{i}]: must be strictly increasing, got {sizes[i - 1]} "
                                 f"then {s}")
            if s % self._alignment:
                raise ValueError(f"sizes[{i}]: {s} is not divisible by alignment={alignment}")
            if uniform_decode and s % self._q:
                raise ValueError(f"sizes[{i}]: {s} is not divisible by q={q} (uniform decode)")
        self._sizes = tuple(int(s) for s in sizes)
        self.uniform_decode = bool(uniform_decode)
        self.name = name
        arr = np.asarray(self._sizes, dtype=np.int64)
        # _lut[n] = smallest size >= n, for n in 0..max (entry 0 unused).
        self._lut = arr[np.searchsorted(arr, np.arange(arr[-1] + 1), side="left")].astype(np.int32)

    sizes = property(lambda self: self._sizes, doc="Capture sizes, increasing (tuple of int).")
    max_size = property(lambda self: self._sizes[-1], doc="Largest size; above it: no bucket.")
    uniform_decode_query_len = property(lambda self: self._q,
                                        doc="Token rows per request, q = 1 + draft tokens.")
    alignment = property(lambda self: self._alignment, doc="Every size is a multiple of this.")

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self):
        return iter(self._sizes)

    def __contains__(self, n) -> bool:
        return n in self._sizes

    def __repr__(self) -> str:
        return (f"BucketTable(name={self.name!r}, n={len(self)}, max={self.max_size}, "
                f"uniform_decode_query_len={self._q}, alignment={self.alignment}, "
                f"uniform_decode={self.uniform_decode})")

    def padded_size(self, n: int) -> int | None:
        """Smallest size >= n (token rows) in O(1), or None above ``max_size`` (run eagerly).
        TypeError unless n is an int, ValueError unless >= 1 (``check_int``)."""
        n = check_int("n", n)
        return int(self._lut[n]) if n <= self.max_size else None

    def padded_sizes(self, ns) -> np.ndarray:
        """Vectorized ``padded_size``: int64 array, -1 where there is no bucket.
        ValueError for a non-integer array or any value < 1."""
        ns = np.asarray(ns)
        if ns.size and (not np.issubdtype(ns.dtype, np.integer) or ns.min() < 1):
            raise ValueError("ns: expected integers >= 1")
        out = np.full(ns.shape, -1, dtype=np.int64)
        ok = ns <= self.max_size
        out[ok] = self._lut[ns[ok]]
        return out

    def waste(self, n: int) -> float:
        """Padding waste ``(B - n) / B`` for bucket B of n; ValueError above ``max_size``."""
        b = self.padded_size(n)
        if b is None:
            raise ValueError(f"n: {n} is above the largest bucket {self.max_size} (no bucket)")
        return (b - n) / b

    def intervals(self) -> list[Interval]:
        """One Interval per bucket B with previous bucket Bp (0 first): sizes Bp+1..B map to B.
        The worst case is the smallest reachable size above Bp: Bp+1, or Bp+q in uniform decode
        (sizes are then multiples of q); for q == 1 both are Bp+1."""
        step = self.uniform_decode_query_len if self.uniform_decode else 1
        pairs = zip((0,) + self._sizes[:-1], self._sizes)
        return [Interval(p + 1, b, b, p + step, (b - p - step) / b) for p, b in pairs]

    def with_max(self, n: int) -> BucketTable:
        """This table with ``n`` (same unit) as its largest size: sizes above n dropped, n added if
        missing; q, alignment, uniform_decode and name kept (``self`` if n is already the max).
        Used where the largest batch must have a graph whatever the policy (``make_buckets``).
        TypeError/ValueError unless n is an int >= 1 that is a multiple of the alignment and, in
        uniform decode, of q."""
        n = check_int("n", n)
        step = math.lcm(self._alignment, self._q if self.uniform_decode else 1)
        if n % step:
            raise ValueError(f"n: {n} is not a multiple of {step} (alignment={self._alignment}, "
                             f"q={self._q}, uniform_decode={self.uniform_decode})")
        if n == self.max_size:
            return self
        return BucketTable([s for s in self._sizes if s < n] + [n],
                           uniform_decode_query_len=self._q, alignment=self._alignment,
                           uniform_decode=self.uniform_decode, name=self.name)

    def worst_case(self) -> Interval:
        """The Interval with the largest worst-case waste (the first such one on ties)."""
        return max(self.intervals(), key=lambda iv: iv.worst_waste)


def vllm_policy(max_capture_size: int = 512, *, num_draft_tokens: int = 0,
                spec_rounding: str = "round_up", include_max: bool = True) -> BucketTable:
    """vLLM default ``cudagraph_capture_sizes`` (token rows), from vllm/config/vllm.py
    (``VllmConfig._set_cudagraph_sizes``, documented in vllm/config/compilation.py):
    ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``, sizes <= max (51 at 512; vLLM's
    own default max is ``min(max_num_seqs * q * 2, 512)``, q = 1 + num_speculative_tokens).

    With k draft tokens (q = 1 + k) uniform decode needs multiples of q. ``spec_rounding``, one
    of ``SPEC_ROUNDINGS``: ``"round_up"`` (default) rounds each size up to a multiple of q,
    dedupes and drops those above max, as ``CompilationConfig.adjust_cudagraph_sizes_for_spec_
    decode`` (vllm/config/compilation.py) does in vLLM v1 (96, q=3: 3, 6, 9, 18, 24, 33, ...,
    90, 96; vLLM also rounds to the tensor-parallel size under sequence parallelism, not modelled
    here); ``"filter"`` keeps only the sizes already divisible by q (96, q=3: 24, 48, 72, 96);
    ``"none"`` keeps the grid as it is (vLLM before that rounding existed; not uniform decode
    for q > 1, so a q-uniform runner refuses it).

    ``include_max`` (zos; default True): the largest multiple of q <= max is a size too, so a
    full batch of ``max // q`` requests has a graph (42, q=7: 7, 14, 21, 28, 35, 42: 6 requests
    of 7 rows). vLLM itself caps at its grid (``include_max=False``): max 12 gives 1, 2, 4, 8, so
    9 to 12 requests run eagerly; 512 with q=3 stops at 498 (166 requests) where zos adds 510
    (170). With "none" and include_max, max itself is added.
    ValueError for an unknown spec_rounding, or if no size is left (q > max; with "filter" and
    include_max=False, no grid size divisible by q)."""
    mx = check_int("max_capture_size", max_capture_size)
    k = check_int("num_draft_tokens", num_draft_tokens, 0)
    q = 1 + k
    grid = [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, mx + 1, 16)] if s <= mx]
    sizes = _spec_sizes(grid, q, mx, spec_rounding, "spec_rounding")
    top = mx if spec_rounding == "none" else mx // q * q
    sizes |= {top} if include_max and q <= mx else set()
    if not sizes:
        raise ValueError(f"num_draft_tokens: {k} leaves no size <= max_capture_size={mx} that is "
                         f"a multiple of q={q} (spec_rounding={spec_rounding!r}, "
                         f"include_max={include_max})")
    return BucketTable(sorted(sizes), uniform_decode_query_len=q,
                       uniform_decode=spec_rounding != "none" or q == 1, name="vllm")


def deepinfer_policy(max_num_seqs: int = 256, *, nextn: int = 0, interval: int = 8,
                     spec_rounding: str = "round_up") -> BucketTable:
    """DeepInfer capture sizes (token rows), deepinfer/worker/cuda_graph_runner.py:
    ``max = max_num_seqs * (1 + nextn)``, ``interval = min(interval, max)``; powers of two from 1
    while < interval, then ``range(interval, max, interval)``, then ``max`` last (35 sizes for
    256/nextn 0, 195 for 256/nextn 5 with max 1536).

    With nextn > 0 (q = 1 + nextn) DeepInfer's own sizes are not multiples of q (it pads a step
    with dummy token rows that form no whole request). zos runs q-uniform buckets, so
    ``spec_rounding`` (one of ``SPEC_ROUNDINGS``) makes them multiples of q by vLLM's rule
    (see ``vllm_policy``): "round_up" (default) gives 193 sizes at 256/nextn 5 (1, 2 and 4 all
    become 6; 6, 12, 18, 24, 36, 42, 48, 60, ..., 1530, 1536), "filter" keeps DeepInfer's
    multiples of q (64 sizes at 256/5: every 24 rows), "none" keeps DeepInfer's 195 sizes as they
    are (``uniform_decode=False``: a q-uniform runner refuses that table). The max,
    ``max_num_seqs * q``, is always a size. ValueError for an unknown spec_rounding."""
    seqs, nextn = check_int("max_num_seqs", max_num_seqs), check_int("nextn", nextn, 0)
    q = 1 + nextn
    mx = seqs * q
    step = min(check_int("interval", interval), mx)
    raw = [1 << i for i in range(step.bit_length()) if (1 << i) < step]
    raw += list(range(step, mx, step)) + [mx]
    sizes = _spec_sizes(raw, q, mx, spec_rounding, "spec_rounding")
    return BucketTable(sorted(sizes), uniform_decode_query_len=q,
                       uniform_decode=spec_rounding != "none" or q == 1, name="deepinfer")


def sglang_batch_sizes(max_bs: int = 256, *, num_draft_tokens: int = 0, attn_tp_size: int = 1,
                       attn_cp_size: int = 1, max_running_requests: int | None = None
                       ) -> tuple[list[int], int]:
    """SGLang decode capture batch sizes (requests) and their alignment ``mul_base``.

    Default list, python/sglang/srt/server_args.py (``_generate_cuda_graph_batch_sizes``):
    no speculation ``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) +
    range(512, max_bs + 1, 32)``; speculation ``range(1, 9) + range(10, 33, 2) + range(40, 65, 4)
    + range(72, 257, 8) + range(272, max_bs + 1, 16)``; both cut to <= max_bs, max_bs appended if
    missing (as newer ``_generate_decode_cuda_graph_batch_sizes`` does; 36 sizes at 256, 52 at
    512). SGLang picks ``cuda_graph_max_bs`` by GPU memory.
    Filter, python/sglang/srt/model_executor/cuda_graph_runner.py (``get_batch_sizes_to_capture``,
    now runner/base_cuda_graph_runner.py): ``mul_base = attn_tp_size`` (SGLang applies it only
    when DP attention needs a gathered buffer; assumed so whenever attn_tp_size > 1), times
    ``attn_cp_size`` unless already a multiple; the pool (max_running_requests) is rounded up to
    mul_base and added as a size if the list exceeds it; kept: ``bs * width % mul_base == 0``
    and ``bs <= pool``; width = 1 + num_draft_tokens (SGLang's num_tokens_per_bs, i.e.
    speculative_num_draft_tokens, which counts the root token too). Two-batch overlap is not
    modelled. ValueError if no size survives."""
    mx, k = check_int("max_bs", max_bs), check_int("num_draft_tokens", num_draft_tokens, 0)
    tp, cp = check_int("attn_tp_size", attn_tp_size), check_int("attn_cp_size", attn_cp_size)
    if k == 0:
        bs = [1, 2, 4, 8, 12] + [*range(16, 257, 8), *range(272, 512, 16), *range(512, mx + 1, 32)]
    else:
        bs = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
              *range(272, mx + 1, 16)]
    bs = [b for b in bs if b <= mx] + [mx]
    mul_base = tp if tp % cp == 0 else tp * cp
    if max_running_requests is not None:
        pool = -(-check_int("max_running_requests", max_running_requests) // mul_base) * mul_base
        bs = [b for b in bs if b <= pool] + ([pool] if max(bs) > pool else [])
    bs = sorted({b for b in bs if b * (1 + k) % mul_base == 0})
    if not bs:
        raise ValueError(f"attn_tp_size/attn_cp_size: no batch size <= {mx} aligns to {mul_base}")
    return bs, mul_base


def sglang_policy(max_bs: int = 256, **kwargs) -> BucketTable:
    """SGLang table in token rows: ``bs * q`` for each of ``sglang_batch_sizes(max_bs, **kwargs)``
    (q = 1 + num_draft_tokens, alignment = mul_base). See ``sglang_batch_sizes``."""
    bs, mul_base = sglang_batch_sizes(max_bs, **kwargs)
    q = 1 + kwargs.get("num_draft_tokens", 0)
    return BucketTable([b * q for b in bs], uniform_decode_query_len=q, alignment=mul_base,
                       name="sglang")


def trtllm_batch_sizes(max_batch_size: int = 128, *, enable_padding: bool = True) -> list[int]:
    """TensorRT-LLM (PyTorch backend) CUDA-graph batch sizes, in requests, from
    tensorrt_llm/llmapi/llm_args.py (``CudaGraphConfig._generate_cuda_graph_batch_sizes``;
    default max_batch_size 128). enable_padding: ``[1, 2, 4] + range(8, 129, 8)``, then +64 steps
    while <= max (older releases added powers of two from 256 instead); without padding:
    ``range(1, 32) + [32, 64, 128]`` plus powers of two 2**8 .. below 2**ceil(log2 max), and
    graphs only serve exact sizes. Both: cut to <= max, max appended."""
    mx = check_int("max_batch_size", max_batch_size)
    if enable_padding:
        sizes = [1, 2, 4] + list(range(8, 129, 8))
        while sizes[-1] + 64 <= mx:
            sizes.append(sizes[-1] + 64)
    else:
        sizes = list(range(1, 32)) + [32, 64, 128] + [
            2 ** i for i in range(8, math.ceil(math.log2(mx)))]
    sizes = sorted(s for s in sizes if s <= mx)
    if not sizes or sizes[-1] != mx:
        sizes.append(mx)
    return sizes


def trtllm_policy(max_batch_size: int = 128, *, num_draft_tokens: int = 0,
                  enable_padding: bool = True) -> BucketTable:
    """TensorRT-LLM's graphs as a zos table (token rows): ``b * q`` for each batch size b of
    ``trtllm_batch_sizes`` (q = 1 + num_draft_tokens, uniform decode). TensorRT-LLM keys a graph
    by ``(batch_size, draft_len)`` (``trtllm_graph_keys``); key ``(b, k)`` runs b requests of
    1 + k token rows, which is bucket ``b * (1 + k)`` here, so one table per draft length k.
    TRT-LLM's own default is enable_padding=False; zos defaults to True because padding is what a
    table models."""
    k = check_int("num_draft_tokens", num_draft_tokens, 0)
    bs = trtllm_batch_sizes(max_batch_size, enable_padding=enable_padding)
    return BucketTable([b * (1 + k) for b in bs], uniform_decode_query_len=1 + k, name="trtllm")


def trtllm_graph_keys(max_batch_size: int = 128, max_draft_len: int = 0, *,
                      enable_padding: bool = True, one_engine: bool = True,
                      max_concurrency: int | None = None) -> list[tuple[int, int]]:
    """TensorRT-LLM graph keys ``(batch_size, draft_len)``, tensorrt_llm/_torch/pyexecutor/
    model_engine.py (``_get_graphs_to_capture``, static draft length): draft lengths are
    ``[max_draft_len]`` plus ``0`` only when max_draft_len > 0, the speculation mode is two-model
    (``one_engine=False``) and ``spec_config.max_concurrency`` is set (speculation can then be
    switched off at run time). So the count is ``len(sizes) * 1`` or ``* 2``. zos captures key
    ``(b, d)`` as bucket ``b * (1 + d)`` of ``trtllm_policy(num_draft_tokens=d)``; it keeps no
    second, draft-length-0 set: a step whose rows carry no drafts runs in the q-uniform bucket
    with zero-length drafts (docs/ZOS.md). Not modelled: the dynamic ``draft_len_schedule``
    path, tree decoding (keys use max_total_draft_tokens), and extra key parts (short/long
    sequence for sparse attention, LoRA, in-graph sampling tier)."""
    d = check_int("max_draft_len", max_draft_len, 0)
    lens = [d] + ([0] if d > 0 and not one_engine and max_concurrency is not None else [])
    bs = trtllm_batch_sizes(max_batch_size, enable_padding=enable_padding)
    return [(b, x) for b in bs for x in lens]


@dataclass(frozen=True)
class Policy:
    """One named bucket policy of the registry ``POLICIES``.

    ``builder(**{max_keyword: value, draft_keyword: k}, **options)`` builds its table, whose sizes
    are in ``unit`` ("token rows", N * q, for every policy). ``max_keyword`` is the builder's
    largest-size argument, counted in ``max_unit`` (vLLM's max_capture_size counts token rows;
    DeepInfer's max_num_seqs, SGLang's max_bs and TensorRT-LLM's max_batch_size count requests),
    default ``default_max``. ``draft_keyword`` is the builder's draft-token argument (k; the
    default table of every policy is uniform decode with q = 1 + k). ``options``: the builder's
    other keywords, which a front end may forward. Where each rule comes from: the builder's
    docstring.
    """

    name: str
    builder: Callable[..., BucketTable]
    max_keyword: str
    max_unit: str
    unit: str
    default_max: int
    draft_keyword: str = "num_draft_tokens"
    options: tuple[str, ...] = ()

    def build(self, max_value: int | None = None, *, num_draft_tokens: int = 0,
              **options) -> BucketTable:
        """The table for largest size ``max_value`` (in ``max_unit``; None: ``default_max``) and
        k = ``num_draft_tokens``, ``options`` forwarded to the builder. The builder's errors."""
        kwargs = {self.max_keyword: self.default_max if max_value is None else max_value,
                  self.draft_keyword: num_draft_tokens}
        return self.builder(**kwargs, **options)

    def largest_size(self, max_value: int, q: int = 1) -> int:
        """Upper bound of the largest size (in ``unit``) of a table built for ``max_value`` and
        q token rows per request: ``max_value * q`` when max_keyword counts requests and the
        table token rows, else ``max_value``."""
        per_request = (self.max_unit, self.unit) == ("requests", "token rows")
        return max_value * q if per_request else max_value


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("vllm", vllm_policy, "max_capture_size", "token rows", "token rows", 512,
           options=("spec_rounding", "include_max")),
    Policy("deepinfer", deepinfer_policy, "max_num_seqs", "requests", "token rows", 256,
           draft_keyword="nextn", options=("interval", "spec_rounding")),
    Policy("sglang", sglang_policy, "max_bs", "requests", "token rows", 256,
           options=("attn_tp_size", "attn_cp_size", "max_running_requests")),
    Policy("trtllm", trtllm_policy, "max_batch_size", "requests", "token rows", 128,
           options=("enable_padding",)),
)}


def from_policy(name: str, **kwargs) -> BucketTable:
    """Build the table of policy ``name``: a key of ``POLICIES`` (kwargs go to its builder, e.g.
    ``from_policy("vllm", max_capture_size=256)``), or "explicit" (kwargs go to ``BucketTable``,
    e.g. ``sizes=[1, 2, 4]``). ValueError for an unknown name."""
    if name == "explicit":
        return BucketTable(**kwargs)
    if name not in POLICIES:
        raise ValueError(f"name: unknown policy {name!r}; expected one of "
                         f"{[*POLICIES, 'explicit']}")
    return POLICIES[name].builder(**kwargs)
