"""Schemathesis hooks for the fuzz test on real engines (SCHEMATHESIS_HOOKS=schemathesis_hooks).

Generated requests keep their shape but ask for little work (at most 8 tokens, 2 choices), so
the fuzz budget goes to validation and response shapes, not to decode time.
"""

from __future__ import annotations

from typing import Any

import schemathesis

LIMITS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "min_tokens": 8}


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for name, cap in LIMITS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
