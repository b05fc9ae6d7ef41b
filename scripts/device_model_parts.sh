#!/usr/bin/env bash
# SmolLM2-135M-Instruct for a borrowed GPU machine, which takes at most 64 MiB of files per command and reaches no
# package index: the 98 MB GGUF travels in two calls (docs/models.md, "On a borrowed GPU machine").
#
#   bash scripts/device_model_parts.sh split   # here: the GGUF in two parts of <= 50 MB under .tidal_cache/device/
#   bash scripts/device_model_parts.sh join    # there: the parts back into .tidal_cache/gguf/ (sha256 checked
#                                              # when tidal imports it: tidal model import smollm2-135m-instruct)
#
# Call 1 carries .tidal_cache/device/smollm2.gguf.partaa (command: true); the machine keeps ignored files
# between calls while it is warm (30 s), so call 2, at once, carries .tidal_cache/device/smollm2.gguf.partab
# and .whl (gguf's wheel, scripts/device_wheels.txt) and runs `bash scripts/device_check.sh smollm2`, which joins.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:-} in
  split)
    src=$("${PYTHON:-.venv/bin/python}" -c "from tidal.models import catalog
print(catalog.catalog_gguf('smollm2-135m-instruct', catalog.cache_root())[0])")
    mkdir -p .tidal_cache/device
    rm -f .tidal_cache/device/smollm2.gguf.part*
    split -b 50M "$src" .tidal_cache/device/smollm2.gguf.part
    ls -l .tidal_cache/device ;;
  join)
    parts=(.tidal_cache/device/smollm2.gguf.part*)
    [ ${#parts[@]} -eq 2 ] || { echo "expected 2 parts in .tidal_cache/device, found ${#parts[@]}"; exit 1; }
    mkdir -p .tidal_cache/gguf
    cat "${parts[@]}" > .tidal_cache/gguf/$GGUF.tmp && mv .tidal_cache/gguf/$GGUF.tmp .tidal_cache/gguf/$GGUF
    ls -l .tidal_cache/gguf/$GGUF ;;
  *) echo "usage: $0 split|join"; exit 2 ;;
esac
