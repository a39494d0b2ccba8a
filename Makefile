# kvmesh developer entry points. `make demo` and `make test` do all the set-up themselves.
#   venv  .venv with kvmesh installed editable (+ test extras); torch pinned by constraints-cpu.txt;
#         then the native CPU kernels built into $KVMESH_HOME/torch_extensions (python -m
#         workers.kernels.build: compiles only when these kernel sources have no build there yet,
#         so no first start compiles anything; MAX_JOBS=N caps the compiler processes)
#   pull  fetch the test model (smollm2-135m-instruct) into $KVMESH_HOME (default
#         $XDG_CACHE_HOME/kvmesh, else ~/.cache/kvmesh), with its dense bf16 conversion (--dense:
#         the tests compare against transformers on it)
#   demo  venv + the demo model + a two-turn PolicyDesk chat (`kvmesh demo`)
#   test  venv + test model + the fast tier: every test but those marked slow for a reason
#         (FAST_TIER: fuzz, quality, compile, chaos, mesh, multinode, pull, matrix; pyproject.toml's markers)
#   test-all  venv + test model + the whole suite (what CI runs: .ci/run)
#   protos  regenerate the committed gRPC stubs in kvmesh/v1 from protos/ (tests/test_protos.py checks they are current)

PYTHON      ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.kvmesh-installed
TEST_MODEL  := smollm2-135m-instruct
# The demo's model: the model recommended for PolicyDesk (docs/model_choice.md). On a 2-core AMD EPYC Zen 5
# (2026-12-04, docs/results-history.md section 0z11) its first demo answer, from its published GGUF
# weights, came in 7.4 s (5.6 s to the first token of a 1,677-token prompt, 56 tokens at 29.5
# tokens/s), within the demo's 10 s; on an AVX2-only Zen 3 its first token alone takes ~21 s
# (section 0z10): `make demo DEMO_MODEL=qwen2.5-coder-0.5b-instruct` there.
DEMO_MODEL  ?= qwen2.5-coder-1.5b-instruct

# The markers `make test` deselects: what makes those tests slow (pyproject.toml lists them).
FAST_TIER   := not (fuzz or quality or compile or chaos or mesh or multinode or pull or matrix)
# Test processes (pytest-xdist), each running whole modules (their module-scoped engines and
# meshes stay shared); the tests use one intra-op thread each (tests/conftest.py).
TEST_JOBS   ?= 2
PYTEST      := $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

.PHONY: venv pull demo test test-all protos

venv: $(STAMP)
	$(BIN)/python -m workers.kernels.build

# Re-runs only when the venv is missing or the dependencies changed.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -c constraints-cpu.txt -e '.[test]'
	touch $@

pull: venv
	$(BIN)/kvmesh models pull --dense $(TEST_MODEL)

demo: venv
	$(BIN)/kvmesh models pull $(DEMO_MODEL)
	$(BIN)/kvmesh demo --model $(DEMO_MODEL)

test: pull
	$(PYTEST) -m "$(FAST_TIER)" tests

test-all: pull
	$(PYTEST) tests

protos: venv
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvmesh/v1/*.proto
