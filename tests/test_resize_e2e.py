"""The operator's lever on the pool `make run` starts on a small machine: `conductorctl resize
--role both` on an embedded cluster of one `both` engine, to 2 (a real engine started by the
conductor, a retry starting none) and back (the started one drained and retired), requests
served throughout."""

from __future__ import annotations

import grpc
import httpx
import psutil
import pytest
from conftest import wait_until

from conductorctl import cli as ctl
from embedded import ClusterSpec, EmbeddedCluster
from protos import admin_pb2, admin_pb2_grpc


def _instances(c: EmbeddedCluster) -> dict[str, admin_pb2.Instance]:
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(c.admin_addr))
    md = (("authorization", f"Bearer {c.token_file.read_text().strip()}"),)
    reply = stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=md, timeout=10)
    return {i.instance_id: i for i in reply.instances}


def _ctl(c: EmbeddedCluster, *argv: str) -> int:
    return ctl.main(["--addr", c.admin_addr, "--token-file", str(c.token_file), *argv])


def _complete(c: EmbeddedCluster, n: int) -> int:
    return httpx.post(f"{c.url}/v1/completions", timeout=120, json={
        "prompt": f"request {n}: " + "tell me more " * 10, "max_tokens": 4,
        "temperature": 0}).status_code


def _tree_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, proportional share (PSS), MiB."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_full_info().pss for p in procs) / 2**20


@pytest.mark.engine
def test_resize_both_to_two_and_back_through_conductorctl(model_dir, tmp_path, capsys):
    spec = ClusterSpec(model=model_dir, prefill=0, decode=0, both=1, http_port=0,
                       run_dir=str(tmp_path / "run"), dtype="float32",
                       kv_cache_bytes=192 << 20, pool_segment_bytes=256 << 20,
                       conductor_args=("--ttft-slo-s", "600", "--tbt-slo-s", "30"))
    c = EmbeddedCluster(spec)
    c.start(timeout=600)
    try:
        assert {i.role for i in _instances(c).values()} == {"both"}
        assert _ctl(c, "resize", "--role", "both", "--target", "2", "--wait",
                    "--timeout", "300") == 0
        out = capsys.readouterr().out
        assert "started:   both-s0" in out and "after:     2" in out, out
        assert {(i.role, i.state) for i in _instances(c).values()} == {("both", "serving")}
        assert len(_instances(c)) == 2
        assert [_complete(c, n) for n in range(4)] == [200] * 4
        provisioner_pid = c.conductor.pid
        started = [p for p in psutil.Process(provisioner_pid).children()
                   if "both-s0" in " ".join(p.cmdline())]
        assert len(started) == 1
        with capsys.disabled():
            print(f"\nan engine started by ResizePool: PSS {_tree_mib(started[0].pid):.0f} "
                  f"MiB (kv cache {spec.kv_cache_bytes >> 20} MiB)")
        # a client's retry: nothing more starts
        assert _ctl(c, "resize", "--role", "both", "--target", "2") == 0
        out = capsys.readouterr().out
        assert "started:   -" in out and "after:     2" in out, out
        # back to one: the started engine leaves routing, deregisters and exits
        assert _ctl(c, "resize", "--role", "both", "--target", "1") == 0
        assert "drained:   both-s0" in capsys.readouterr().out
        wait_until(lambda: set(_instances(c)) == {"both-0"}, 60, interval=0.2,
                   what="both-s0 retired")
        wait_until(lambda: not started[0].is_running()
                   or started[0].status() == psutil.STATUS_ZOMBIE, 60, interval=0.2,
                   what="both-s0's process exited")
        assert [_complete(c, n) for n in range(4, 8)] == [200] * 4
    finally:
        c.stop()
