"""Each engine's vLLM socket files in a directory of its own, gone with it (`worker.engine`)."""

from __future__ import annotations

import os

from worker.config import WorkerConfig
from worker.engine import IPC_ENV, Engine


def _engine(model: str) -> Engine:
    return Engine(WorkerConfig(role="both", model=model, etcd="127.0.0.1:1",
                               pool_master="127.0.0.1:1", pool_metadata="http://127.0.0.1:1",
                               dtype="float32"))


def test_the_directory_and_its_variable_go_with_the_engine(model_dir, monkeypatch):
    monkeypatch.delenv(IPC_ENV, raising=False)
    first = _engine(model_dir)
    first._claim_ipc_dir()
    taken = os.environ[IPC_ENV]
    assert os.path.isdir(taken)
    first.shutdown()
    assert not os.path.exists(taken)
    assert IPC_ENV not in os.environ  # not a dead path handed to the next engine
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
