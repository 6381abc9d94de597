"""Tests for the ``zos buckets`` CLI: output against the library's tables, one-line errors
(exit 2, nothing on stdout) for bad flags, and no torch import. ``zos demo``: test_demo.py."""
import subprocess
import sys

import pytest

from zos import buckets as B
from zos.serving.cli import MAX_PRINTED_SIZES, MAX_SIZE_LIMIT, main

VLLM_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of ``zos *argv``; argparse's SystemExit gives its code."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def sizes_line(out):
    """The sizes printed on the ``sizes:`` line, as a tuple of ints."""
    line = next(x for x in out.splitlines() if x.startswith("sizes: "))
    return tuple(int(x) for x in line[len("sizes: "):].split(","))


# ---- output ---------------------------------------------------------------------------------

def test_cli_deepinfer_nextn(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--policy", "deepinfer", "--max-num-seqs", "256",
                         "--nextn", "5")
    assert rc == 0 and "193 sizes" in out and "max 1536" in out and "uniform_decode=True" in out
    assert sizes_line(out) == B.deepinfer_policy(256, nextn=5).sizes
    assert "spec rounding: round_up (q=6" in out
    rc, out, _ = run_cli(capsys, "buckets", "--policy", "deepinfer", "--max-num-seqs", "256",
                         "--nextn", "5", "--spec-rounding", "none")  # DeepInfer's own table
    assert rc == 0 and "195 sizes" in out and "max 1536" in out and "7/16" in out
    assert "uniform_decode=False" in out and "spec rounding: none (q=6" in out


def test_cli_vllm_default(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--policy", "vllm")
    assert rc == 0 and "51 sizes" in out and "n=5: 3/8" in out
    assert ",".join(map(str, VLLM_512)) in out
    assert "spec rounding" not in out and "note:" not in out  # k = 0, 512 is on vLLM's grid
    assert run_cli(capsys, "buckets") == (rc, out, "")  # vllm is the default policy


def test_cli_sglang_and_trtllm(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--policy", "sglang", "--attn-tp-size", "4",
                         "--max-running-requests", "50")
    assert rc == 0 and "sizes: 4,8,12,16,24,32,40,48,52" in out
    rc, out, _ = run_cli(capsys, "buckets", "--policy", "trtllm", "--num-draft-tokens", "3")
    assert rc == 0 and "19 sizes" in out and "graph keys (batch, draft_len): 19" in out
    assert sizes_line(out) == tuple(4 * b for b in B.trtllm_batch_sizes(128))  # b * q rows


def test_cli_explicit_sizes(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--sizes", "1,2,4,8")
    assert rc == 0 and "4 sizes" in out and "explicit" in out


def test_cli_compare(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--compare")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 6
    assert lines[0].split() == ["policy", "count", "max", "unit", "worst", "waste"]
    assert lines[1].split()[:3] == ["vllm", "51", "512"]
    assert lines[2].split()[:3] == ["deepinfer", "35", "256"]
    assert lines[5].startswith("llama.cpp") and "cudaGraphExecUpdate" in lines[5]
    # the unit column: token rows for every policy
    col = lines[0].index("unit")
    units = {ln.split()[0]: ln[col:col + 10].strip() for ln in lines[1:6]}
    assert units == {"vllm": "token rows", "deepinfer": "token rows", "sglang": "token rows",
                     "trtllm": "token rows", "llama.cpp": "-"}


@pytest.mark.parametrize("name", list(B.POLICIES))
@pytest.mark.parametrize("max_size,k", [(64, 0), (100, 2), (300, 1)])
def test_cli_tables_match_registry(capsys, name, max_size, k):
    """--max-size maps to each policy's max keyword; sizes and unit as the library's table."""
    pol = B.POLICIES[name]
    rc, out, _ = run_cli(capsys, "buckets", "--policy", name, "--max-size", str(max_size),
                         "--num-draft-tokens", str(k))
    t = pol.builder(**{pol.max_keyword: max_size, pol.draft_keyword: k})
    assert rc == 0 and sizes_line(out) == t.sizes
    assert out.startswith(f"policy {name}: {len(t)} sizes, max {t.max_size} ({pol.unit}, ")
    rc, cmp, _ = run_cli(capsys, "buckets", "--compare", "--max-size", str(max_size),
                         "--num-draft-tokens", str(k))
    lines = cmp.splitlines()
    row = next(ln for ln in lines if ln.split()[0] == name)
    col = lines[0].index("unit")
    assert rc == 0 and row.split()[1:3] == [str(len(t)), str(t.max_size)]
    assert row[col:col + 10].strip() == pol.unit


def test_cli_deepinfer_max_size_is_max_num_seqs(capsys):
    a = run_cli(capsys, "buckets", "--policy", "deepinfer", "--max-size", "64")
    b = run_cli(capsys, "buckets", "--policy", "deepinfer", "--max-num-seqs", "64")
    c = run_cli(capsys, "buckets", "--policy", "deepinfer", "--max-size", "64",
                "--max-num-seqs", "64")
    assert a == b == c and a[0] == 0
    assert sizes_line(a[1]) == B.deepinfer_policy(64).sizes != B.deepinfer_policy().sizes


def test_cli_vllm_off_grid_note(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--max-size", "100")
    assert rc == 0 and sizes_line(out) == B.vllm_policy(100).sizes
    assert sizes_line(out)[-2:] == (96, 100)
    assert "note: zos adds 100, the largest multiple of q=1 <= max" in out
    assert "vLLM itself stops at 96" in out


def test_cli_sizes_cut_at_limit(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--policy", "trtllm", "--max-size",
                         str(MAX_SIZE_LIMIT))
    t = B.trtllm_policy(MAX_SIZE_LIMIT)
    line = next(x for x in out.splitlines() if x.startswith("sizes: "))
    shown = ",".join(map(str, t.sizes[:MAX_PRINTED_SIZES]))
    assert rc == 0 and len(t) > MAX_PRINTED_SIZES
    assert line == f"sizes: {shown},... ({len(t) - MAX_PRINTED_SIZES} more)"
    assert f"{len(t)} sizes, max {MAX_SIZE_LIMIT} (token rows" in out


# ---- --spec-rounding ----------------------------------------------------------------------

@pytest.mark.parametrize("argv,rounding,expected", [
    (("--max-size", "42", "--num-draft-tokens", "6"), "round_up", (7, 14, 21, 28, 35, 42)),
    (("--max-size", "96", "--nextn", "2"), "round_up",
     (3, 6, 9, 18, 24, 33, 42, 48, 57, 66, 72, 81, 90, 96)),
    (("--max-size", "96", "--num-draft-tokens", "2", "--spec-rounding", "round_up"), "round_up",
     (3, 6, 9, 18, 24, 33, 42, 48, 57, 66, 72, 81, 90, 96)),
    (("--max-size", "96", "--num-draft-tokens", "2", "--spec-rounding", "filter"), "filter",
     (24, 48, 72, 96)),
])
def test_cli_spec_rounding(capsys, argv, rounding, expected):
    rc, out, err = run_cli(capsys, "buckets", *argv)
    assert rc == 0 and err == "" and sizes_line(out) == expected
    assert f"spec rounding: {rounding} (q={expected[0] if rounding == 'round_up' else 3}" in out


def test_cli_spec_rounding_default_matches_library(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--num-draft-tokens", "2")
    assert rc == 0 and sizes_line(out) == B.vllm_policy(num_draft_tokens=2).sizes
    assert "spec rounding: round_up" in out
    assert "note: zos adds 510" in out and "vLLM itself stops at 498" in out
    rc, out, _ = run_cli(capsys, "buckets", "--spec-rounding", "filter")  # k = 0: no rounding
    assert rc == 0 and "spec rounding" not in out and sizes_line(out) == tuple(VLLM_512)


def test_cli_compare_says_rounding(capsys):
    rc, out, _ = run_cli(capsys, "buckets", "--compare", "--num-draft-tokens", "2",
                         "--spec-rounding", "filter")
    assert rc == 0 and "vllm spec rounding: filter (q=3" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("vllm "))
    t = B.vllm_policy(num_draft_tokens=2, spec_rounding="filter")
    assert row.split()[1:3] == [str(len(t)), str(t.max_size)]


# ---- bad input: one line on stderr naming the flag, exit 2, nothing on stdout ------------------

@pytest.mark.parametrize("argv,flag", [
    (("--max-size", "0"), "--max-size"),
    (("--max-size", "x"), "--max-size"),
    (("--sizes", ""), "--sizes"),
    (("--sizes", "1,2,0"), "--sizes"),
    (("--sizes", "4,2"), "sizes[1]: must be strictly increasing"),
    (("--nextn", "2", "--num-draft-tokens", "3"), "--nextn"),
    (("--nextn", "-1"), "--nextn"),
    (("--policy", "deepinfer", "--max-size", "64", "--max-num-seqs", "32"), "--max-num-seqs"),
    (("--policy", "vllm", "--max-num-seqs", "64"), "--max-num-seqs"),
    (("--max-num-seqs", "64"), "--max-num-seqs"),  # default policy vllm
    (("--compare", "--max-size", "-3"), "--max-size"),
    (("--compare", "--max-size", "0"), "--max-size"),
    (("--compare", "--policy", "vllm"), "--policy"),
    (("--compare", "--max-size", str(MAX_SIZE_LIMIT + 1)), "--max-size"),
    (("--compare", "--num-draft-tokens", "600"), "num_draft_tokens"),
    (("--policy", "trtllm", "--max-size", "100000000"), "--max-size"),
    (("--policy", "deepinfer", "--max-num-seqs", str(MAX_SIZE_LIMIT), "--nextn", "1"),
     "--max-num-seqs"),
    (("--policy", "sglang", "--num-draft-tokens", str(MAX_SIZE_LIMIT)), "--num-draft-tokens"),
    (("--sizes", f"1,{MAX_SIZE_LIMIT + 1}"), "--sizes"),
    (("--sizes", "1,2", "--policy", "vllm"), "--policy"),
    (("--sizes", "1,2", "--max-size", "8"), "--max-size"),
    (("--sizes", "1,2", "--compare"), "--compare"),
    (("--policy", "trtllm", "--spec-rounding", "filter"), "--spec-rounding"),
    (("--policy", "trtllm", "--max-size", str(MAX_SIZE_LIMIT), "--num-draft-tokens", "1"),
     "--max-size"),
    (("--spec-rounding", "nearest"), "--spec-rounding"),
    (("--policy", "vllm", "--attn-tp-size", "2"), "--attn-tp-size"),
    (("--policy", "sglang", "--attn-cp-size", "0"), "--attn-cp-size"),
    (("--policy", "deepinfer", "--max-running-requests", "8"), "--max-running-requests"),
    (("--policy", "nope"), "--policy"),
])
def test_cli_bad_input(capsys, argv, flag):
    rc, out, err = run_cli(capsys, "buckets", *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("zos buckets: error: ") and flag in err


@pytest.mark.parametrize("argv,flag", [
    (("--repeats", "0"), "--repeats"), (("--repeats", "two"), "--repeats"),
    (("--threads", "0"), "--threads"), (("--num-requests", "0"), "--num-requests"),
])
def test_cli_demo_bad_input(capsys, tmp_path, argv, flag):
    """Bad ``zos demo`` flags: one line naming the flag, exit 2, before any model is loaded
    (the flags are checked in a second)."""
    rc, out, err = run_cli(capsys, "demo", "--tiny", "--out", str(tmp_path / "r"), *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("zos demo: error: ") and flag in err


def test_cli_no_command(capsys):
    rc, out, err = run_cli(capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("zos: error: ")


# ---- no torch -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--help"], ["buckets"], ["buckets", "--compare"],
                                  ["buckets", "--help"]])
def test_cli_does_not_import_torch(argv):
    code = "\n".join([
        "import sys", "from zos.serving.cli import main", "try:", f"    rc = main({argv!r})",
        "except SystemExit as e:", "    rc = e.code",
        "assert rc == 0, rc", "assert 'torch' not in sys.modules, 'torch imported'"])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    expected = "usage: zos" if "--help" in argv else "worst"
    assert expected in proc.stdout
