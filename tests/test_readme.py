"""The README and docs/ZOS.md against the repository: the plug-in example runs as printed and
prints what the README says, CI runs the README's commands, and every path they cite exists."""
import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {name: (ROOT / name).read_text(encoding="utf-8")
        for name in ("README.md", "docs/ZOS.md", "bench/NOTES.md")}


def fenced(text: str, info: str) -> list[str]:
    """Bodies of the fenced code blocks of ``text`` whose info string is exactly ``info``."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?)^```$", text, flags=re.M | re.S)


def test_plug_in_example_runs_as_printed():
    """The block fenced ```python plug-in runs as it stands (CPU: eager steps, CUDA: graphs)
    and prints the ```text block that follows it in the README."""
    (code,) = fenced(README, "python plug-in")
    after = README[README.index(code) + len(code):]
    expected = fenced(after, "text")[0]
    out = io.StringIO()
    namespace = {"__name__": "readme_plug_in"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (python plug-in)", "exec"), namespace)
    assert out.getvalue() == expected
    first, second, third = namespace["first"], namespace["second"], namespace["third"]
    assert (len(first), len(second), len(third)) == (3, 3, 2)
    assert all(0 <= t < namespace["vocab_size"] for t in first + second + third)


def _commands(text: str) -> list[str]:
    """Command lines of ``text`` (comments, blank lines and shell set-up left out)."""
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return [x for x in lines if x and not x.startswith(("#", "set ", "cd "))]


def test_ci_runs_the_readme_commands():
    """.ci/run calls the README's set-up, lint and test commands, each exactly as printed."""
    ci = _commands((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    readme = {c for block in fenced(README, "bash") for c in _commands(block)}
    assert ci, ".ci/run runs nothing"
    for command in ci:
        assert command in readme, f".ci/run runs {command!r}, which the README does not show"
    assert ci[0].startswith("pip install torch==") and ci[-1] == "python -m pytest -q"
    assert ci.index("ruff check .") < ci.index("python -m pytest -q")


PATH = re.compile(r"`((?:zos|bench|csrc|triton_kernels|tests|docs|\.ci)/[^`\s]*)`")


@pytest.mark.parametrize("name", sorted(DOCS))
def test_cited_paths_exist(name):
    """Every repository path a document cites exists (test names included), and nothing
    links outside the repository."""
    text = DOCS[name]
    assert "../" not in text, f"{name} refers to a file outside the repository"
    cited = PATH.findall(text)
    assert cited
    for ref in cited:
        path, _, test = ref.partition("::")
        assert (ROOT / path).exists(), f"{name} cites {path}, which does not exist"
        if test:
            source = (ROOT / path).read_text(encoding="utf-8")
            assert re.search(rf"^def {re.escape(test)}\(", source, flags=re.M), \
                f"{name} cites {ref}: no such test"


def test_results_hold_only_current_results():
    """bench/results/ holds result files (json, and a demo report directory), no logs."""
    results = ROOT / "bench" / "results"
    for p in results.rglob("*"):
        if p.is_file():
            assert p.suffix in (".json", ".md", ".png"), f"not a result: {p.relative_to(ROOT)}"
            assert not re.search(r"_v\d+\.", p.name), f"history belongs in bench/NOTES.md: {p}"
