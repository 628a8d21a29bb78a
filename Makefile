# Everything a new machine needs is installed by these targets, idempotently, into .venv.
# `make run` starts the embedded cluster; `make test` runs the tests.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The engine extra: the GPU build of vLLM and Mooncake when a GPU answers, the CPU build otherwise.
GPU     := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRA   ?= $(if $(GPU),gpu,cpu)
STAMP   := $(VENV)/.installed-$(EXTRA)
PORT    ?= 8000
MODEL   ?=
PYTEST_ARGS ?=
ARGS    ?=

.PHONY: install sysdeps run test test-fast lint model clean bench bench-sched bench-kv

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Mooncake's Python module links libibverbs.so.1 even for TCP.
sysdeps:
	@if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  if command -v apt-get >/dev/null; then \
	    echo "installing libibverbs1 (needed by Mooncake)"; \
	    $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libibverbs1; \
	  else echo "warning: libibverbs.so.1 missing and no apt-get: install rdma-core/libibverbs"; fi; \
	fi

$(STAMP): pyproject.toml | $(PY) sysdeps
	$(PIP) install -e '.[$(EXTRA),test,bench]'
ifeq ($(EXTRA),cpu)
	@# PyPI's torchvision/torchaudio/torchcodec are built for the CUDA torch and break
	@# `transformers` beside the CPU torch; text serving needs none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
endif
	$(PY) -c "import protos"
	@touch $@

model: install
	$(PY) -m tinymodel

run: install
	$(PY) -m embedded --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

# The 25 slowest tests close the output: where make test's time goes.
test: install
	$(PY) -m pytest --durations=25 $(PYTEST_ARGS)

# The tests that start no vLLM engine and wait out no real outage (unit tests, the fakes, real
# etcd and Mooncake): under a minute here.
test-fast: install
	$(PY) -m pytest -m "not engine and not slow" $(PYTEST_ARGS)

# The deploy scripts across three hosts made here as network namespaces (as root; it skips,
# saying why, where namespaces cannot be made), then faults between them: tests/hosts,
# docs/hosts.md. Last line: hosts n=... served=... cross_host_loads=... partition_ok=...
.PHONY: test-hosts
test-hosts: install
	@command -v ip >/dev/null && command -v ss >/dev/null || { \
	  echo "installing iproute2 (ip, ss)"; $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq iproute2; }
	$(PY) -m tests.hosts $(HOSTS_ARGS)

lint: install
	$(VENV)/bin/ruff check .

# docs/configuration.md from the config classes' fields and docstrings (tests/test_configdoc.py
# fails while it is stale).
.PHONY: docs
docs: install
	$(PY) -m tools.configdoc

# The scheduler's decision latency at 64x64 instances and a 1M-block index, then at 256x256 and
# 1024x1024 (last line: summary). About 6 minutes. SCHED_ARGS: e.g. --profile (where the
# decision's time goes), --no-scales.
SCHED_ARGS ?=
bench-sched: install
	$(PY) -m benchmarks.bench_sched $(SCHED_ARGS)

# KV blocks through the Mooncake Store pool between two processes, against raw loopback TCP
# and memcpy measured in the same run (last line: summary). About 2-3 minutes.
bench-kv: install
	$(PY) -m benchmarks.bench_kv

bench: bench-sched bench-kv

# vLLM's own `vllm bench serve` against the shape `make run` picks, the cluster forced into one
# prefill + one decode, and a plain `vllm serve` of the same model, cores and KV memory, with
# each request's timeline (last line: summary). About 10 minutes per repetition.
# SERVE_ARGS: e.g. --reps 3 --datasets random.
SERVE_ARGS ?=
.PHONY: bench-serve
bench-serve: install
	$(PY) -m benchmarks.bench_serve $(SERVE_ARGS)

# Six arms (ours in the chosen shape, in 2P+2D, with round robin; vllm-router P/D and
# data-parallel; one colocated vLLM server) on real engines and the same cores, four workloads,
# three interleaved repetitions; results in results/e2e/ (last line: summary). About an hour.
# E2E_ARGS: e.g. --reps 1 --scale 0.1 --arms kv_centric,colocated --workloads multi_turn.
E2E_ARGS ?=
.PHONY: bench-e2e
bench-e2e: install
	$(PY) -m benchmarks.e2e $(E2E_ARGS)

# Each arm's capacity: the shared-prefix workload at rising arrival rates, the highest rate at
# which 90% of requests meet the SLOs (~35 min; results in results/e2e/capacity/)
CAPACITY_ARGS ?= --arms kv_centric,round_robin,vllm_router,vllm_router_dp,colocated \
	--workloads shared_prefix --rates 1,2,3,4,5 --reps 3 --prewarm-n '' --out results/e2e/capacity
.PHONY: bench-capacity
bench-capacity: install
	$(PY) -m benchmarks.e2e $(CAPACITY_ARGS)

# Bursts of cold long prompts through make run's shape, with vLLM's step packing and with ours
# (a step that finishes a prompt carries no other's chunk), alternating; results in results/burst/
# (last line: summary). About 12 minutes. BURST_ARGS: e.g. --reps 1 --bursts 3.
BURST_ARGS ?=
.PHONY: bench-burst
bench-burst: install
	$(PY) -m benchmarks.bench_burst $(BURST_ARGS)

# Kill workers, the store master and etcd under traffic; classify every answer against a
# single-engine reference (docs/reliability.md; results in results/chaos.json; last line:
# summary). CHAOS_ARGS: e.g. --requests 40 --faults decode,etcd.
CHAOS_ARGS ?=
.PHONY: chaos
chaos: install
	$(PY) -m benchmarks.chaos $(CHAOS_ARGS)

# The cluster simulator: every policy and peer router over a trace, the load/pool/reuse
# sweeps, every arm's capacity under SLO per profile, every router's best split and the
# planner checked against an exhaustive sweep, into results/sim/ (last line: summary, with
# capacity_vs_best_peer, capacity_vs_colocated, plan_ok). Runs no engine; ~12 CPU-minutes,
# the comparison on two worker processes. SIM_ARGS: e.g. --profiles paper_llama2_70b --no-plans.
TRACE   ?= ../shared/traces/mooncake_synthetic_trace.jsonl
SIM_ARGS ?=
.PHONY: bench-sim
bench-sim: install
	$(PY) -m simulator --trace $(TRACE) --out results/sim $(SIM_ARGS)

# What conductor replicas cost: 1, 2, 4 and 8 replicas, each seeing the others' dispatches one
# sync period late, against one conductor (docs/simulator.md#conductor-replicas), into
# results/sim-replicas/. 25 runs, about 2.5 CPU-minutes. Last line: summary, with within_5pct
# (2 and 4 replicas at one report per decode step). REPLICA_ARGS: e.g. --scale 1.5.
REPLICA_ARGS ?=
.PHONY: bench-sim-replicas
bench-sim-replicas: install
	$(PY) -m simulator replicas --trace $(TRACE) --out results/sim-replicas $(REPLICA_ARGS)

clean:
	rm -rf $(VENV) run .pytest_cache protos/*_pb2*.py protos/*_pb2.pyi
