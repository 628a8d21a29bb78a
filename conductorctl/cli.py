"""conductorctl: operate a running conductor through its gRPC admin API (protos/admin.proto).

    conductorctl instances                                  # the instances and their load
    conductorctl resize --role decode --target 2 --wait     # grow/shrink a pool (prefill,
                                                            # decode or both)
    conductorctl drain decode-0 --wait                      # stop routing to an instance
    conductorctl undrain decode-0
    conductorctl slo --ttft-ms 2000 --tbt-ms 100            # default SLOs (0/omitted: unchanged)
    conductorctl policy --policy kv_centric --disaggregate auto   # routing (omitted: unchanged)
    conductorctl prewarm --file prompt.txt [--instance ID ...]
    conductorctl index                                      # the global KV index
    conductorctl tenants                                    # tenants' limits and use
    conductorctl tenant acme --max-concurrency 8 --tokens-per-s 20000 --priority batch
    conductorctl --json instances                           # any reply as JSON

Address: --addr, else $KVCLUSTER_ADMIN_ADDR, else 127.0.0.1:8001.
Token (sent as `authorization: Bearer <token>`): --token-file PATH, else $KVCLUSTER_ADMIN_TOKEN,
else the file named by $KVCLUSTER_ADMIN_TOKEN_FILE, else run/admin.token if it exists (where
`make run` writes it). There is deliberately no flag taking the token itself: it would show in
`ps` and in shell history.

Exit status: 0 ok, 1 the call failed (`conductorctl: <CODE>: <details>` on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format

from conductor.resize import ROLES
from protos import admin_pb2, admin_pb2_grpc

DEFAULT_ADDR = "127.0.0.1:8001"
DEFAULT_TIMEOUT_S = 10.0
LONG_TIMEOUT_S = 600.0  # resize/drain with --wait, prewarm
TOKEN_PATH = Path("run") / "admin.token"
_REPO = Path(__file__).resolve().parent.parent


class UsageError(Exception):
    """A problem with the command line or its inputs: exit status 2."""


# ---------------------------------------------------------------------------------------------
# Arguments


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not ids or any(i < 0 or i >= 2**32 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be non-empty and in [0, 2^32): {text!r}")
    return ids


def _number(kind: type, text: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: "
                                         f"{text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _non_negative(text: str) -> float:
    return _number(float, text)


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _target(text: str) -> int:
    return int(_number(int, text))


def _common_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The connection options, accepted before or after the subcommand."""
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "--addr", default=default,
        help=f"admin API host:port (env KVCLUSTER_ADMIN_ADDR, default {DEFAULT_ADDR})",
    )
    parser.add_argument(
        "--token-file", default=default, metavar="PATH",
        help="file holding the admin token (else env KVCLUSTER_ADMIN_TOKEN, else the file "
             "named by KVCLUSTER_ADMIN_TOKEN_FILE, else run/admin.token); the token itself "
             "is never taken as a flag, so that it does not show in `ps`",
    )
    parser.add_argument(
        "--timeout", type=_positive, default=default, metavar="S",
        help=f"deadline of the call in seconds (default {DEFAULT_TIMEOUT_S:g}; "
             f"{LONG_TIMEOUT_S:g} for resize/drain --wait and prewarm)",
    )
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS if suppress else False,
        help="print the reply as JSON (proto field names)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conductorctl",
        allow_abbrev=False,  # `--token x` must not pass for `--token-file x`
        description="Operate a running conductor through its gRPC admin API.",
        epilog="Token lookup: --token-file, $KVCLUSTER_ADMIN_TOKEN, $KVCLUSTER_ADMIN_TOKEN_FILE, "
               "run/admin.token. Never pass the token itself on the command line.",
    )
    _common_options(p, suppress=False)
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _common_options(common, suppress=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], allow_abbrev=False, **kwargs)

    add("instances", help="list instances, routing state and load")

    s = add("resize",
                       help="bring the number of instances serving a role to a target")
    s.add_argument("--role", required=True, choices=ROLES,
                   help="prefill or decode: the instances serving that role (those routed as "
                   "both too); both: the instances routed as both")
    s.add_argument("--target", required=True, type=_target, metavar="N")
    s.add_argument("--wait", action="store_true",
                   help="return once started instances are routable (bounded by --timeout)")

    s = add("drain",
                       help="stop routing new requests to an instance (in-flight ones finish)")
    s.add_argument("instance_id", metavar="ID")
    s.add_argument("--wait", action="store_true",
                   help="return once its in-flight requests finished (bounded by --timeout)")

    s = add("undrain", help="route to a drained instance again")
    s.add_argument("instance_id", metavar="ID")

    s = add("slo",
                       help="set the default SLOs (an omitted or 0 value stays unchanged)")
    s.add_argument("--ttft-ms", type=_non_negative, default=0.0, metavar="MS",
                   help="time to first token")
    s.add_argument("--tbt-ms", type=_non_negative, default=0.0, metavar="MS",
                   help="time between tokens")
    s.add_argument("--model", default="", help="model name (default: the served model)")

    s = add("policy", help="set the routing policy (an omitted value stays unchanged; none: "
                           "show them)")
    s.add_argument("--policy", default="", metavar="NAME",
                   help="kv_centric, cache_aware, least_loaded, round_robin or random")
    s.add_argument("--disaggregate", default="", choices=("auto", "always", "never"),
                   help="when kv_centric computes a prompt on a prefill instance")

    s = add("prewarm",
                       help="prefill a shared prefix into the pool ahead of its traffic")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", metavar="PATH",
                     help="prompt text file, used verbatim ('-': stdin)")
    src.add_argument("--text", help="prompt text")
    src.add_argument("--token-ids", type=_token_ids, metavar="1,2,3",
                     help="comma-separated token ids")
    s.add_argument("--instance", action="append", default=[], metavar="ID",
                   help="also prefill it into this instance's engine cache (repeatable)")
    s.add_argument("--cache-salt", default="", metavar="S")

    add("index", help="global KV index size, memory and hit figures")

    add("tenants", help="tenants' limits and their use now")
    s = add("tenant", help="set a tenant's limits ('*': tenants without their own); an "
                           "omitted value stays unchanged")
    s.add_argument("tenant", metavar="NAME")
    s.add_argument("--max-concurrency", type=_target, metavar="N",
                   help="requests in flight at once (0: no limit)")
    s.add_argument("--tokens-per-s", type=_non_negative, metavar="R",
                   help="prompt + output tokens per second (0: no limit)")
    s.add_argument("--priority", choices=("interactive", "batch"),
                   help="the highest class its requests run in")
    s.add_argument("--may-loosen-slo", choices=("true", "false"),
                   help="its requests may ask for looser SLOs than the operator's")
    s.add_argument("--reset", action="store_true",
                   help="back to the default's limits first")
    return p


# ---------------------------------------------------------------------------------------------
# Connection


def read_token(token_file: str | None, environ: dict[str, str] | None = None) -> str:
    """The admin token per the lookup order in the module docstring; "" when none is known."""
    env = os.environ if environ is None else environ
    if token_file:
        return _read_token_file(Path(token_file), "--token-file")
    if env.get("KVCLUSTER_ADMIN_TOKEN", "").strip():
        return env["KVCLUSTER_ADMIN_TOKEN"].strip()
    if env.get("KVCLUSTER_ADMIN_TOKEN_FILE"):
        return _read_token_file(Path(env["KVCLUSTER_ADMIN_TOKEN_FILE"]),
                                "KVCLUSTER_ADMIN_TOKEN_FILE")
    for path in (TOKEN_PATH, _REPO / TOKEN_PATH):
        if path.is_file():
            return _read_token_file(path, str(path))
    return ""


def _read_token_file(path: Path, source: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise UsageError(f"cannot read the token file ({source}): {e}") from None
    if not token:
        raise UsageError(f"the token file {path} ({source}) is empty")
    return token


def _timeout(args: argparse.Namespace, long: bool) -> float:
    if args.timeout is not None:
        return args.timeout
    return LONG_TIMEOUT_S if long else DEFAULT_TIMEOUT_S


def _wait_budget(deadline_s: float) -> float:
    """The server-side wait (`timeout_s`): a little under the call's deadline, so that the
    conductor answers with what it reached instead of the call ending in DEADLINE_EXCEEDED."""
    return max(0.1, deadline_s - min(5.0, deadline_s * 0.1))


def _request(args: argparse.Namespace) -> tuple[str, object, bool]:
    """(RPC method name, request message, whether the call can take long)."""
    cmd = args.command
    if cmd == "instances":
        return "ListInstances", admin_pb2.ListInstancesRequest(), False
    if cmd == "resize":
        req = admin_pb2.ResizePoolRequest(role=args.role, target=args.target, wait=args.wait)
        if args.wait:
            req.timeout_s = _wait_budget(_timeout(args, True))
        return "ResizePool", req, args.wait
    if cmd in ("drain", "undrain"):
        req = admin_pb2.DrainRequest(instance_id=args.instance_id)
        wait = cmd == "drain" and args.wait
        if wait:
            req.wait = True
            req.timeout_s = _wait_budget(_timeout(args, True))
        return cmd.capitalize(), req, wait
    if cmd == "slo":
        req = admin_pb2.SetSLORequest(ttft_ms=args.ttft_ms, tbt_ms=args.tbt_ms, model=args.model)
        return "SetSLO", req, False
    if cmd == "policy":
        req = admin_pb2.SetPolicyRequest(policy=args.policy, disaggregate=args.disaggregate)
        return "SetPolicy", req, False
    if cmd == "prewarm":
        req = admin_pb2.PrewarmRequest(instances=args.instance, cache_salt=args.cache_salt)
        if args.token_ids is not None:
            req.token_ids.extend(args.token_ids)
        else:
            req.prompt = args.text if args.text is not None else _read_prompt(args.file)
            if not req.prompt:
                raise UsageError("the prompt is empty")
        return "Prewarm", req, True
    if cmd == "index":
        return "IndexStats", admin_pb2.IndexStatsRequest(), False
    if cmd == "tenants":
        return "ListTenants", admin_pb2.ListTenantsRequest(), False
    if cmd == "tenant":
        req = admin_pb2.SetTenantLimitsRequest(tenant=args.tenant, reset=args.reset)
        if args.max_concurrency is not None:
            req.max_concurrency = args.max_concurrency
        if args.tokens_per_s is not None:
            req.tokens_per_s = args.tokens_per_s
        if args.priority is not None:
            req.priority = args.priority
        if args.may_loosen_slo is not None:
            req.may_loosen_slo = args.may_loosen_slo == "true"
        return "SetTenantLimits", req, False
    raise UsageError(f"unknown command {cmd!r}")  # argparse prevents this


def _read_prompt(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the prompt file: {e}") from None


# ---------------------------------------------------------------------------------------------
# Output


def table(header: Sequence[str], rows: Sequence[Sequence[object]],
          right: Sequence[bool] | None = None) -> str:
    """Aligned plain-text columns; `right[i]` right-aligns column i (numbers)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = right or [False] * len(header)
    lines = []
    for r in cells:
        parts = [c.rjust(w) if ra else c.ljust(w)
                 for c, w, ra in zip(r, widths, right, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _names(values: Sequence[str]) -> str:
    return ", ".join(values) if values else "-"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # unreachable


def _keys(pairs: Sequence[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in pairs) + 1
    return "\n".join(f"{k + ':':<{width}} {v}" for k, v in pairs)


def _fmt_instances(reply: admin_pb2.ListInstancesReply) -> str:
    if not reply.instances:
        return "no instances"
    rows = []
    for i in sorted(reply.instances, key=lambda i: (i.role, i.instance_id)):
        role = i.role
        if i.advertised_role and i.advertised_role != i.role:
            role += f" ({i.advertised_role})"
        kv = f"{i.kv_tokens}/{i.kv_capacity_tokens}" if i.kv_capacity_tokens else str(i.kv_tokens)
        rows.append([i.instance_id, role, i.state, i.address, i.in_flight, i.running, kv,
                     i.cached_blocks])
    header = ["ID", "ROLE", "STATE", "ADDRESS", "IN_FLIGHT", "RUNNING", "KV_TOKENS/CAP",
              "CACHED_BLOCKS"]
    ordered = sorted(reply.instances, key=lambda i: i.instance_id)
    why = [f"{i.instance_id} mismatched: {i.mismatch}" for i in ordered if i.mismatch]
    why += [f"{i.instance_id} unhealthy: {i.why}" for i in ordered if i.why]
    return "\n".join([table(header, rows, [False] * 4 + [True] * 4), *why])


def _fmt_resize(r: admin_pb2.ResizePoolReply) -> str:
    pairs: list[tuple[str, object]] = [
        ("role", r.role), ("target", r.target), ("before", r.before), ("after", r.after),
        ("started", _names(r.started)), ("starting", _names(r.starting)),
        ("undrained", _names(r.undrained)), ("switched", _names(r.switched)),
        ("drained", _names(r.drained)), ("cancelled", _names(r.cancelled)),
    ]
    if r.unmet:
        pairs.append(("unmet", r.unmet))
    return _keys(pairs)


def _fmt_drain(r: admin_pb2.DrainReply) -> str:
    return _keys([("instance", r.instance_id), ("state", r.state), ("in_flight", r.in_flight),
                  ("idle", "yes" if r.idle else "no")])


def _fmt_slo(r: admin_pb2.SetSLOReply) -> str:
    return _keys([("model", r.model), ("ttft_ms", f"{r.ttft_ms:g}"), ("tbt_ms", f"{r.tbt_ms:g}")])


def _fmt_policy(r: admin_pb2.PolicyReply) -> str:
    return _keys([("policy", r.policy), ("disaggregate", r.disaggregate)])


def _fmt_prewarm(r: admin_pb2.PrewarmReply) -> str:
    return _keys([
        ("prompt_tokens", r.prompt_tokens), ("blocks", r.blocks),
        ("blocks_written", r.blocks_written), ("blocks_in_pool", r.blocks_in_pool),
        ("warmed", _names(r.warmed)), ("seconds", f"{r.seconds:.3f}"),
    ])


def _fmt_index(r: admin_pb2.IndexStatsReply) -> str:
    ratio = f"{r.hit_ratio:.1%}" if r.prompt_tokens else "-"
    head = _keys([
        ("blocks", f"{r.blocks} / {r.max_blocks}"),
        ("memory", f"{_bytes(r.memory_bytes)} ({r.bytes_per_block:g} B/block)"),
        ("forgotten", r.forgotten),
        ("routed", r.routed), ("rejected", r.rejected), ("local_prefills", r.local_prefills),
        ("predicted_hit_tokens", r.predicted_hit_tokens),
        ("reported_hit_tokens", r.reported_hit_tokens),
        ("prompt_tokens", r.prompt_tokens), ("hit_ratio", ratio),
    ])
    if not r.locations:
        return head + "\n\nno locations"
    rows = [[loc.location, loc.blocks]
            for loc in sorted(r.locations, key=lambda loc: (-loc.blocks, loc.location))]
    return head + "\n\n" + table(["LOCATION", "BLOCKS"], rows, [False, True])


def _limit(value: float) -> str:
    return f"{value:g}" if value else "-"


def _tenant_row(t: admin_pb2.TenantStatus) -> list[object]:
    return [t.tenant or '""', _limit(t.max_concurrency), _limit(t.tokens_per_s), t.priority,
            "yes" if t.may_loosen_slo else "no", "own" if t.own_limits else "default",
            t.in_flight, f"{t.tokens_available:.0f}" if t.tokens_per_s else "-", t.admitted,
            t.rejected]


_TENANT_HEADER = ["TENANT", "MAX_CONCURRENCY", "TOKENS/S", "PRIORITY", "LOOSEN_SLO", "LIMITS",
                  "IN_FLIGHT", "TOKENS_NOW", "ADMITTED", "REJECTED"]
_TENANT_RIGHT = [False, True, True, False, False, False, True, True, True, True]


def _fmt_tenants(r: admin_pb2.ListTenantsReply) -> str:
    rows = [_tenant_row(t) for t in r.tenants]
    return table(_TENANT_HEADER, rows, _TENANT_RIGHT) + f"\n\nbatch_queued: {r.batch_queued}"


def _fmt_tenant(t: admin_pb2.TenantStatus) -> str:
    return table(_TENANT_HEADER, [_tenant_row(t)], _TENANT_RIGHT)


_FORMATTERS: dict[str, Callable[..., str]] = {
    "ListInstances": _fmt_instances, "ResizePool": _fmt_resize, "Drain": _fmt_drain,
    "Undrain": _fmt_drain, "SetSLO": _fmt_slo, "SetPolicy": _fmt_policy,
    "Prewarm": _fmt_prewarm,
    "IndexStats": _fmt_index, "ListTenants": _fmt_tenants, "SetTenantLimits": _fmt_tenant,
}


def to_dict(message) -> dict:
    """The reply as a JSON-ready dict, with proto field names and zero values included."""
    try:
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26
        return json_format.MessageToDict(message, preserving_proto_field_name=True)


# ---------------------------------------------------------------------------------------------
# Main


def _hint(code: grpc.StatusCode, details: str, addr: str) -> str:
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ("hint: pass the admin token with --token-file PATH, $KVCLUSTER_ADMIN_TOKEN or "
                "$KVCLUSTER_ADMIN_TOKEN_FILE (`make run` writes run/admin.token; "
                "deploy/conductor.sh writes $KVCLUSTER_STATE_DIR/admin.token)")
    connect_words = ("connect", "resolv", "dns", "unreachable", "socket closed")
    if code == grpc.StatusCode.UNAVAILABLE and any(w in details.lower() for w in connect_words):
        return (f"hint: is the conductor's admin API listening on {addr}? Set --addr or "
                "$KVCLUSTER_ADMIN_ADDR (the conductor's admin_host:admin_port; admin_port 0 "
                "turns the admin API off)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "hint: raise --timeout"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "hint: the server at this address is not a conductor with the admin API"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    addr = args.addr or os.environ.get("KVCLUSTER_ADMIN_ADDR") or DEFAULT_ADDR
    try:
        token = read_token(args.token_file)
        method, request, long = _request(args)
    except UsageError as e:
        print(f"conductorctl: {e}", file=sys.stderr)
        return 2
    metadata = [("authorization", f"Bearer {token}")] if token else []
    try:
        with grpc.insecure_channel(addr) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            reply = getattr(stub, method)(request, timeout=_timeout(args, long),
                                          metadata=metadata)
    except grpc.RpcError as e:
        code = e.code()
        name = code.name if code is not None else "UNKNOWN"
        details = e.details() or ""
        print(f"conductorctl: {name}: {details}", file=sys.stderr)
        hint = _hint(code, details, addr)
        if hint:
            print(hint, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(to_dict(reply), indent=2))
    else:
        print(_FORMATTERS[method](reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
