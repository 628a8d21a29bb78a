"""conductorctl against an in-process fake Admin server (no conductor, no engines)."""

from __future__ import annotations

import json
import socket
import time
from concurrent import futures

import grpc
import pytest

from conductorctl import cli as ctl
from protos import admin_pb2, admin_pb2_grpc

TOKEN = "s3cret-token"


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    """Checks `authorization: Bearer TOKEN` and records (method, request) pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.metadata: list[dict[str, str]] = []

    def _check(self, name: str, request, context) -> None:
        md = dict(context.invocation_metadata())
        self.metadata.append(md)
        if md.get("authorization") != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token")
        self.calls.append((name, request))

    def ListInstances(self, request, context):
        self._check("ListInstances", request, context)
        return admin_pb2.ListInstancesReply(instances=[
            admin_pb2.Instance(instance_id="prefill-0", role="prefill", advertised_role="prefill",
                               address="127.0.0.1:50001", state="serving", in_flight=2,
                               cached_blocks=120),
            admin_pb2.Instance(instance_id="decode-0", role="decode", advertised_role="both",
                               address="127.0.0.1:50002", state="draining", in_flight=1,
                               running=3, kv_tokens=512, kv_capacity_tokens=16384,
                               cached_blocks=7),
            admin_pb2.Instance(instance_id="decode-9", role="decode", advertised_role="decode",
                               address="127.0.0.1:50009", state="mismatched",
                               mismatch="block size 64, the cluster's is 32"),
            admin_pb2.Instance(instance_id="decode-7", role="decode", advertised_role="decode",
                               address="127.0.0.1:50007", state="unhealthy", why="stalled"),
        ])

    def ResizePool(self, request, context):
        self._check("ResizePool", request, context)
        if request.target > 4:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "cannot start 8 both worker(s): this machine holds at most 4 engines")
        return admin_pb2.ResizePoolReply(role=request.role, target=request.target, before=1,
                                         after=request.target, started=["decode-1"],
                                         starting=["both-s0"] if request.role == "both" else [])

    def Drain(self, request, context):
        self._check("Drain", request, context)
        if request.instance_id == "nope":
            context.abort(grpc.StatusCode.NOT_FOUND, "no instance 'nope'")
        return admin_pb2.DrainReply(instance_id=request.instance_id, state="draining",
                                    in_flight=0, idle=True)

    def Undrain(self, request, context):
        self._check("Undrain", request, context)
        return admin_pb2.DrainReply(instance_id=request.instance_id, state="serving")

    def SetSLO(self, request, context):
        self._check("SetSLO", request, context)
        return admin_pb2.SetSLOReply(model=request.model or "tiny",
                                     ttft_ms=request.ttft_ms or 30000,
                                     tbt_ms=request.tbt_ms or 300)

    def SetPolicy(self, request, context):
        self._check("SetPolicy", request, context)
        return admin_pb2.PolicyReply(policy=request.policy or "kv_centric",
                                     disaggregate=request.disaggregate or "auto")

    def Prewarm(self, request, context):
        self._check("Prewarm", request, context)
        n = len(request.token_ids) or len(request.prompt.split())
        return admin_pb2.PrewarmReply(prompt_tokens=n, blocks=n // 32, blocks_written=n // 32,
                                      blocks_in_pool=n // 32, warmed=list(request.instances),
                                      seconds=0.25)

    def IndexStats(self, request, context):
        self._check("IndexStats", request, context)
        return admin_pb2.IndexStatsReply(
            blocks=127, max_blocks=1_000_000, memory_bytes=127 * 200, bytes_per_block=200,
            locations=[admin_pb2.LocationBlocks(location="/pool", blocks=100),
                       admin_pb2.LocationBlocks(location="prefill-0", blocks=120)],
            routed=10, reported_hit_tokens=300, prompt_tokens=1000, hit_ratio=0.3,
        )


@pytest.fixture
def admin(monkeypatch, tmp_path):
    """A fake Admin server; the env points conductorctl at it with the right token."""
    servicer = FakeAdmin()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name in ("KVCLUSTER_ADMIN_TOKEN", "KVCLUSTER_ADMIN_TOKEN_FILE", "KVCLUSTER_ADMIN_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no run/admin.token here
    monkeypatch.setattr(ctl, "_REPO", tmp_path)  # nor next to the package
    monkeypatch.setenv("KVCLUSTER_ADMIN_ADDR", f"127.0.0.1:{port}")
    monkeypatch.setenv("KVCLUSTER_ADMIN_TOKEN", TOKEN)
    servicer.port = port
    yield servicer
    server.stop(grace=None)


def test_instances_table(admin, capsys):
    assert ctl.main(["instances"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "ROLE", "STATE", "ADDRESS", "IN_FLIGHT", "RUNNING",
                              "KV_TOKENS/CAP", "CACHED_BLOCKS"]
    assert len(out) == 7
    assert out[-2:] == ["decode-9 mismatched: block size 64, the cluster's is 32",
                        "decode-7 unhealthy: stalled"]
    rows = {line.split()[0]: line for line in out[1:5]}
    assert "decode (both)" in rows["decode-0"] and "512/16384" in rows["decode-0"]
    assert rows["prefill-0"].split()[1:4] == ["prefill", "serving", "127.0.0.1:50001"]
    # aligned: every column starts at the same offset in every line
    start = out[0].index("STATE")
    assert all(line[start:].startswith(("STATE", "serving", "draining", "mismatched",
                                        "unhealthy")) for line in out[:5])
    assert admin.calls[0][0] == "ListInstances"


def test_json_any_position(admin, capsys):
    assert ctl.main(["--json", "instances"]) == 0
    data = json.loads(capsys.readouterr().out)
    ids = [i["instance_id"] for i in data["instances"]]
    assert ids == ["prefill-0", "decode-0", "decode-9", "decode-7"]
    assert ctl.main(["index", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["locations"][0] == {"location": "/pool", "blocks": "100"}


def test_resize_sends_role_target_wait(admin, capsys):
    assert ctl.main(["resize", "--role", "decode", "--target", "2", "--wait"]) == 0
    name, req = admin.calls[-1]
    assert name == "ResizePool"
    assert (req.role, req.target, req.wait) == ("decode", 2, True)
    assert 0 < req.timeout_s < ctl.LONG_TIMEOUT_S
    out = capsys.readouterr().out
    assert "after:" in out and "decode-1" in out
    assert ctl.main(["resize", "--role", "prefill", "--target", "0"]) == 0
    _, req = admin.calls[-1]
    assert (req.role, req.target, req.wait) == ("prefill", 0, False)
    assert ctl.main(["resize", "--role", "both", "--target", "2"]) == 0  # make run's pool
    _, req = admin.calls[-1]
    assert (req.role, req.target) == ("both", 2)
    assert "starting:  both-s0" in capsys.readouterr().out


def test_a_refused_resize_says_why(admin, capsys):
    assert ctl.main(["resize", "--role", "both", "--target", "9"]) == 1
    err = capsys.readouterr().err
    assert "conductorctl: FAILED_PRECONDITION: cannot start" in err and "at most 4" in err


def test_drain_undrain(admin, capsys):
    assert ctl.main(["drain", "decode-0", "--wait", "--timeout", "30"]) == 0
    _, req = admin.calls[-1]
    assert (req.instance_id, req.wait) == ("decode-0", True)
    assert 0 < req.timeout_s < 30
    assert "idle:" in capsys.readouterr().out
    assert ctl.main(["undrain", "decode-0"]) == 0
    name, req = admin.calls[-1]
    assert (name, req.instance_id, req.wait) == ("Undrain", "decode-0", False)
    assert "serving" in capsys.readouterr().out


def test_server_error_exit_1(admin, capsys):
    assert ctl.main(["drain", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("conductorctl: NOT_FOUND: no instance 'nope'")
    assert "hint" not in err


def test_slo_sends_values(admin, capsys):
    assert ctl.main(["slo", "--ttft-ms", "2000", "--tbt-ms", "100"]) == 0
    _, req = admin.calls[-1]
    assert (req.ttft_ms, req.tbt_ms, req.model) == (2000, 100, "")
    assert "ttft_ms: 2000" in capsys.readouterr().out
    assert ctl.main(["slo", "--tbt-ms", "50", "--model", "m"]) == 0
    _, req = admin.calls[-1]
    assert (req.ttft_ms, req.tbt_ms, req.model) == (0, 50, "m")


def test_policy_sends_what_is_given_and_shows_the_reply(admin, capsys):
    assert ctl.main(["policy", "--policy", "least_loaded"]) == 0
    _, req = admin.calls[-1]
    assert (req.policy, req.disaggregate) == ("least_loaded", "")
    assert capsys.readouterr().out.split() == ["policy:", "least_loaded", "disaggregate:",
                                               "auto"]
    assert ctl.main(["policy"]) == 0  # nothing to change: shows them
    _, req = admin.calls[-1]
    assert (req.policy, req.disaggregate) == ("", "")


def test_prewarm_file_text_ids(admin, capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a shared system prompt\nwith two lines\n")
    assert ctl.main(["prewarm", "--file", str(prompt), "--instance", "prefill-0",
                     "--instance", "decode-0", "--cache-salt", "salt"]) == 0
    _, req = admin.calls[-1]
    assert req.prompt == "a shared system prompt\nwith two lines\n"
    assert list(req.instances) == ["prefill-0", "decode-0"] and req.cache_salt == "salt"
    assert "warmed:" in capsys.readouterr().out
    assert ctl.main(["prewarm", "--token-ids", "1, 2,3"]) == 0
    assert list(admin.calls[-1][1].token_ids) == [1, 2, 3]
    assert ctl.main(["prewarm", "--text", "hello"]) == 0
    assert admin.calls[-1][1].prompt == "hello"


def test_index_stats(admin, capsys):
    assert ctl.main(["index"]) == 0
    out = capsys.readouterr().out
    assert "hit_ratio:" in out and "30.0%" in out
    table = out.split("\n\n")[1].splitlines()
    assert table[0].split() == ["LOCATION", "BLOCKS"]
    assert table[1].split() == ["prefill-0", "120"]  # most blocks first
    assert table[2].split() == ["/pool", "100"]


def test_token_from_file_flag_and_env_file(admin, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("KVCLUSTER_ADMIN_TOKEN")
    path = tmp_path / "tok"
    path.write_text(f"  {TOKEN}\n")
    assert ctl.main(["--token-file", str(path), "instances"]) == 0
    monkeypatch.setenv("KVCLUSTER_ADMIN_TOKEN_FILE", str(path))
    assert ctl.main(["instances"]) == 0
    assert admin.metadata[-1]["authorization"] == f"Bearer {TOKEN}"


def test_token_from_run_dir(admin, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("KVCLUSTER_ADMIN_TOKEN")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "admin.token").write_text(TOKEN + "\n")
    assert ctl.main(["instances"]) == 0


def test_wrong_or_missing_token(admin, capsys, monkeypatch):
    monkeypatch.setenv("KVCLUSTER_ADMIN_TOKEN", "wrong")
    assert ctl.main(["instances"]) == 1
    err = capsys.readouterr().err
    assert "conductorctl: UNAUTHENTICATED: missing or wrong admin token" in err
    assert "--token-file" in err
    monkeypatch.delenv("KVCLUSTER_ADMIN_TOKEN")
    assert ctl.main(["resize", "--role", "decode", "--target", "1"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert "authorization" not in admin.metadata[-1]
    assert admin.calls == []  # nothing got through


def test_missing_token_file(admin, capsys, tmp_path):
    assert ctl.main(["--token-file", str(tmp_path / "nope"), "instances"]) == 2
    assert "token file" in capsys.readouterr().err


def test_unreachable_address(capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KVCLUSTER_ADMIN_TOKEN", TOKEN)
    t0 = time.monotonic()
    assert ctl.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "instances"]) == 1
    assert time.monotonic() - t0 < 4
    err = capsys.readouterr().err
    assert "conductorctl: UNAVAILABLE" in err and f"127.0.0.1:{port}" in err


@pytest.mark.parametrize("argv", [
    [],
    ["resize", "--role", "router", "--target", "1"],
    ["resize", "--role", "decode", "--target", "-1"],
    ["prewarm"],
    ["prewarm", "--text", "a", "--file", "b"],
    ["prewarm", "--token-ids", "1,x"],
    ["slo", "--ttft-ms", "-5"],
    ["policy", "--disaggregate", "sometimes"],
    ["instances", "--token", "abc"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ctl.main(argv)
    assert e.value.code == 2


def test_help_warns_about_token_flags(capsys):
    with pytest.raises(SystemExit):
        ctl.main(["--help"])
    out = capsys.readouterr().out
    assert "--token-file" in out and "ps" in out
