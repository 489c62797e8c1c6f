#!/usr/bin/env bash
# The GPU checks, run on a machine with a CUDA GPU from the repository root:
#   benchmarks/run_gpu_suite.sh [env] [fence] [tests] [probe] [bench] [launch] [tier] [offload] [layers] [tasks] [vmm]
#                               (default: all but vmm, which `tests` includes)
#   env     the machine, the packages and the settings, in $OUT/env.log (always written first)
#   fence   the ordering test alone (a store behind a late write, a load behind a late poison, each with the
#           fence and, as its negative control, without; needs torch with CUDA), a short first check
#   tests   python -m pytest -m gpu (tests/test_gpu*.py, the fence test included)
#   probe   the CUDA C++ ceiling probe benchmarks/swapbench.cu
#   bench   python -m fastcache.tools.bench, its JSON in $OUT/bench.json
#   launch  python -m fastcache.launch with no arguments (it must pick cuda), then what it left behind
#   tier    benchmarks/tier_bench.py on the cuda device (what TieredCache's calls add to a swap), $OUT/tier.json
#   offload benchmarks/offload_bench.py on cuda with torch (streamed weights against resident, a layer's compute
#           beside its copy), then python -m fastcache.launch --offload-weights 0.5 on cuda
#   layers  benchmarks/layer_bench.py on cuda: layer 0 in place against the whole layer-by-layer swap-in, a stream wait
#   vmm     tests/test_gpu_vmm.py alone: vLLM-shaped cuMemCreate KV tensors shared by POSIX descriptor, clear and restore
#   tasks   benchmarks/task_bench.py on cuda at tp=1 and 2 (both ranks on GPU 0): the one-block task against the
#           floors of benchmarks/queue_floor.py in the same run, the engine's CPU per task, pipelined tasks/s;
#           then the same bench on sim at tp=1, 2 and 4 with a core for every process (a 2-vCPU machine runs
#           the engine and two transfer managers on two cores at tp=2), in $OUT/tasks_sim.log
# Each step runs under its own time limit, so a hang costs that step only. On a leased machine with a
# per-call limit, run the steps as separate calls (e.g. `tests`, then `probe bench launch tier`).
# Logs go to $OUT (default ./gpu-out). Python packages the machine lacks (posix_ipc and pyzmq on the
# device image) travel as wheels in .whl/ (git-ignored) and are installed into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD"
# CUDA IPC exports cudaMalloc memory only: torch's expandable segments cannot be shared
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "run_gpu_suite: installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD"
fi
if ! python3 -c 'import zmq, posix_ipc, psutil, numpy, cuda.bindings.runtime' 2>"$OUT/import.log"; then
    echo "run_gpu_suite: a required package cannot be imported (carry its wheel in .whl/):" >&2
    cat "$OUT/import.log" >&2
    exit 1
fi

log_env() {
    {
        date -u
        nvidia-smi
        nvcc --version 2>/dev/null | tail -1
        python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "zmq", "posix_ipc", "psutil", "cuda.bindings", "torch", "cupy"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except ImportError as exc:
        print(name, "missing:", exc)
EOF
        env | grep -E '^(FASTCACHE_|PYTORCH_CUDA_ALLOC_CONF|CUDA_)' | sort
        df -h /dev/shm
    } >"$OUT/env.log" 2>&1
    cat "$OUT/env.log"
}

run_tests() {
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -rs -s --durations=20 -o timeout=180 2>&1 | tee "$OUT/pytest.log"
}

run_fence() {
    timeout 240 python3 -m pytest -m gpu -q -rs -s -o timeout=120 tests/test_gpu_vllm_worker.py \
        -k test_a_store_and_a_load_submitted_behind_late_writes_wait_for_them 2>&1 | tee "$OUT/fence.log"
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
    nvcc -O2 -arch=sm_90 $batch -o /tmp/swapbench benchmarks/swapbench.cu 2>&1 | tee "$OUT/swapbench.log" &&
        timeout 180 /tmp/swapbench 2>&1 | tee -a "$OUT/swapbench.log"
}

run_bench() {
    timeout "${BENCH_TIMEOUT:-480}" python3 -m fastcache.tools.bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
}

run_tier() {
    timeout 300 python3 benchmarks/tier_bench.py --device cuda --tp 1 --json "$OUT/tier.json" 2>&1 | tee "$OUT/tier.log"
}

run_launch() {
    local status
    timeout 240 python3 -m fastcache.launch 2>&1 | tee "$OUT/launch.log"
    status=${PIPESTATUS[0]}
    { echo "exit status $status"; echo "left in /dev/shm:"; ls /dev/shm | grep -i fastcache;
      echo "processes left:"; pgrep -af fastcache; } 2>&1 | tee -a "$OUT/launch.log"
    return "$status"
}

run_offload() {
    timeout 300 python3 benchmarks/offload_bench.py --device cuda --framework torch 2>&1 | tee "$OUT/offload.log" &&
        timeout 120 python3 -m fastcache.launch --device cuda --offload-weights 0.5 2>&1 | tee -a "$OUT/offload.log"
}

run_vmm() {
    timeout 300 python3 -m pytest -m gpu -q -rs -s -o timeout=180 tests/test_gpu_vmm.py 2>&1 | tee "$OUT/vmm.log"
}

run_tasks() {
    local status=0
    timeout 300 python3 benchmarks/task_bench.py --device cuda --tp 1 2 2>&1 | tee "$OUT/tasks.log" || status=1
    timeout 240 python3 benchmarks/task_bench.py --tp 1 2 4 2>&1 | tee "$OUT/tasks_sim.log" || status=1
    return $status
}

run_layers() {
    timeout 180 python3 benchmarks/layer_bench.py --device cuda 2>&1 | tee "$OUT/layers.log"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests probe bench launch tier offload layers tasks)
status=0
log_env
for step in "${steps[@]}"; do
    case "$step" in
        env) ;;
        fence) run_fence || status=1 ;;
        tests) run_tests || status=1 ;;
        probe) run_probe || status=1 ;;
        bench) run_bench || status=1 ;;
        launch) run_launch || status=1 ;;
        tier) run_tier || status=1 ;;
        offload) run_offload || status=1 ;;
        layers) run_layers || status=1 ;;
        vmm) run_vmm || status=1 ;;
        tasks) run_tasks || status=1 ;;
        *) echo "unknown step $step (expected env, tests, probe, bench, launch, tier, offload, layers, tasks, vmm, fence)" >&2; status=2 ;;
    esac
done
exit $status
