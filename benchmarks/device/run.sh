#!/usr/bin/env bash
# The device command: install the carried wheels (.whl/, from fetch_wheels.sh) where the image's Python
# finds them, then run.py; its log, JSON, table, junit file and test log land in $OUT. From the device tool:
#     run(command="bash benchmarks/device/run.sh", carry=[".whl"], timeout_s=540)
set -o pipefail
out="${OUT:-results}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "no wheels installed: run benchmarks/device/fetch_wheels.sh here and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 benchmarks/device/run.py "$@" 2>&1 | tee "$out/device_run.log"
