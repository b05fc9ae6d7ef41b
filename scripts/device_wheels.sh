#!/usr/bin/env bash
# Download into .whl/ the wheels scripts/device_check.sh installs on a borrowed GPU machine (Python 3.12,
# x86_64, no network there): the packages scripts/device_wheels.txt lists, exact versions, no dependencies
# (the machine has the rest). Run it where pip reaches a package index; .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
sed 's/#.*//' scripts/device_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl
du -sh .whl
