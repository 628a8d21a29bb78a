"""The control state every replica of the conductor shares: drains and role switches, the
default SLOs, the routing policy, tenants' limits and the fitted time models, kept in etcd
(`conductor.control_store`) as versioned records (`conductor.control_records`), and applied
here to the registry, the router and the tenants.

- **Following.** Every replica follows the control prefix: the whole of it at start (the
  conductor serves only once it has it) and after every reconnect, then each change as etcd
  orders it. A record that does not decode whole (a truncated value, another schema, a value
  out of range) is logged once (`control_record_invalid`) and ignored: what was in force stays
  in force. A key deleted means the configured default.
- **Changing.** An admin call writes etcd first, in one transaction that checks the records
  it read are unchanged (a lost update is retried), and applies the result here on success;
  the other replicas apply it from their watch. With etcd unreachable the call fails
  (`ControlUnavailable`: gRPC UNAVAILABLE) and nothing changes anywhere; serving goes on with
  the last state seen. A change applies by etcd revision, so a replica's own write and its
  watch cannot undo a later change by another replica.
- **Drains** name an instance id, not a process: a drained worker that restarts under its id
  stays drained. Records of instances no longer registered are kept, at most
  `max_instance_records`; beyond, the oldest of them are dropped in the transaction that
  adds one. ResizePool clears the records of the workers it starts and retires.
- **Fitted models.** Every `control_models_s` each replica writes its prefill-time and TBT
  models with the timings they were fitted from, when it holds a timing the stored record
  lacks (a plain put: the last writer wins), and merges what the others write
  (`Fitter.adopt`: each timing once), so the record converges to every replica's timings
  and a replica that starts prices with what was learned. What a killed replica timed since
  its last write is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from conductor.config import ConductorConfig
from conductor.control_records import (
    InstanceControl,
    ModelControl,
    PolicyControl,
    Record,
    RecordError,
    SloControl,
    TenantControl,
    decode,
    encode,
)
from conductor.control_store import ControlStore, StoreUnavailable
from conductor.errors import ControlUnavailable
from conductor.registry import Instance, Registry
from conductor.router import Router
from conductor.scheduler.decode_model import TbtModel
from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.regression import Fitter
from conductor.tenants import DEFAULT, Limits, Tenants

log = structlog.get_logger(__name__)

ATTEMPTS = 5
"""Read-check-write rounds a change gets while other replicas change the same records."""
MAX_INSTANCE_RECORDS = 1024


@dataclass(frozen=True)
class _Entry:
    revision: int
    record: Record | None
    """None: deleted at `revision`."""


class ControlState:
    def __init__(self, config: ConductorConfig, store: ControlStore, registry: Registry,
                 router: Router, tenants: Tenants,
                 tbt_slo_changed: Callable[[], None] = lambda: None,
                 max_instance_records: int = MAX_INSTANCE_RECORDS) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.router = router
        self.tenants = tenants
        self.tbt_slo_changed = tbt_slo_changed
        """Called when the TBT SLO changed (the engines' step target follows it)."""
        self.max_instance_records = max_instance_records
        self._entries: dict[str, _Entry] = {}
        self._bad: dict[str, int] = {}
        """Keys whose record is invalid, with the revision logged."""
        self._task: asyncio.Task[None] | None = None
        registry.listen(self)

    @property
    def synced(self) -> bool:
        return self.store.synced

    async def start(self, timeout: float | None = 10.0) -> None:
        """Follow the store; returns once its whole state is applied (TimeoutError after
        `timeout`)."""
        await self.store.start(self._snapshot, self._event, timeout)
        self._task = asyncio.get_running_loop().create_task(self._keep_models(),
                                                             name="control-models")

    async def close(self) -> None:
        """Stop following, writing the fitted models once more (bounded)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            await self.write_models()
        await self.store.close()

    # ------------------------------------------------------------------ reading

    def record(self, key: str) -> Record | None:
        entry = self._entries.get(key)
        return entry.record if entry is not None else None

    def instance(self, instance_id: str) -> InstanceControl:
        rec = self.record(f"instances/{instance_id}")
        return rec if isinstance(rec, InstanceControl) else InstanceControl(instance_id)

    def instance_records(self) -> dict[str, InstanceControl]:
        return {r.instance_id: r for e in self._entries.values()
                if isinstance(r := e.record, InstanceControl)}

    # ------------------------------------------------------------------ following

    def _snapshot(self, kvs: dict[str, tuple[bytes, int]], revision: int) -> None:
        for key, (value, rev) in sorted(kvs.items()):
            self._offer_raw(key, value, rev)
        for key in [k for k in self._entries if k not in kvs]:
            self._offer(key, revision, None)

    def _event(self, key: str, value: bytes | None, revision: int) -> None:
        self._offer_raw(key, value, revision)

    def _offer_raw(self, key: str, value: bytes | None, revision: int) -> None:
        if value is None:
            self._offer(key, revision, None)
            return
        try:
            record = decode(key, value)
        except RecordError as e:
            if self._bad.get(key) != revision:
                self._bad[key] = revision
                log.warning("control_record_invalid", key=key, revision=revision, error=str(e))
            return
        self._offer(key, revision, record)

    def _offer(self, key: str, revision: int, record: Record | None) -> None:
        """Apply `record` as `key`'s state at `revision`, unless a later one is in force."""
        before = self._entries.get(key)
        if before is not None and before.revision >= revision:
            return
        self._entries[key] = _Entry(revision, record)
        if (before.record if before is not None else None) != record:
            try:
                self._apply(key, record)
            except Exception:
                log.exception("control_apply_failed", key=key, revision=revision)

    def _apply(self, key: str, record: Record | None) -> None:
        family, _, name = key.partition("/")
        if family == "instances":
            inst = self.registry.get(name)
            if inst is not None:
                self._apply_instance(inst)
        elif key == "slo":
            self._apply_slo(record if isinstance(record, SloControl) else None)
        elif key == "policy":
            p = record if isinstance(record, PolicyControl) else None
            self.router.set_policy(p.policy if p else self.config.policy,
                                   p.disaggregate if p else self.config.disaggregate)
        elif family == "tenants":
            limits = (record.limits if isinstance(record, TenantControl)
                      else self.config.tenant_limits.get(name))
            if limits is None:
                self.tenants.reset(name)
            else:
                self.tenants.set(name, limits)
            log.info("tenant_limits_applied", tenant=name, own=limits is not None)
        elif family == "models" and isinstance(record, ModelControl):
            self._apply_model(record)

    def _apply_instance(self, inst: Instance) -> None:
        rec = self.instance(inst.instance_id)
        self.registry.set_draining(inst.instance_id, rec.draining)
        role = rec.role or inst.info.role
        if inst.info.role == "both":
            self.registry.set_role(inst.instance_id, role)
        elif role != inst.info.role:
            log.warning("control_role_inapplicable", instance_id=inst.instance_id, role=role,
                        registered=inst.info.role)

    def _apply_model(self, rec: ModelControl) -> None:
        if rec.served_model != self.config.served_model_name:  # replaced by the next write
            log.warning("control_model_foreign", model=rec.fitted, served=rec.served_model)
            return
        fitter, make = self._fitters()[rec.fitted]
        if fitter.adopt(make(*rec.coefficients), rec.rows, time.monotonic(), time.time(),
                        rec.fitted_at):
            log.info("control_model_adopted", model=rec.fitted, rows=len(rec.rows))

    def _apply_slo(self, rec: SloControl | None) -> None:
        before = self.router.tbt_slo_s
        self.router.set_slo(rec.ttft_slo_s if rec else self.config.ttft_slo_s,
                            rec.tbt_slo_s if rec else self.config.tbt_slo_s)
        if self.router.tbt_slo_s != before:
            self.tbt_slo_changed()

    # the registry's listener: an instance joining takes its record at once, before it can
    # be routed (it is not verified yet)
    def instance_joined(self, inst: Instance) -> None:
        if f"instances/{inst.instance_id}" in self._entries:
            self._apply_instance(inst)

    def instance_left(self, inst: Instance) -> None:
        pass

    def instance_admitted(self, inst: Instance) -> None:
        pass

    # ------------------------------------------------------------------ changing

    async def update(self, keys: Iterable[str],
                     change: Callable[[dict[str, Record | None]], Mapping[str, Record | None]]
                     ) -> dict[str, Record | None]:
        """Read `keys`, let `change` say their new records (None or a `default` record: no
        record), write what differs in one transaction if none of them changed meanwhile,
        and apply it here. `change`'s ValueError goes to the caller before anything is
        written; ControlUnavailable when etcd does not answer or the records keep changing."""
        keys = list(dict.fromkeys(keys))
        for _ in range(ATTEMPTS):
            try:
                raw = await self.store.read(keys)
            except StoreUnavailable as e:
                raise _unavailable(e) from None
            now = {k: self._decoded(k, value) for k, (value, _) in raw.items()}
            new = {k: None if r is None or r.default else r for k, r in change(now).items()}
            writes = {k: None if r is None else encode(r) for k, r in new.items()
                      if r != now.get(k) or (r is None and raw[k][0] is not None)}
            for k in new.keys() - writes.keys():  # as read: in force here too
                self._offer(k, raw[k][1], now[k])
            if not writes:
                return new
            try:
                revision = await self.store.commit({k: raw[k][1] for k in writes}, writes)
            except StoreUnavailable as e:
                raise _unavailable(e) from None
            if revision is not None:
                for k in writes:
                    self._offer(k, revision, new[k])
                return new
        raise ControlUnavailable("the control state kept changing under this change; retry")

    def _decoded(self, key: str, value: bytes | None) -> Record | None:
        """The record a read found; for one that does not decode (which the write replaces),
        the one in force here."""
        if value is None:
            return None
        try:
            return decode(key, value)
        except RecordError:
            return self.record(key)

    async def set_instances(self, changes: Mapping[str, Mapping[str, Any]]) -> None:
        """Change instances' records (`InstanceControl` fields: draining, role) in one
        transaction; a role equal to the registered one is stored as none."""
        keys = {f"instances/{iid}": iid for iid in changes}
        kept = self.instance_records()
        room = self.max_instance_records - len(kept) - len(set(changes) - set(kept))
        stale = sorted((self._entries[f"instances/{iid}"].revision, iid) for iid in kept
                       if iid not in changes and self.registry.get(iid) is None)
        dropped = [f"instances/{iid}" for _, iid in stale[:max(-room, 0)]]

        def change(now: dict[str, Record | None]) -> dict[str, Record | None]:
            out: dict[str, Record | None] = dict.fromkeys(dropped)
            for key, iid in keys.items():
                rec = now.get(key)
                fields = dict(changes[iid])
                inst = self.registry.get(iid)
                if inst is not None and fields.get("role") == inst.info.role:
                    fields["role"] = ""
                base = rec if isinstance(rec, InstanceControl) else InstanceControl(iid)
                out[key] = replace(base, **fields)
            return out

        await self.update([*keys, *dropped], change)

    async def set_slo(self, ttft_slo_s: float | None, tbt_slo_s: float | None) -> SloControl:
        """The default SLOs (None: unchanged)."""
        def change(now: dict[str, Record | None]) -> dict[str, Record | None]:
            cur = now["slo"]
            if not isinstance(cur, SloControl):
                cur = SloControl(self.config.ttft_slo_s, self.config.tbt_slo_s)
            return {"slo": SloControl(ttft_slo_s or cur.ttft_slo_s, tbt_slo_s or cur.tbt_slo_s)}

        rec = (await self.update(["slo"], change))["slo"]
        assert isinstance(rec, SloControl)
        return rec

    async def set_policy(self, policy: str, disaggregate: str) -> PolicyControl:
        """The routing policy and `disaggregate` ("": unchanged)."""
        def change(now: dict[str, Record | None]) -> dict[str, Record | None]:
            cur = now["policy"]
            if not isinstance(cur, PolicyControl):
                cur = PolicyControl(self.config.policy, self.config.disaggregate)
            return {"policy": PolicyControl(policy or cur.policy,
                                            disaggregate or cur.disaggregate)}

        rec = (await self.update(["policy"], change))["policy"]
        assert isinstance(rec, PolicyControl)
        return rec

    async def set_tenant(self, tenant: str, changes: Mapping[str, Any], reset: bool) -> None:
        """A tenant's limits: with `reset` none of its own first (the default's; for `*`:
        none), then `changes` (Limits fields) on top of what it has."""
        key, base = f"tenants/{tenant}", self.config.tenant_limits

        def change(now: dict[str, Record | None]) -> dict[str, Record | None]:
            rec = now[key]
            own = rec.limits if isinstance(rec, TenantControl) else base.get(tenant)
            if reset:
                own = None
            if changes or not reset:
                start = own or (self.tenants.limits(DEFAULT) if tenant != DEFAULT else Limits())
                own = start.with_changes(**changes)
            if own is None and tenant not in base:
                return {key: None}  # what no record says
            return {key: TenantControl(tenant, own)}

        await self.update([key], change)

    # ------------------------------------------------------------------ fitted models

    def _fitters(self) -> dict[str, tuple[Fitter, Callable[..., Any]]]:
        return {"prefill": (self.router.prefill_fit, PrefillTimeModel),
                "tbt": (self.router.tbt_fit, TbtModel)}

    async def _keep_models(self) -> None:
        while True:
            await asyncio.sleep(self.config.control_models_s)
            await self.write_models()

    async def write_models(self) -> None:
        """Write each model whose timings hold one the stored record lacks (one timed here, or
        merged from a record written meanwhile by a replica that had not seen this one's): a
        plain put, the last writer wins, and a replica whose timings the record holds writes
        nothing. An unreachable etcd is tried again next time."""
        for kind, (fitter, _) in self._fitters().items():
            stored = self.record(f"models/{kind}")
            known = set(stored.rows) if isinstance(stored, ModelControl) and (
                stored.served_model == self.config.served_model_name) else set()
            if set(fitter.rows()) <= known:
                continue
            wall, now = time.time(), time.monotonic()
            rec = ModelControl(kind, self.config.served_model_name,
                               wall - max(now - fitter.fitted_at, 0.0),
                               tuple(fitter.model.coefficients()), fitter.rows())
            try:
                revision = await self.store.commit({}, {rec.key: encode(rec)})
            except StoreUnavailable as e:
                log.info("control_models_not_written", error=str(e))
                return
            if revision is not None:
                self._offer(rec.key, revision, rec)


def _unavailable(e: Exception) -> ControlUnavailable:
    return ControlUnavailable(f"the control state cannot be changed now: {e}; nothing changed "
                              "(serving goes on as it was)")
