"""The HTTP server under the app: uvicorn with httptools and uvloop, given deadlines for
clients that would otherwise hold a connection forever.

uvicorn closes an idle kept-alive connection, but waits without bound for a request head
that never completes, and for a client that stops reading a response (its writes stay paused
by flow control). `GuardedHttp`, the protocol class uvicorn is configured with, closes both:
a head must complete within `head_timeout_s` of its first byte (or of the connection), and a
connection whose writes stay paused for `send_timeout_s` is closed; its request then ends as
any disconnect does (a stream's worker calls are cancelled, the engines abort). The body's
own deadline is the app's (`conductor.body.read`: 408).

The process's open-file limit is raised to its hard limit at start, so that thousands of
connections do not exhaust descriptors and stop new ones from being accepted.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import structlog
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from conductor.config import ConductorConfig

log = structlog.get_logger(__name__)


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head deadline and a stalled-write deadline (set by
    `guarded`)."""

    head_timeout_s = 15.0
    send_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._arm_head()

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._expire, "head")

    def _expire(self, what: str) -> None:
        log.info("client_too_slow", what=what)
        self.transport.abort()  # not close(): that would wait for the unread bytes to go

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head()  # a kept-alive connection's next request: its head from now

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_timer is not None:  # uvicorn's keep-alive deadline governs from here
            self._head_timer.cancel()
            self._head_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._expire, "read")

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._send_timer = None
        super().connection_lost(exc)


def guarded(head_timeout_s: float, send_timeout_s: float) -> type[GuardedHttp]:
    """The protocol class with these deadlines."""
    return type("GuardedHttp", (GuardedHttp,), {"head_timeout_s": head_timeout_s,
                                                 "send_timeout_s": send_timeout_s})


def server_config(app: Any, config: ConductorConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's configuration for the conductor's app (`overrides`: tests' loop, sockets)."""
    settings: dict[str, Any] = dict(
        host=config.host, port=config.port, loop="uvloop",
        http=guarded(config.http_head_timeout_s, config.http_send_timeout_s),
        log_level="warning", access_log=False, timeout_keep_alive=config.http_keep_alive_s,
        timeout_graceful_shutdown=5)
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def raise_open_files_limit() -> int:
    """Raise this process's open-file limit to its hard limit; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
