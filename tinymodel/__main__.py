"""``python -m tinymodel`` / ``kvcluster-build-model``: build or reuse the tiny model.

Every :class:`~tinymodel.builder.ModelSpec` field is a flag (``--hidden-size``; short
aliases ``--hidden``, ``--layers``, ``--heads``, ``--kv-heads``, ``--vocab``, ``--steps``).
The model path is printed as the last stdout line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tinymodel.builder import ModelSpec, default_cache_dir, ensure_model

_ALIASES = {
    "hidden_size": ["--hidden"],
    "intermediate_size": ["--intermediate"],
    "num_layers": ["--layers"],
    "num_heads": ["--heads"],
    "num_kv_heads": ["--kv-heads"],
    "vocab_size": ["--vocab"],
    "train_steps": ["--steps"],
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcluster-build-model", description="Build (or reuse) the tiny Llama test model."
    )
    p.add_argument(
        "--out-dir", "--cache-dir", dest="out_dir", type=Path, default=None,
        help=f"cache directory holding model dirs (default: {default_cache_dir()})",
    )  # fmt: skip
    for field in dataclasses.fields(ModelSpec):
        flag = "--" + field.name.replace("_", "-")
        p.add_argument(
            flag, *_ALIASES.get(field.name, []), dest=field.name, type=type(field.default),
            default=field.default, help=f"(default: {field.default})",
        )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = ModelSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelSpec)})
    print(ensure_model(spec, args.out_dir), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
