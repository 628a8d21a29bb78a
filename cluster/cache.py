"""The user's cache of this project (`$XDG_CACHE_HOME/kvcluster`, else `~/.cache/kvcluster`):
what is computed once per machine and kept across runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcluster"
