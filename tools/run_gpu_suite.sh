#!/usr/bin/env bash
# The GPU checks, run on a machine with a CUDA GPU from the repository root:
#   tools/run_gpu_suite.sh [tests] [probe] [bench]      (default: all three, in that order)
#   tests  python -m pytest -m gpu (tests/test_gpu.py and any other gpu-marked test)
#   probe  the CUDA C++ ceiling probe tools/swapbench.cu (a copy of shared/reference/swapbench.cu), if nvcc exists
#   bench  python -m fastcache.tools.bench, its JSON in $OUT/bench.json
# Logs go to $OUT (default ./gpu-out). Python packages the machine lacks (posix_ipc and pyzmq, on the
# device image) travel as wheels in .whl/ (git-ignored) and are installed into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD"
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests probe bench)
status=0

{
    nvidia-smi
    python3 -c 'import sys, cuda.bindings; print("python", sys.version, "cuda-bindings", cuda.bindings.__version__)'
    df -h /dev/shm
} >"$OUT/env.log" 2>&1

run_tests() {
    python3 -m pytest -m gpu -q 2>&1 | tee "$OUT/pytest.log"
}

run_probe() {
    if ! command -v nvcc >/dev/null; then
        echo "nvcc not found: no CUDA C++ probe" | tee "$OUT/swapbench.log"
        return 0
    fi
    # cudaMemcpyBatchAsync lost its failIdx argument in CUDA 13; it exists from 12.8
    local release batch=""
    release=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
    read -r major minor <<<"$release"
    if [ "$major" -ge 13 ]; then batch=-DUSE_BATCH=13
    elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then batch=-DUSE_BATCH=12
    fi
    nvcc -O2 -arch=sm_90 $batch -o /tmp/swapbench tools/swapbench.cu 2>&1 | tee "$OUT/swapbench.log" &&
        /tmp/swapbench 2>&1 | tee -a "$OUT/swapbench.log"
}

run_bench() {
    python3 -m fastcache.tools.bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
}

for step in "${steps[@]}"; do
    case "$step" in
        tests) run_tests || status=1 ;;
        probe) run_probe || status=1 ;;
        bench) run_bench || status=1 ;;
        *) echo "unknown step $step (expected tests, probe, bench)" >&2; status=2 ;;
    esac
done
exit $status
