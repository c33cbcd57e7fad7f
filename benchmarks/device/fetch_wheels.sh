#!/usr/bin/env bash
# Download, here, the wheels of requirements-device.txt for the device machines (CPython 3.12, manylinux
# x86_64; they have no network) into the repository's ignored .whl/. run.py installs them there:
#     python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# The pip command is the device tool's README's; --no-deps: requirements-device.txt names every one.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
rm -rf .whl && mkdir -p .whl
grep -v '^\s*#' benchmarks/device/requirements-device.txt | sed 's/#.*//; s/\s*$//' | grep -v '^$' |
  xargs python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl
ls -l .whl
# what each wheel requires (requirements-device.txt must name those the image lacks)
for wheel in .whl/*.whl; do
  echo "$wheel requires: $(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
    | sed 's/Requires-Dist: //' | paste -sd, - || true)"
done
