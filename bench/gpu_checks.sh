#!/bin/bash
# Every check that needs a CUDA device, in one run (a lent GPU machine's time is short):
# the CUDA tests and the step-order harness, the copy path at two batch sizes (cut into
# launches and in one, side by side) and the parts of a one-launch batch, the copy
# kernel alone under compute-sanitizer's memcheck, racecheck and synccheck
# (bench/gpu_sanitize.py: one harness case under racecheck gave no result in 355 s and
# 377 s on an H200, its matrix products slowed by the sanitizer), the forward stall at the
# engine's store programs against one program a piece, and with loads beside; then that
# harness case under racecheck with what time is left. Every run here uses the
# CopyEngine's own program counts (cuda_rows.STORE_PROGRAMS, LOAD_PROGRAMS) unless a step
# names others; `--copy-programs` on the two benches sweeps them.
#
#   bench/gpu_checks.sh OUT_DIR [SECONDS]     (default 450 s in all)
#
# Needs torch with CUDA, Triton, pytest and hypothesis, and hybridkv importable with its
# row-copy extension built for that Python (`pip install -e .`, or src/ on PYTHONPATH after
# `python setup.py build_ext --inplace`); not vLLM. Figures go to docs/benchmarks.md.
set -u
out=${1:?usage: bench/gpu_checks.sh OUT_DIR [SECONDS]}
budget=${2:-450}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(dirname "$0")"
step() { echo "== $1 (t=${SECONDS}s)"; shift; "$@"; echo "rc=$?"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  step tests timeout 170 $py -m pytest -q -p no:cacheprovider tests/test_cuda_rows.py \
    tests/test_copy_engine_cuda.py tests/test_step_replay.py
  step "copy 1 GiB" timeout 80 $py bench/gpu_copy.py --json "$out/gpu_copy.json"
  step "copy 1 GiB, its parts" timeout 40 $py bench/gpu_copy_parts.py
  for tool in memcheck racecheck synccheck; do
    step "$tool, copy kernel alone" timeout 90 compute-sanitizer --tool "$tool" \
      --error-exitcode 9 $py bench/gpu_sanitize.py
  done
  step "copy 0.5 GiB" timeout 60 $py bench/gpu_copy.py --entries 64 --blocks-per-entry 4 \
    --json "$out/gpu_copy_small.json"
  stores=$($py -c "from hybridkv.core.cuda_rows import STORE_PROGRAMS as p; print(p)")
  step "forward stall" timeout 60 $py bench/gpu_forward_stall.py --copy-programs 0 "$stores" \
    --repeats 3 --json "$out/stall.json"
  step "forward stall with loads" timeout 60 $py bench/gpu_forward_stall.py --loads \
    --repeats 3 --json "$out/stall_loads.json"
  left=$((budget - SECONDS))
  if [ "$left" -gt 30 ]; then
    step "racecheck (${left}s)" timeout "$left" compute-sanitizer --tool racecheck \
      $py -m pytest -q -x -p no:cacheprovider \
      "tests/test_step_replay.py::test_finished_requests_blocks_go_to_others_only_once_their_stores_landed[cuda-v1-stores]"
  fi
} 2>&1 | tee "$out/gpu_checks.log"
