"""The docs stay small and current: benchmark output goes to the ignored `results/` directory
(`benchmarks/results.py`), never into git, and docs/ keeps only what the docs show."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
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
