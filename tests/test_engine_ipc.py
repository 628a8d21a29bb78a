"""Each engine's vLLM socket files in a directory of its own, gone with it (`worker.engine`),
or with its worker process (`cluster.process.vllm_scratch`)."""

from __future__ import annotations

import os
import tempfile

import pytest

from cluster.process import DIST_ENV, IPC_ENV, vllm_scratch_here
from cluster.workers import WorkerSpec
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.kv_events import KvEventRelay


def _engine(model: str) -> Engine:
    return Engine(WorkerConfig(role="both", model=model, etcd="127.0.0.1:1",
                               pool_master="127.0.0.1:1", pool_metadata="http://127.0.0.1:1",
                               dtype="float32"))


def test_the_directory_and_its_variable_go_with_the_engine(model_dir, monkeypatch):
    monkeypatch.delenv(IPC_ENV, raising=False)
    monkeypatch.delenv(DIST_ENV, raising=False)
    first = _engine(model_dir)
    first._claim_ipc_dir()
    taken = os.environ[IPC_ENV]
    assert os.path.isdir(taken) and os.environ[DIST_ENV] == taken
    first.shutdown()
    assert not os.path.exists(taken)
    # not a dead path handed to the next engine
    assert IPC_ENV not in os.environ and DIST_ENV not in os.environ
    second = _engine(model_dir)
    second._claim_ipc_dir()
    assert os.path.isdir(os.environ[IPC_ENV]) and os.environ[IPC_ENV] != taken
    second.shutdown()


def test_a_directory_the_operator_set_is_left_alone(model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv(IPC_ENV, str(tmp_path))
    engine = _engine(model_dir)
    engine._claim_ipc_dir()
    engine.shutdown()
    assert os.environ[IPC_ENV] == str(tmp_path) and tmp_path.is_dir()


def test_a_worker_started_here_gets_a_directory_gone_once_it_is_reaped(monkeypatch, tmp_path):
    """Also when the worker is killed and so never shuts its engine down (`vllm_scratch`)."""
    monkeypatch.delenv(IPC_ENV, raising=False)
    monkeypatch.delenv(DIST_ENV, raising=False)
    spec = WorkerSpec(model="m", etcd="e", pool_master="p", pool_metadata="u",
                      run_dir=str(tmp_path), python="true")
    proc, _ = spec.start("both", "both-0")
    sockets = proc.env[IPC_ENV]
    assert proc.scratch == sockets == proc.env[DIST_ENV] and os.path.isdir(sockets)
    proc.kill()
    assert not os.path.exists(sockets)


def test_the_kv_event_socket_is_beside_the_engines(monkeypatch, tmp_path):
    monkeypatch.setenv(IPC_ENV, str(tmp_path))
    relay = KvEventRelay(16)
    assert relay.endpoint.startswith(f"ipc://{tmp_path}/")
    relay.stop()


def test_the_engine_cores_rendezvous_file_goes_with_the_sockets(monkeypatch, tmp_path):
    from vllm.utils import network_utils

    from worker.vllm_plugin import _dist_store_in_scratch

    _dist_store_in_scratch()
    monkeypatch.setenv(DIST_ENV, str(tmp_path))
    assert network_utils.get_file_store_init_method().startswith(f"file://{tmp_path}/vllm_dist_")
    monkeypatch.delenv(DIST_ENV)
    assert network_utils.get_file_store_init_method().startswith(
        f"file://{tempfile.gettempdir()}/vllm_dist_")  # vLLM's own, unless asked


def test_engines_started_in_this_process_get_a_directory_for_the_block(monkeypatch):
    """`vllm_scratch_here` (bench-kv's and the calibration's in-process engines): both
    variables name one new directory inside the block, as they were after it, and the
    directory is gone, also when the block raises."""
    monkeypatch.setenv(IPC_ENV, "/somewhere/the/operator/chose")
    monkeypatch.delenv(DIST_ENV, raising=False)
    with vllm_scratch_here() as path:
        assert os.path.isdir(path) and os.environ[IPC_ENV] == os.environ[DIST_ENV] == path
        open(os.path.join(path, "vllm_dist_x"), "w").close()
    assert not os.path.exists(path)
    assert os.environ[IPC_ENV] == "/somewhere/the/operator/chose" and DIST_ENV not in os.environ
    with pytest.raises(RuntimeError), vllm_scratch_here() as path:
        raise RuntimeError("engine failed")
    assert not os.path.exists(path) and DIST_ENV not in os.environ
