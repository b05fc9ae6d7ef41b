# Two entry points (see README): `make run` trains the quickstart recipe, `make test` runs the tests.
# Both create .venv on first use. torch is pinned to the CPU build here; the package itself accepts
# any torch>=2.4 so GPU users keep their CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow bench install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tidal train quickstart --out runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

bench: $(STAMP)
	$(BIN)/tidal bench async

clean:
	rm -rf $(VENV) runs .tidal_cache
