"""Command-line interface: ``zos <subcommand> ...``.

Layout: ``build_parser()`` adds one subparser per subcommand and binds its handler with
``set_defaults(func=_cmd_<name>)``; ``main()`` parses and dispatches. Adding a subcommand is
adding a subparser there and one ``_cmd_<name>(args) -> int`` function here.
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction

POLICIES = ("vllm", "deepinfer", "sglang", "trtllm")


def _int_list(text: str) -> list[int]:
    """Parse ``"1,2,4"`` into ``[1, 2, 4]`` (argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _table(policy: str, args):
    """Build the BucketTable for ``policy`` from the CLI options (None means the policy default)."""
    from zos import buckets as b

    k = args.num_draft_tokens if args.num_draft_tokens is not None else (args.nextn or 0)
    if args.sizes:
        return b.BucketTable(args.sizes, uniform_decode_query_len=1 + k, name="explicit")
    if policy == "vllm":
        return b.vllm_policy(args.max_size or 512, num_draft_tokens=k)
    if policy == "deepinfer":
        return b.deepinfer_policy(args.max_num_seqs or 256, nextn=k)
    if policy == "sglang":
        return b.sglang_policy(args.max_size or 256, num_draft_tokens=k,
                               attn_tp_size=args.attn_tp_size, attn_cp_size=args.attn_cp_size,
                               max_running_requests=args.max_running_requests)
    return b.trtllm_policy(args.max_size or 128)


def _frac(iv) -> str:
    """Worst waste of an Interval as an exact fraction and a percentage."""
    f = Fraction(iv.bucket - iv.worst_n, iv.bucket)
    return f"{f} ({float(f):.1%})"


def _print_table(t, args) -> None:
    """Sizes, count, worst case, and per-interval worst waste grouped by interval width."""
    unit = "requests" if t.name == "trtllm" else "token rows"
    print(f"policy {t.name}: {len(t)} sizes, max {t.max_size} ({unit}, "
          f"q={t.uniform_decode_query_len}, "
          f"alignment={t.alignment}, uniform_decode={t.uniform_decode})")
    print("sizes:", ",".join(map(str, t.sizes)))
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
        from zos.buckets import trtllm_graph_keys

        k = args.num_draft_tokens if args.num_draft_tokens is not None else (args.nextn or 0)
        keys = trtllm_graph_keys(t.max_size, k)
        print(f"graph keys (batch, draft_len): {len(keys)} (draft lengths "
              f"{sorted({d for _, d in keys}, reverse=True)}; one-engine speculation assumed)")


def _cmd_buckets(args) -> int:
    """``zos buckets``: print one policy's table, or with --compare one row per policy."""
    if not args.compare:
        _print_table(_table(args.policy, args), args)
        return 0
    print(f"{'policy':<10} {'count':>5} {'max':>6}  worst waste")
    for p in POLICIES:
        try:
            t = _table(p, argparse.Namespace(**{**vars(args), "sizes": None}))
        except ValueError as e:
            print(f"{p:<10} {'-':>5} {'-':>6}  n/a: {e}")
            continue
        w = t.worst_case()
        print(f"{p:<10} {len(t):>5} {t.max_size:>6}  {_frac(w)} at n={w.worst_n}")
    from zos.buckets import LLAMACPP_NOTE

    print(f"{'llama.cpp':<10} {'-':>5} {'-':>6}  none (no padding): {LLAMACPP_NOTE}")
    return 0


_DEMO_DOC = ("Run one slice of the Azure LLM inference trace 2023 through the engine twice, "
             "with host-built metadata and with zos, check the tokens are identical, and write "
             "report.md/png/json. Size flags default by device: CPU values finish in minutes "
             "on 2 cores (Triton interpreter), CUDA values use graphs.")
DEMO_FLAGS = (
    ("--trace", dict(choices=("conv", "code"), default="conv", help="which trace (default conv)")),
    ("--start", dict(type=int, default=0, help="first request of the slice (default 0)")),
    ("--num-requests", dict(type=int, help="requests in the slice (default: CPU 16, CUDA 256)")),
    ("--scale", dict(type=int, help="integer divisor of prompt and output lengths "
                     "(default 4)")),
    ("--max-prompt", dict(type=int, help="clamp of scaled prompt lengths (default: CPU 32, "
                          "CUDA 1024)")),
    ("--max-output", dict(type=int, help="clamp of scaled output lengths (default: CPU 48, "
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
    ("--out", dict(default="zos-demo-out", help="report directory (default zos-demo-out)")),
    ("--seed", dict(type=int, default=0, help="prompt windows and random weights (default 0)")),
    ("--quiet", dict(action="store_true", help="no progress bars or sample texts")),
    ("--tiny", dict(action="store_true", help=argparse.SUPPRESS)),  # small random Llama, tests
)


def _cmd_demo(args) -> int:
    """``zos demo``: see ``zos.demo``. Exit 1 if the backends' tokens differ."""
    from zos.serving.demo import run_demo

    report = run_demo(args)
    if not report["identical"]:
        print(f"zos demo: FAILED: host and zos generated different tokens: "
              f"{report['mismatch']}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``zos`` argument parser, one subparser per subcommand."""
    parser = argparse.ArgumentParser(prog="zos", description="Device-side decode-step metadata "
                                     "for CUDA-graph LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("buckets", help="show a capture-size (bucket) policy and its padding waste")
    p.add_argument("--policy", choices=POLICIES, default="vllm")
    p.add_argument("--max-size", type=int, help="largest size (vllm: max capture size, tokens; "
                   "sglang: cuda_graph_max_bs; trtllm: max_batch_size; deepinfer: ignored, "
                   "use --max-num-seqs)")
    p.add_argument("--max-num-seqs", type=int, help="deepinfer: max_num_seqs (default 256)")
    p.add_argument("--nextn", type=int, help="draft tokens per request (DeepInfer name)")
    p.add_argument("--num-draft-tokens", type=int, help="draft tokens per request (k, q = 1 + k)")
    p.add_argument("--attn-tp-size", type=int, default=1, help="sglang: attention TP size")
    p.add_argument("--attn-cp-size", type=int, default=1, help="sglang: attention CP size")
    p.add_argument("--max-running-requests", type=int, help="sglang: request-pool size")
    p.add_argument("--sizes", type=_int_list, help="explicit sizes 1,2,4,8 (overrides --policy)")
    p.add_argument("--compare", action="store_true", help="one row per policy, plus llama.cpp")
    p.set_defaults(func=_cmd_buckets)

    # --- demo subcommand -------------------------------------------------------------------
    p = sub.add_parser("demo", help="decode a slice of the Azure LLM trace with SmolLM2, "
                       "host metadata vs zos, and write a report", description=_DEMO_DOC)
    for flag, kw in DEMO_FLAGS:
        p.add_argument(flag, **kw)
    p.set_defaults(func=_cmd_demo)
    # ---------------------------------------------------------------------------------------
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point (``zos = "zos.cli:main"``): parse ``argv`` and run the subcommand.
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
