"""The OpenAI endpoint on the running stack (real vLLM engines, pool, etcd), driven by the
official `openai` client, `vllm bench serve` and schemathesis; and a client disconnect proven
by both engines' own running-request counts.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import wait_until

from protos import worker_pb2, worker_pb2_grpc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def unique_text(words: int, seed: int | None = None) -> str:
    """A prompt no engine has seen (so nothing is served from a cache)."""
    rnd = random.Random(seed if seed is not None else time.time_ns())
    vocab = ["river", "stone", "lamp", "seven", "copper", "north", "bread", "glass", "owl"]
    return " ".join(f"{rnd.choice(vocab)}{rnd.randint(0, 99)}" for _ in range(words))


def test_completions_and_chat_with_the_openai_client(client, model):
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0

    stream = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                          temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_stop_strings_and_stop_token_ids_are_honoured(client, model):
    prompt = "The capital of France is"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    text = full.choices[0].text
    ids = full.choices[0].model_extra["token_ids"]
    # A stop string taken from the middle of the greedy output cuts it right there.
    cut = next(i for i in range(2, len(text)) if not text[i].isspace())
    stop = text[cut:cut + 2]
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == text[:text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    # A stop token id ends the output at that token.
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]],
                                                "return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ids[3]
    assert choice.model_extra["token_ids"] == ids[:ids.index(ids[3]) + 1]


def test_sampling_n_seed_and_logprobs_on_real_engines(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0,
                  seed=7, n=2, logprobs=2)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    assert all(len(top) <= 3 for c in a.choices for top in c.logprobs.top_logprobs)


def test_bad_requests_raise_the_clients_errors(client, model):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", temperature=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user"}],
                                       extra_body={"top_logprobs": 3})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                 "content": "x"}])


# ---------------------------------------------------------------- disconnects


def _stubs(cluster) -> dict[str, worker_pb2_grpc.WorkerStub]:
    return {w.role: cluster.worker_stub(w.address)
            for w in cluster.workers.values()}


def _stats(stubs) -> dict[str, worker_pb2.WorkerStats]:
    return {role: stub.Stats(worker_pb2.StatsRequest(), timeout=5) for role, stub in
            stubs.items()}


def _idle(stubs) -> bool:
    return all(s.running == 0 and s.prefills_in_flight == 0 and s.generates_in_flight == 0
               for s in _stats(stubs).values())


def test_client_disconnect_aborts_both_engines_requests(cluster, model):
    stubs = _stubs(cluster)
    wait_until(lambda: _idle(stubs), 60, "the workers were busy before the test")
    before = _stats(stubs)

    # 1. Gone during decode: a long stream, dropped after a few tokens.
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60, json={
            "model": model, "prompt": unique_text(120), "max_tokens": 1500,
            "ignore_eos": True, "stream": True}) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
        for _ in range(3):
            next(lines)
        during = _stats(stubs)
        assert during["decode"].running == 1
    wait_until(lambda: _stats(stubs)["decode"].running == 0, 10, "decode engine still running it")
    after = _stats(stubs)
    assert after["decode"].aborted_total == before["decode"].aborted_total + 1
    assert after["decode"].generates_in_flight == 0

    # 2. Gone during prefill: long distinct prompts (several, so the prefill engine holds
    # work for a while), their sockets closed while the prefill worker computes them.
    socks = []
    for _ in range(4):
        body = json.dumps({"model": model, "prompt": unique_text(330), "max_tokens": 1500,
                           "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", cluster.http_port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(s)
    wait_until(lambda: _stats(stubs)["prefill"].prefills_in_flight >= 1, 30, "no prefills started")
    for s in socks:
        s.close()
    wait_until(lambda: _idle(stubs), 30, "an engine still holds a request of a gone client")
    after2 = _stats(stubs)
    assert after2["prefill"].aborted_total > after["prefill"].aborted_total
    metrics = httpx.get(f"{cluster.url}/metrics").text
    assert 'status="499"' in metrics


def test_streams_sharing_a_client_id_do_not_touch_each_other(cluster, model):
    """Three streams carry one X-Request-Id; the client of the third leaves after a few
    tokens. The other two still finish in full: the engines and the aborts key on the
    conductor's own ids (with one id, the abort cut its twins after a token)."""
    stubs = _stubs(cluster)
    wait_until(lambda: _idle(stubs), 60, "the workers were busy before the test")
    before = _stats(stubs)["decode"].aborted_total
    max_tokens = 200
    body = {"model": model, "prompt": unique_text(60, seed=7), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"X-Request-Id": "twin"}
    results: list[tuple[str | None, int, set[str]]] = []

    def full() -> None:
        finish, tokens, ids = None, 0, set()
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=headers,
                          timeout=120) as r:
            assert r.headers["x-request-id"] == "cmpl-twin"
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    ids.add(chunk["id"])
                    for c in chunk["choices"]:
                        finish = c["finish_reason"] or finish
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        results.append((finish, tokens, ids))

    twins = [threading.Thread(target=full) for _ in range(2)]
    for t in twins:
        t.start()
    wait_until(lambda: _stats(stubs)["decode"].running == 2, 60, "the twins did not start")
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
        for _ in range(3):
            next(lines)
    wait_until(lambda: _stats(stubs)["decode"].aborted_total == before + 1, 30,
               "the abandoned stream was not aborted")
    for t in twins:
        t.join(timeout=120)
    assert results == [("length", max_tokens, {"cmpl-twin"})] * 2


# ---------------------------------------------------------------- tools


def test_vllm_bench_serve_has_no_failed_requests(cluster, model_dir, model, tmp_path):
    """`vllm bench serve` (benchmarks/vllm_bench_serve.py runs it) against the conductor."""
    result = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vllm_bench_serve.py"),
           "--backend", "openai", "--base-url", cluster.url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", "128", "--random-output-len", "16", "--num-prompts", "32",
           "--max-concurrency", "8", "--seed", "0", "--ignore-eos", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
           "--result-filename", result.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(result.read_text())
    errors = [e for e in report.get("errors", []) if e]
    assert report["completed"] == 32 and report.get("failed", 0) == 0, errors[:5]
    assert report["total_output_tokens"] == 32 * 16


def test_schemathesis_finds_no_5xx_and_no_schema_violation(cluster, tmp_path):
    """Fuzz the served OpenAPI description. Generation is kept short (max_tokens <= 8, n <= 2)
    by a hook, so the cases exercise validation and response shapes, not decode time."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{cluster.url}/openapi.json",
           "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
           "response_schema_conformance,response_headers_conformance",
           "--max-examples", "15", "--seed", "6", "--workers", "2",
           "--request-timeout", "60", "--suppress-health-check", "all"]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)  # its crash cache goes there, not into the repo
    assert proc.returncode == 0, _schemathesis_failures(proc.stdout, proc.stderr, cluster)
    assert "FAILURES" not in proc.stdout and " passed" in proc.stdout, proc.stdout[-3000:]


def _schemathesis_failures(stdout: str, stderr: str, cluster) -> str:
    """What a failed fuzz run needs to be understood from a CI log that keeps only a little:
    schemathesis's failure section (each case's reproduction command and response) and the
    conductor's log lines for answers of 500 and up."""
    at = stdout.find("FAILURES")
    failures = stdout[at:at + 5000] if at >= 0 else stdout[-4000:]
    log = cluster.run_dir / "conductor.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    bad = [ln for ln in lines if any(k in ln for k in (
        "answer_5xx", "internal_error", "Traceback", "worker_rpc_failed", "breaker"))]
    return failures + "\n--- conductor.log (errors) ---\n" + "\n".join(bad[-40:]) + stderr[-1500:]
