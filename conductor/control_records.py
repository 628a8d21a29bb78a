"""The control state's records as they are stored: one typed, frozen record per key, encoded
as one JSON object carrying its schema version, validated whole on decode.

Keys, under the control prefix (`ConductorConfig.control_prefix`):

- `instances/<instance id>`: `InstanceControl`, drained, and the role it is routed as
  (absent: serving, as registered)
- `slo`: `SloControl`, the default TTFT and TBT SLOs (absent: the configured ones)
- `policy`: `PolicyControl`, the routing policy and `disaggregate` (absent: the configured)
- `tenants/<tenant>`: `TenantControl`, its limits, or none of its own (absent: as
  `tenant_limits_file` says)
- `models/prefill`, `models/tbt`: `ModelControl`, a fitted time model and the timings it was
  fitted from (absent: the prior)

`decode` raises `RecordError` for anything but a whole, valid record of the schema this
process knows, under the key it names: a record written by a newer schema, a truncated
value, a value of another kind, an unknown or missing field, a value out of range. Such a
record is never acted on (`conductor.control_state`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from conductor.config import DISAGGREGATE, POLICIES
from conductor.resize import ROLES
from conductor.scheduler.regression import Row
from conductor.tenants import Limits, check_name

SCHEMA = 1
"""The version of every record's layout; a process acts only on records of its own."""
MAX_ROWS = 1024
"""The most observations a model record may carry."""
MAX_ID = 253
_ID = re.compile(r"[!-~]+", re.ASCII)  # printable ASCII, no spaces: as `cluster.instance`
MODEL_KINDS = {"prefill": 3, "tbt": 3}
"""The fitted models, with their number of coefficients (and features per observation)."""


class RecordError(ValueError):
    """A stored value that is not a valid record of this schema under its key."""


@dataclass(frozen=True)
class InstanceControl:
    """What the operator (Drain, ResizePool) set for one instance id. It names the id, not
    one process: a drained worker that restarts under the same id is still drained."""

    instance_id: str
    draining: bool = False
    role: str = ""
    """The role it is routed as when registered as "both" (ResizePool switches it); "": as
    registered."""

    def __post_init__(self) -> None:
        if not (isinstance(self.instance_id, str) and 0 < len(self.instance_id) <= MAX_ID
                and _ID.fullmatch(self.instance_id)):
            raise RecordError(f"an instance id is 1-{MAX_ID} printable characters without "
                              "spaces")
        _check(isinstance(self.draining, bool), "draining must be true or false")
        _check(self.role in ("", *ROLES), f"role must be one of {ROLES} or empty")

    @property
    def key(self) -> str:
        return f"instances/{self.instance_id}"

    @property
    def default(self) -> bool:
        """Says nothing an absent record would not: stored as no record."""
        return not self.draining and not self.role


@dataclass(frozen=True)
class SloControl:
    ttft_slo_s: float
    tbt_slo_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tbt_slo_s"):
            v = getattr(self, name)
            _check(_number(v) and 0 < v <= 86400.0, f"{name} must be in (0, 86400]")

    key = "slo"
    default = False


@dataclass(frozen=True)
class PolicyControl:
    policy: str
    disaggregate: str

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}")
        _check(self.disaggregate in DISAGGREGATE, f"disaggregate must be one of {DISAGGREGATE}")

    key = "policy"
    default = False


@dataclass(frozen=True)
class TenantControl:
    tenant: str
    limits: Limits | None
    """None: no limits of its own (the default's; for `*` itself: none), whatever
    `tenant_limits_file` gives it."""

    def __post_init__(self) -> None:
        try:
            check_name(self.tenant)
        except ValueError as e:
            raise RecordError(str(e)) from None
        _check(self.limits is None or isinstance(self.limits, Limits), "limits malformed")

    @property
    def key(self) -> str:
        return f"tenants/{self.tenant}"

    default = False


@dataclass(frozen=True)
class ModelControl:
    """A fitted time model (`conductor.scheduler.regression.Fitter`) of one served model:
    its coefficients, the wall-clock time they were fitted at, and the observations they
    were fitted from, each with the wall-clock time it was taken."""

    fitted: str
    """Which model: one of `MODEL_KINDS`."""
    served_model: str
    """The model its timings are of (`ConductorConfig.served_model_name`)."""
    fitted_at: float
    coefficients: tuple[float, ...]
    rows: tuple[Row, ...]

    def __post_init__(self) -> None:
        n = MODEL_KINDS.get(self.fitted)
        _check(n is not None, f"fitted must be one of {sorted(MODEL_KINDS)}")
        _check(isinstance(self.served_model, str) and 0 < len(self.served_model) <= 512,
               "served_model must be a name")
        _check(_number(self.fitted_at) and self.fitted_at >= 0, "fitted_at must be a time")
        _check(len(self.coefficients) == n and all(
            _number(c) and c >= 0 for c in self.coefficients),
            f"coefficients must be {n} finite numbers >= 0")
        _check(len(self.rows) <= MAX_ROWS, f"at most {MAX_ROWS} rows")
        for features, seconds, wall in self.rows:
            _check(len(features) == n and all(_number(f) for f in features)
                   and _number(seconds) and seconds > 0 and _number(wall) and wall >= 0,
                   f"a row is {n} finite features, seconds > 0 and a wall time")

    @property
    def key(self) -> str:
        return f"models/{self.fitted}"

    default = False


Record = InstanceControl | SloControl | PolicyControl | TenantControl | ModelControl


def encode(record: Record) -> bytes:
    """The stored form: one JSON object, `schema` and `kind` first."""
    if isinstance(record, InstanceControl):
        body: dict[str, Any] = {"kind": "instance", "instance_id": record.instance_id,
                                "draining": record.draining, "role": record.role}
    elif isinstance(record, SloControl):
        body = {"kind": "slo", "ttft_slo_s": record.ttft_slo_s, "tbt_slo_s": record.tbt_slo_s}
    elif isinstance(record, PolicyControl):
        body = {"kind": "policy", "policy": record.policy, "disaggregate": record.disaggregate}
    elif isinstance(record, TenantControl):
        lim = record.limits
        body = {"kind": "tenant", "tenant": record.tenant, "limits": None if lim is None else {
            "max_concurrency": lim.max_concurrency, "tokens_per_s": lim.tokens_per_s,
            "priority": lim.priority, "may_loosen_slo": lim.may_loosen_slo}}
    else:
        body = {"kind": "model", "fitted": record.fitted, "served_model": record.served_model,
                "fitted_at": record.fitted_at, "coefficients": list(record.coefficients),
                "rows": [[*f, s, w] for f, s, w in record.rows]}
    return json.dumps({"schema": SCHEMA, **body}, separators=(",", ":"),
                      allow_nan=False).encode()


def decode(key: str, value: bytes) -> Record:
    """The record stored under `key` (relative to the control prefix); RecordError for
    anything else (see the module)."""
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RecordError("not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise RecordError(f"schema {doc.get('schema')!r}, this process reads {SCHEMA}")
    kind = doc.get("kind")
    fields = {k: v for k, v in doc.items() if k not in ("schema", "kind")}
    try:
        record = _build(kind, fields)
    except (TypeError, ValueError) as e:  # RecordError, Limits' ValueError, wrong types
        raise RecordError(f"{kind} record: {e}") from None
    if record.key != key:
        raise RecordError(f"a {kind} record for {record.key!r} stored under {key!r}")
    return record


def _build(kind: object, f: dict[str, Any]) -> Record:
    if kind == "instance":
        _fields(f, {"instance_id", "draining", "role"})
        return InstanceControl(f["instance_id"], f["draining"], f["role"])
    if kind == "slo":
        _fields(f, {"ttft_slo_s", "tbt_slo_s"})
        return SloControl(f["ttft_slo_s"], f["tbt_slo_s"])
    if kind == "policy":
        _fields(f, {"policy", "disaggregate"})
        return PolicyControl(f["policy"], f["disaggregate"])
    if kind == "tenant":
        _fields(f, {"tenant", "limits"})
        lim = f["limits"]
        if lim is not None:
            _check(isinstance(lim, dict), "limits must be an object or null")
            _fields(lim, {"max_concurrency", "tokens_per_s", "priority", "may_loosen_slo"})
            lim = Limits(**lim)
        return TenantControl(f["tenant"], lim)
    if kind == "model":
        _fields(f, {"fitted", "served_model", "fitted_at", "coefficients", "rows"})
        _check(isinstance(f["coefficients"], list) and isinstance(f["rows"], list)
               and all(isinstance(r, list) and len(r) >= 2 for r in f["rows"]),
               "coefficients and rows must be lists")
        rows = tuple((tuple(r[:-2]), r[-2], r[-1]) for r in f["rows"])
        return ModelControl(f["fitted"], f["served_model"], f["fitted_at"],
                            tuple(f["coefficients"]), rows)
    raise RecordError(f"unknown kind {kind!r}")


def _fields(f: dict[str, Any], names: set[str]) -> None:
    if set(f) != names:
        raise RecordError(f"fields must be exactly {sorted(names)}, got {sorted(f)}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RecordError(message)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
