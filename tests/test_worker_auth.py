"""The worker plane's cluster secret (`cluster.secret`): the conductor's calls carry a token
bound to the worker's address, workers refuse anything else before a servicer runs, and the
conductor routes only to instances that proved they hold the secret. Real gRPC servers with
fake servicers and the real conductor app; the refusal by a real worker is in test_e2e."""

from __future__ import annotations

import grpc
import httpx
import pytest
from conftest import wait_until
from fake_worker import LocalConductor

from cluster import plane_tls
from cluster.plane_tls import PlaneTLS
from cluster.secret import ClusterSecret, bind
from protos import worker_pb2, worker_pb2_grpc


@pytest.fixture
def secret_file(tmp_path) -> str:
    return str(ClusterSecret.create(tmp_path / "cluster.secret"))


def test_tokens_and_proofs_are_bound_to_the_address_and_the_secret(tmp_path):
    a, b = ClusterSecret(b"s" * 32), ClusterSecret(b"t" * 32)
    assert a.token("h:1") != a.token("h:2")
    assert a.token("h:1") != b.token("h:1")
    proof = a.proof("h:1", "n1")
    assert a.proves("h:1", "n1", proof)
    assert not a.proves("h:2", "n1", proof)
    assert not a.proves("h:1", "n2", proof)
    assert not b.proves("h:1", "n1", proof)
    assert not a.proves("h:1", "n1", "")
    with pytest.raises(ValueError, match="at least"):
        ClusterSecret(b"short")
    assert ClusterSecret.load("") is None
    with pytest.raises(ValueError, match="unreadable"):
        ClusterSecret.load(str(tmp_path / "missing"))
    made = ClusterSecret.create(tmp_path / "s")
    assert made.stat().st_mode & 0o777 == 0o600
    assert ClusterSecret.load(str(made)) is not None


def _served(c: LocalConductor, n: int) -> None:
    for i in range(n):
        r = httpx.post(f"{c.url}/v1/completions", timeout=30,
                       json={"prompt": f"request {i} " * 40, "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_the_conductor_routes_only_to_workers_that_prove_the_secret(model_dir, secret_file):
    roles = ("prefill", "decode", "decode", "prefill")
    with LocalConductor(model_dir, roles=roles, secret_file=secret_file,
                        impostors=("decode-1", "prefill-1"),
                        conductor_args=("--disaggregate", "always")) as c:
        registry = c.app.state.conductor.registry
        wait_until(lambda: registry.get("decode-0").state == "serving", 10)
        wait_until(lambda: registry.get("prefill-0").state == "serving", 10)
        _served(c, 8)
        assert registry.get("decode-1").state == "unverified"
        assert registry.get("prefill-1").state == "unverified"
        for iid in ("decode-1", "prefill-1"):
            counts = c.workers[iid].counts
            assert (counts.prefills, counts.generates) == (0, 0), iid
        assert c.workers["decode-0"].counts.generates == 8
        assert c.workers["prefill-0"].counts.prefills == 8


def test_a_worker_refuses_calls_without_its_token_before_anything_runs(model_dir, secret_file):
    with LocalConductor(model_dir, secret_file=secret_file) as c:
        secret = ClusterSecret.load(secret_file)
        assert secret is not None
        address = c.addresses["prefill-0"]
        other = c.addresses["decode-0"]
        fake = c.workers["prefill-0"]
        request = worker_pb2.PrefillRequest(request_id="x", token_ids=[1, 2, 3])
        with grpc.insecure_channel(address) as ch:
            bare = worker_pb2_grpc.WorkerStub(ch)
            for md in ((), (("x-kvcluster-token", "guess"),), secret.metadata(other)):
                with pytest.raises(grpc.RpcError) as e:
                    bare.Prefill(request, metadata=md, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    list(bare.Generate(worker_pb2.GenerateRequest(request_id="y"),
                                       metadata=md, timeout=10))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    bare.Retire(worker_pb2.RetireRequest(reason="test"), metadata=md, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (fake.counts.prefills, fake.counts.generates) == (0, 0)
            authed = bind(worker_pb2_grpc.WorkerStub(ch), secret.metadata(address))
            assert authed.Prefill(request, timeout=10).num_prompt_tokens == 3
            assert fake.counts.prefills == 1


def test_a_worker_reachable_beyond_loopback_needs_a_secret(model_dir, secret_file, capsys):
    from worker.config import parse_args

    base = ["--model", model_dir, "--etcd", "127.0.0.1:1", "--pool-master", "127.0.0.1:1",
            "--pool-metadata", "http://127.0.0.1:1/metadata"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--host", "0.0.0.0"], "decode")
    assert "needs a cluster secret" in capsys.readouterr().err
    config = parse_args([*base, "--host", "0.0.0.0", "--secret-file", secret_file], "decode")
    assert config.cluster_secret is not None
    assert parse_args(base, "decode").cluster_secret is None


def _stats(address: str, tls: PlaneTLS | None, secret: ClusterSecret) -> None:
    with plane_tls.channel(address, tls) as ch:
        stub = bind(worker_pb2_grpc.WorkerStub(ch), secret.metadata(address))
        stub.Stats(worker_pb2.StatsRequest(), timeout=5)


def test_over_mutual_tls_the_conductor_serves_and_nobody_without_the_planes_pair_gets_in(
        model_dir, secret_file, tmp_path):
    """Workers serving TLS (`cluster.plane_tls`): the conductor dials them with its client
    certificate and serves; plaintext, a client without a certificate, or one whose pair
    another CA signed never reach a servicer, even holding the secret's token."""
    tls_dir = str(plane_tls.make(tmp_path / "tls"))
    stranger = str(plane_tls.make(tmp_path / "other"))
    with LocalConductor(model_dir, secret_file=secret_file, tls_dir=tls_dir,
                        conductor_args=("--disaggregate", "always")) as c:
        registry = c.app.state.conductor.registry
        for iid in ("prefill-0", "decode-0"):
            wait_until(lambda iid=iid: registry.get(iid).state == "serving", 10)
        _served(c, 3)
        assert c.workers["decode-0"].counts.generates == 3
        secret = ClusterSecret.load(secret_file)
        assert secret is not None
        address = c.addresses["prefill-0"]
        _stats(address, PlaneTLS.load(tls_dir, "client"), secret)  # the conductor's pair
        ca_only = PlaneTLS.load(tls_dir, "client")
        assert ca_only is not None
        no_pair = grpc.ssl_channel_credentials(ca_only.ca)
        for attempt in ("plain", "no client certificate", "another CA's pair"):
            with pytest.raises(grpc.RpcError) as e:
                if attempt == "plain":
                    _stats(address, None, secret)
                elif attempt == "another CA's pair":
                    _stats(address, PlaneTLS.load(stranger, "client"), secret)
                else:
                    with grpc.secure_channel(address, no_pair,
                                             options=plane_tls.CHANNEL_OPTIONS) as ch:
                        bind(worker_pb2_grpc.WorkerStub(ch), secret.metadata(address)).Stats(
                            worker_pb2.StatsRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, attempt
        assert c.workers["prefill-0"].counts.prefills == 3  # nothing else ran


def test_a_worker_plane_tls_directory_must_hold_its_sides_files(tmp_path, model_dir):
    from worker.config import parse_args

    assert PlaneTLS.load("", "server") is None
    tls_dir = plane_tls.make(tmp_path / "tls")
    assert plane_tls.make(tls_dir) == tls_dir  # an existing set is kept
    assert PlaneTLS.load(str(tls_dir), "server") is not None
    (tls_dir / "client-key.pem").unlink()
    assert PlaneTLS.load(str(tls_dir), "server") is not None  # a worker needs no client pair
    with pytest.raises(ValueError, match="client-key.pem"):
        PlaneTLS.load(str(tls_dir), "client")
    base = ["--model", model_dir, "--etcd", "127.0.0.1:1", "--pool-master", "127.0.0.1:1",
            "--pool-metadata", "http://127.0.0.1:1/metadata"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--tls-dir", str(tmp_path / "none")], "decode")
    assert parse_args([*base, "--tls-dir", str(tls_dir)], "decode").tls is not None
