"""A request body, read and decoded: whole within a deadline (408 after it), at most `limit`
bytes (413 beyond, without reading the rest), valid JSON nested no deeper than the decoder can
follow, text that can be encoded, and numbers Python can read (400 otherwise: an integer
literal of thousands of digits was a 500)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from conductor.errors import InvalidRequest, PayloadTooLarge, RequestTimeout

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: only bodies holding one can decode to a lone one."""


class ClientGone(Exception):
    """The client disconnected before its request's body was whole."""


async def read(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, whole within `timeout_s` (RequestTimeout: 408), at most `limit` bytes;
    ClientGone if the client leaves first."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:  # chunked, or a Content-Length that lied
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s "
                             "(--http-body-timeout-s)", code="body_timeout") from None
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def decode(raw: bytes) -> object:
    try:
        body = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):
            _check_text(body, "")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"Invalid JSON body: {e}") from None
    except RecursionError:
        raise InvalidRequest("Invalid JSON body: nested too deeply") from None
    except ValueError as e:  # an integer literal past Python's digit limit
        raise InvalidRequest(f"Invalid JSON body: {str(e)[:120]}") from None
    return body


def _check_text(value: Any, where: str) -> None:
    """Raise for the first string (key or value) holding a lone surrogate: no tokenizer,
    template or response encoder takes one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{where or 'body'}: a lone UTF-16 surrogate is not text",
                                 param=where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body exceeds {limit} bytes (--max-body-bytes)",
                           code="body_too_large")
