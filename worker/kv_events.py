"""Relays the engine's KV cache events to the conductor, in the conductor's block-key scheme.

vLLM publishes `KVEventBatch`es (BlockStored / BlockRemoved / AllBlocksCleared) over ZMQ;
its block hashes are its own. A BlockStored carries the blocks' token ids, its parent's hash
and (for a chain's first block) the request's `cache_salt`, so the relay re-keys each block
with `store.block_hash.extend_hashes` and keeps the engine-hash -> our-hash map, which is
exactly the set of blocks the engine caches (bounded by its KV size). Each subscriber (the
conductor's `KvEvents` stream) first gets that whole set as a reset, then the changes; one
that falls behind is dropped and reconnects to a fresh reset.

The engine's publisher binds a Unix socket (`ipc://` in its socket directory, `IPC_ENV`) that the
relay connects to: nothing listens on a network port, and no port can collide with the
ones the launcher hands out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog

from cluster.process import IPC_ENV
from protos import worker_pb2
from store.block_hash import extend_hashes, to_wire

log = structlog.get_logger(__name__)

TOPIC = "kv"
_QUEUE_MAX = 1024


class KvEventRelay:
    def __init__(self, block_size: int) -> None:
        import zmq

        self.block_size = block_size
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._path = os.path.join(os.environ.get(IPC_ENV) or tempfile.gettempdir(),
                                  f"kvcluster-kv-events-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        """Beside the engine's own sockets: removed with them, also when this process is
        killed (`cluster.process.vllm_scratch`)."""
        self.endpoint = f"ipc://{self._path}"
        """Where the engine's publisher binds (`KVEventsConfig.endpoint`)."""
        self._sub.connect(self.endpoint)
        self._ours: dict[Any, int] = {}
        self._subscribers: set[asyncio.Queue] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._next_seq = -1
        self.untranslatable = 0

    def events_config(self):
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=self.endpoint, topic=TOPIC)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._receive, name="kv-event-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._sub.close(linger=0)
        self._ctx.term()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        for q in list(self._subscribers):
            q.put_nowait(None)

    # ------------------------------------------------------------------ engine side

    def _receive(self) -> None:
        """ZMQ thread: decode batches and hand them to the event loop."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stopping.is_set():
            if not self._sub.poll(100):
                continue
            try:
                _, seq_bytes, payload = self._sub.recv_multipart()
                batch = decoder.decode(payload)
            except Exception as e:  # a malformed message must not stop the relay
                log.warning("kv_event_undecodable", error=str(e))
                continue
            seq = int.from_bytes(seq_bytes, "big")
            if self._next_seq >= 0 and seq != self._next_seq:
                log.warning("kv_events_gap", expected=self._next_seq, got=seq)
            self._next_seq = seq + 1
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._apply, batch.events)

    def _apply(self, events: list) -> None:
        """Event loop: translate into our hashes, net out within the batch, fan out."""
        stored: dict[int, None] = {}
        removed: dict[int, None] = {}
        reset = False
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                for h in self._translate(ev):
                    removed.pop(h, None)
                    stored[h] = None
            elif kind == "BlockRemoved":
                for eh in ev.block_hashes:
                    h = self._ours.pop(eh, None)
                    if h is not None:
                        stored.pop(h, None)
                        removed[h] = None
            elif kind == "AllBlocksCleared":
                self._ours.clear()
                stored.clear()
                removed.clear()
                reset = True
        if reset or stored or removed:
            self._publish(worker_pb2.KvEventBatch(reset=reset, stored=to_wire(stored),
                                                  removed=to_wire(removed)))

    def _translate(self, ev: Any) -> list[int]:
        bs = ev.block_size or self.block_size
        if ev.parent_block_hash is None:
            parent = None
            salt = _salt(ev)
        else:
            parent = self._ours.get(ev.parent_block_hash)
            salt = None
            if parent is None:  # its parent was never seen (or already evicted)
                self.untranslatable += len(ev.block_hashes)
                return []
        ours = extend_hashes(parent, ev.token_ids, bs, salt)
        for eh, h in zip(ev.block_hashes, ours, strict=False):
            self._ours[eh] = h
        return ours[:len(ev.block_hashes)]

    # ------------------------------------------------------------------ conductor side

    def _publish(self, batch: worker_pb2.KvEventBatch) -> None:
        for q in list(self._subscribers):
            try:
                q.put_nowait(batch)
            except asyncio.QueueFull:  # a slow subscriber: end its stream, it resyncs
                self._subscribers.discard(q)
                q.get_nowait()
                q.put_nowait(None)

    async def stream(self) -> AsyncIterator[worker_pb2.KvEventBatch]:
        """Everything the engine caches now, then its changes, until the relay stops."""
        q: asyncio.Queue = asyncio.Queue(maxsize=_QUEUE_MAX)
        self._subscribers.add(q)
        try:
            yield worker_pb2.KvEventBatch(reset=True, stored=to_wire(self._ours.values()))
            while (batch := await q.get()) is not None:
                yield batch
        finally:
            self._subscribers.discard(q)

    def blocks(self) -> int:
        return len(self._ours)


def _salt(ev: Any) -> str | None:
    """The cache_salt among a chain's first block's extra keys (published untagged, after the
    LoRA name when there is one)."""
    keys = ev.extra_keys[0] if ev.extra_keys else None
    if not keys:
        return None
    if ev.lora_name:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), None)
