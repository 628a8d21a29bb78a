"""The docs stay small and current: benchmark output goes to the ignored `results/` directory
(`benchmarks/results.py`), never into git, and docs/ keeps only what the docs show."""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_MAX_BYTES = 5 << 20
"""docs/ in git: the pages, their figures and a few small tables."""
OUT_FLAGS = ("--out", "--json-out")


def _git(*args: str) -> str:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode != 0 and "not a git repository" in done.stderr:
        pytest.skip("not a git checkout")
    return done.stdout


def test_nothing_under_results_is_tracked_and_git_ignores_it() -> None:
    assert _git("ls-files", "--", "results").split() == []
    assert _git("check-ignore", "results/e2e/results.json").strip() == "results/e2e/results.json"


def test_docs_stay_under_five_megabytes() -> None:
    tracked = [ROOT / p for p in _git("ls-files", "-z", "--", "docs").split("\0") if p]
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in tracked if p.exists()}
    assert sum(sizes.values()) <= DOCS_MAX_BYTES, sorted(sizes.items(), key=lambda kv: -kv[1])[:10]


def _out_defaults(path: Path) -> list[tuple[str, str]]:
    """(flag, the source of its default) for every `add_argument("--out" | "--json-out", ...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in OUT_FLAGS):
            default = next((ast.unparse(k.value) for k in node.keywords if k.arg == "default"), "")
            found.append((node.args[0].value, default))
    return found


def test_benchmarks_and_the_simulator_write_outside_docs_by_default() -> None:
    sources = [p for package in ("benchmarks", "simulator")
               for p in sorted((ROOT / package).rglob("*.py"))]
    defaults = {f"{p.relative_to(ROOT)} {flag}": d for p in sources for flag, d in _out_defaults(p)}
    assert len(defaults) >= 5, defaults  # e2e, serve, burst, chaos, the simulator
    assert not {k: d for k, d in defaults.items() if "docs" in d or not d}, defaults
    makefile = (ROOT / "Makefile").read_text()
    assert "--out docs" not in makefile and "--json-out docs" not in makefile


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


PRODUCT = ("conductor", "worker", "prefill_worker", "decode_worker", "store", "cluster",
           "embedded", "protos", "conductorctl", "tinymodel", "deploy")
"""The packages whose docstrings and comments state what is (docs/design.md keeps what happened)."""
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
          r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\b\.?")
HISTORY = re.compile("|".join((
    r"\b20[2-3]\d-(?:0[1-9]|1[0-2])(?:-\d\d)?\b",  # 2026-11-26, 2026-11
    rf"\b{_MONTH} (?:\d{{1,2}}(?:st|nd|rd|th)?,? )?20[2-3]\d\b",  # Nov 26, 2026; November 2026
    rf"\b\d{{1,2}} {_MONTH} 20[2-3]\d\b",  # 26 Nov 2026
    r"\b(?:run|session|edition)s? \d+\b",  # run 7, session 25, runs 1-8
    r"\bbench-[\w-]+(?:'s)? (?:run|A/B|edition)",  # a bench-e2e run
    r"\bA/B\b",
    r"\b(?:Xeon|EPYC)\b",  # the machines the benchmarks ran on
    r"\bmeasured here\b",
)), re.I)


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring (a string standing as a statement)."""
    source = path.read_text()
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines = node.value.value.split("\n")
            found += [(node.lineno + i, line) for i, line in enumerate(lines)]
    return found


def _hash_comments(path: Path, marker: str) -> list[tuple[int, str]]:
    """(line, text) of every comment in a .proto (`//`) or shell (`#`) file."""
    lines = path.read_text().splitlines()
    return [(n, line[line.index(marker):]) for n, line in enumerate(lines, 1) if marker in line]


def test_product_docstrings_and_comments_name_no_dates_runs_or_machines() -> None:
    """Product code says what is: measurements, their dates and the benchmark runs behind them
    live in docs/design.md, once, as they stand today."""
    found = []
    for package in PRODUCT:
        assert (ROOT / package).is_dir(), package
        for path in sorted((ROOT / package).rglob("*")):
            if "_pb2" in path.name or not path.is_file():
                continue
            prose = (_python_prose(path) if path.suffix == ".py"
                     else _hash_comments(path, "//") if path.suffix == ".proto"
                     else _hash_comments(path, "#") if path.suffix == ".sh" else [])
            found += [f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {text.strip()[:80]!r}"
                      for n, text in prose for m in HISTORY.finditer(text)]
    assert not found, "\n".join(found)
