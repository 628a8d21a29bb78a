"""`python -m tools.configdoc`: docs/configuration.md, generated from the source.

A field's docstring exists only in the source (Python keeps no attribute docstrings), so the
config classes are read with `ast`, as vLLM generates its own config reference: every field
with its type, default, flag, `KVCLUSTER_*` variable and docstring; then the embedded
launcher's flags (`embedded/command.py`, `parser()`), and the other `KVCLUSTER_*` variables
the product code reads. Nothing is imported, so the reference does not depend on the machine
or its environment. `--check` exits 1 when the file differs from what the source gives
(tests/test_configdoc.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = Path("docs/configuration.md")
PRODUCT = ("conductor", "conductorctl", "embedded", "worker", "prefill_worker", "decode_worker",
           "store", "cluster", "tinymodel")
"""The packages whose `KVCLUSTER_*` reads are listed (not tests, benchmarks or tools)."""


@dataclass(frozen=True)
class Source:
    """One config class, and how its fields are set."""

    title: str
    path: str
    cls: str
    how: str
    """A paragraph: who reads it, and from where."""
    flags: bool
    """Every field is a `--flag-name` of its program."""
    env_fields: str = "all"
    """Which fields have a `<prefix><FIELD>` variable: "all", or the name of the class method
    holding the converters' dict (its keys are the fields read from the environment)."""


SOURCES = (
    Source("Conductor", "conductor/config.py", "ConductorConfig",
           "`python -m conductor` (and `deploy/conductor.sh`, and the embedded cluster). A flag "
           "overrides its environment variable, which overrides the default. `model` and `etcd` "
           "are required.", flags=True),
    Source("Workers", "worker/config.py", "WorkerConfig",
           "`python -m prefill_worker` and `python -m decode_worker` (and `deploy/prefill.sh`, "
           "`deploy/decode.sh`; the embedded cluster starts them with these flags). A flag "
           "overrides its environment variable, which overrides the default; `--role` defaults "
           "to the entry point's. `model`, `etcd`, `pool_master` and `pool_metadata` are "
           "required.", flags=True),
    Source("Pool client", "store/pool/config.py", "PoolConfig",
           "How a process joins the Mooncake Store pool. Workers build it from their own "
           "settings (through the connector's below); `PoolConfig.from_env` reads it from the "
           "environment for other programs (the tests, scripts): sizes there accept KiB/MiB/GiB "
           "suffixes. `master_addr` and `metadata_url` are required.", flags=False,
           env_fields="from_env"),
    Source("KV connector", "store/connector/settings.py", "ConnectorSettings",
           "`kv_connector_extra_config` of our vLLM KV connector "
           "(`kv_connector=\"PoolConnector\"`, `kv_connector_module_path=\"store.connector\"`): "
           "what a worker passes its engine, and "
           "what a plain `vllm serve` with our connector takes in `--kv-transfer-config`. "
           "Unknown keys are errors.", flags=False, env_fields="none"),
)


# ---------------------------------------------------------------------------- reading source


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _module(root: Path, dotted_or_path: str) -> tuple[Path, ast.Module] | None:
    path = root / dotted_or_path if dotted_or_path.endswith(".py") else \
        root / (dotted_or_path.replace(".", "/") + ".py")
    if not path.exists():
        path = path.with_suffix("") / "__init__.py"
    return (path, _parse(path)) if path.exists() else None


def _constant(root: Path, path: Path, tree: ast.Module, expr: ast.expr) -> object:
    """The value of `expr` if the source fixes it: literals, constant arithmetic, and names
    bound at module level here or imported (`from m import NAME`, `m.NAME`); else None."""
    if isinstance(expr, (ast.Constant, ast.Tuple, ast.List, ast.UnaryOp, ast.BinOp)):
        try:
            return eval(compile(ast.Expression(expr), str(path), "eval"), {"__builtins__": {}})
        except Exception:
            return None
    if isinstance(expr, ast.Name):
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == expr.id for t in node.targets):
                return _constant(root, path, tree, node.value)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == expr.id:
                        found = _module(root, node.module)
                        return found and _constant(root, *found, ast.Name(alias.name))
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == expr.value.id:
                        found = _module(root, f"{node.module}.{alias.name}")
                        return found and _constant(root, *found, ast.Name(expr.attr))
    return None


def _show(value: object) -> str:
    """A default as a reader types it: strings unquoted ("empty" for ""), None as unset."""
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    if isinstance(value, tuple):
        return ", ".join(map(str, value))
    return f"`{value!r}`"


def _docstring(body: list[ast.stmt], i: int) -> str:
    """The string statement right after `body[i]`, as one paragraph ("" when there is none)."""
    nxt = body[i + 1] if i + 1 < len(body) else None
    if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
            and isinstance(nxt.value.value, str):
        return " ".join(inspect.cleandoc(nxt.value.value).split())
    return ""


def _env_prefix(tree: ast.Module) -> str:
    """The module's one `KVCLUSTER_<COMPONENT>_` prefix (a string or an f-string's head)."""
    found = set()
    for node in ast.walk(tree):
        head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
        if isinstance(head, ast.Constant) and isinstance(head.value, str) \
                and head.value.startswith("KVCLUSTER_") and head.value.endswith("_"):
            found.add(head.value)
    return found.pop() if len(found) == 1 else ""


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    default: str
    """As written, with the value it comes to where that differs; "" when required."""
    doc: str


def _fields(root: Path, src: Source) -> tuple[list[Field], set[str], str]:
    """The class's fields, the ones read from the environment, and the variables' prefix."""
    path, tree = _module(root, src.path)  # type: ignore[misc]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == src.cls)
    fields = []
    for i, node in enumerate(cls.body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        default = ""
        if node.value is not None:
            written = ast.unparse(node.value)
            value = _constant(root, path, tree, node.value)
            default = f"`{written}`" if value is None else _show(value)
            if isinstance(node.value, ast.BinOp):
                default = f"`{written}` ({value})"
        fields.append(Field(node.target.id, ast.unparse(node.annotation), default,
                            _docstring(cls.body, i)))
    env = {f.name for f in fields} if src.env_fields == "all" else set()
    if src.env_fields not in ("all", "none"):
        method = next(n for n in cls.body if isinstance(n, ast.FunctionDef)
                      and n.name == src.env_fields)
        for node in ast.walk(method):
            if isinstance(node, ast.Dict):
                env |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
    return fields, env, _env_prefix(tree) if env else ""


def _launcher_flags(root: Path) -> list[tuple[str, str, str, str]]:
    """(flag, environment variable, default, help) of `embedded/command.py`'s `parser()`."""
    path, tree = _module(root, "embedded/command.py")  # type: ignore[misc]
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parser")
    rows = []
    for call in ast.walk(func):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        flag = str(_constant(root, path, tree, call.args[0]))
        env, default = "", ""
        for node in ast.walk(kw["default"]) if "default" in kw else ():
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.environ.get":
                env = node.args[0].value  # type: ignore[attr-defined]
                default = _show(node.args[1].value)  # type: ignore[attr-defined]
        if isinstance(kw.get("default"), ast.Compare):
            on = kw["default"].comparators[0].value  # type: ignore[attr-defined]
            default = f"off (`{env}={on}`: on)"
        elif kw.get("action") is not None and ast.unparse(kw["action"]) == "'store_true'":
            default = "off"
        elif not env:
            default = _show(_constant(root, path, tree, kw["default"])) if "default" in kw \
                else "unset"
        if "choices" in kw:
            default += f"; one of {_show(_constant(root, path, tree, kw['choices']))}"
        help_ = ""
        if isinstance(kw.get("help"), ast.Constant):
            help_ = kw["help"].value  # type: ignore[union-attr]
        elif isinstance(kw.get("help"), ast.JoinedStr):
            help_ = "".join(str(v.value) if isinstance(v, ast.Constant) else
                            str(_constant(root, path, tree, v.value))  # type: ignore[attr-defined]
                            for v in kw["help"].values)  # type: ignore[union-attr]
        rows.append((flag, env, default, " ".join(help_.split())))
    return rows


def _env_reads(root: Path) -> dict[str, tuple[str, str]]:
    """Every `KVCLUSTER_*` name the product code reads or names as a constant, with the module
    and what the source says of it: the constant's docstring (`X_ENV = "KVCLUSTER_..."` then a
    string), else the sentence naming it in the reading function's or the module's docstring,
    and the fallback the read gives (`os.environ.get(NAME, fallback)`)."""
    found: dict[str, tuple[str, str]] = {}
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            tree = _parse(path)
            module = path.relative_to(root).as_posix()
            for i, node in enumerate(tree.body):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and _is_env(node.value.value):
                    doc = _docstring(tree.body, i) or _sentence(ast.get_docstring(tree) or "",
                                                                node.value.value)
                    found.setdefault(node.value.value, (module, doc))
            owner: dict[int, ast.AST] = {}  # node -> its innermost function (walk is outer first)
            for func in ast.walk(tree):
                if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    owner.update((id(n), func) for n in ast.walk(func))
            for node in ast.walk(tree):
                name, fallback = None, None
                if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                        "os.environ.get", "os.getenv", "env.get") and node.args:
                    name = node.args[0]
                    if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                        fallback = node.args[1].value
                elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                    name = node.slice
                if not (isinstance(name, ast.Constant) and _is_env(name.value)):
                    continue
                scope = owner.get(id(node), tree)
                doc = (_sentence(ast.get_docstring(scope) or "", name.value)  # type: ignore[arg-type]
                       or _sentence(ast.get_docstring(tree) or "", name.value))
                if fallback:
                    doc = f"{doc} Default: `{fallback}`.".strip()
                if name.value not in found or (doc and not found[name.value][1]):
                    found[name.value] = (module, doc)
    return dict(sorted(found.items()))


def _sentence(docstring: str, name: str) -> str:
    """The first sentence of `docstring` that names `name`."""
    for para in docstring.split("\n\n"):
        for sentence in re.split(r"(?<=\.)\s+(?=[A-Z`$(])", " ".join(para.split())):
            if name in sentence:
                return sentence
    return ""


def _is_env(value: object) -> bool:
    return isinstance(value, str) and value.startswith("KVCLUSTER_") and not value.endswith("_")


# ---------------------------------------------------------------------------- writing


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(root: Path = ROOT) -> str:
    out = ["# Configuration reference",
           "",
           "<!-- Generated by `python -m tools.configdoc` from the config classes' fields and "
           "docstrings; do not edit: change the source and run it again (tests/test_configdoc.py "
           "fails while this file is stale). -->",
           "",
           "Every setting of the conductor, the workers, the pool client, the KV connector and "
           "the embedded launcher (`make run`), with its flag, its environment variable and its "
           "default. How they fit together: [operations.md](operations.md) and "
           "[deploy.md](deploy.md).",
           ""]
    covered: set[str] = set()
    for src in SOURCES:
        fields, env, prefix = _fields(root, src)
        out += [f"## {src.title} (`{src.cls}`, `{src.path}`)", "", src.how, ""]
        for f in fields:
            names = []
            if src.flags:
                names.append(f"`--{f.name.replace('_', '-')}`")
            if f.name in env and prefix:
                names.append(f"`{prefix}{f.name.upper()}`")
                covered.add(f"{prefix}{f.name.upper()}")
            default = f"default {f.default}" if f.default else "required"
            where = f" ({', '.join(names)})" if names else ""
            out.append(f"- **`{f.name}`**{where}: {f.type}, {default}. "
                       + (f.doc or "*Undocumented.*"))
        out.append("")
    out += ["## Embedded launcher (`python -m embedded`, `make run`)", "",
            "`embedded/command.py`'s flags; `make run ARGS=\"...\"` passes them, `make run "
            "PORT=9000` and `MODEL=dir` set `--port` and `--model`. The conductor and the "
            "workers it starts take every other setting from the environment above "
            "(`KVCLUSTER_CONDUCTOR_<FIELD>`, `KVCLUSTER_WORKER_<FIELD>`).", "",
            "| flag | environment | default | what |", "| --- | --- | --- | --- |"]
    for flag, env, default, help_ in _launcher_flags(root):
        covered.add(env)
        out.append(f"| `{flag}` | {f'`{env}`' if env else ''} | {_cell(default)} | "
                   f"{_cell(help_)} |")
    out += ["", "## Other `KVCLUSTER_*` variables", "",
            "Read elsewhere in the product code (found by name in the source). Most are set by "
            "the cluster itself for the processes it starts (the engines' placement and step "
            "budget); the deploy scripts' own variables are in the scripts' headers "
            "([deploy.md](deploy.md)).", "",
            "| variable | read in | what |", "| --- | --- | --- |"]
    for name, (module, doc) in _env_reads(root).items():
        if name not in covered:
            out.append(f"| `{name}` | `{module}` | {_cell(doc)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.configdoc", description=__doc__.split(
        "\n")[0])
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 if {TARGET} is not what the source gives")
    a = p.parse_args(argv)
    text, target = render(), ROOT / TARGET
    if a.check:
        if not target.exists() or target.read_text() != text:
            print(f"{TARGET} is stale: run python -m tools.configdoc", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
