#!/usr/bin/env bash
# One run on a GPU machine, from the repository root:
#
#     bash benchmarks/gpu_check.sh            # writes to "$OUT" (default ./gpu_out)
#
# (a) the tests marked `cuda` (CUDA against the CPU in float64, batched curvature, mixed
#     precision with a GradScaler, DDP with NCCL on two GPUs);
# (b) benchmarks/curvature_batched.py: the diagonal curvature's batched backpropagations
#     against the one-by-one loop;
# (c) benchmarks/gpu_overhead.py: the overhead table beside the original package's H200
#     numbers, GPT-2 124M, ResNet-18 GroupNorm, Figure 7;
# (d) benchmarks/gpu_memory_peak.py: what is live at GPT-2 124M's tracked peak, by where it
#     was allocated (MEMORY_SECONDS, 0 skips);
# (e) benchmarks/host_overhead.py --device cuda: the CPU proxy's tiny problems on the GPU,
#     every step and each step of an every-10th cycle, then where the host's time goes in
#     the tracked step and the one after it (HOST_SECONDS, 0 skips): the host's time with
#     CUDA's launches, beside the same run on a CPU; then benchmarks/replay_bound.py: the
#     ops of a tracked step replayed without Cockpit's Python, and as one CUDA graph; then
#     benchmarks/tensor_block.py: the norms of a model's parameters by multi-tensor ops
#     against one block of them (the host's time of each); then benchmarks/capture_audit.py:
#     what a CUDA graph of each phase outside the backward pass would have to copy in first,
#     timed.
# (f) benchmarks/host_profile.py --device-only: the device's heaviest kernels in a tracked
#     economy step of GPT-2 124M, ResNet-18 GroupNorm and 3C3D (a kernel that takes
#     milliseconds where the step's others take microseconds: a bad shape for the library
#     that runs it; the device's time per step against the step's: bound by the device or
#     by the host), GPT-2's also with its Python functions by cumulative time, after
#     benchmarks/stacked_dots.py (dot products over millions of numbers into a few outputs,
#     by form; DEVICE_SECONDS, 0 skips).
# (g) the GPT-2 124M and ResNet-18 GroupNorm cells of (c) with Cockpit's Triton kernels off
#     and on, alternated twice (COCKPIT_TENSOR_SUMS, COCKPIT_ROW_DOTS,
#     COCKPIT_FUSED_HISTOGRAM; KERNELS_SECONDS, 0 — the default — skips).
# About 9 minutes in all (limits: TESTS_SECONDS, CURVATURE_SECONDS, BENCH_SECONDS + 50 s,
# MEMORY_SECONDS, HOST_SECONDS, DEVICE_SECONDS). Without CUDA it checks itself in seconds: the cuda tests skip and a tiny
# CPU dry run of (c) runs.
# Outputs: env.txt, cuda_tests.txt, curvature_batched.txt, gpu_overhead.txt,
# gpu_overhead.json, gpu_memory_peak.txt, host_overhead.txt, device_kernels.txt, kernels_ab.txt,
# summary.txt.
set -u -o pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
TESTS_SECONDS="${TESTS_SECONDS:-120}"
BENCH_SECONDS="${BENCH_SECONDS:-130}"   # cells after this are skipped; the run ends soon after
CURVATURE_SECONDS="${CURVATURE_SECONDS:-60}"   # 0 skips part (b)
MEMORY_SECONDS="${MEMORY_SECONDS:-60}"   # 0 skips part (d)
HOST_SECONDS="${HOST_SECONDS:-125}"   # 0 skips part (e)
DEVICE_SECONDS="${DEVICE_SECONDS:-110}"   # 0 skips part (f)
KERNELS_SECONDS="${KERNELS_SECONDS:-0}"   # 0 (the default) skips part (g)

limit() {  # limit SECONDS command...: a wall-clock limit where `timeout` exists
    local seconds=$1; shift
    if command -v timeout >/dev/null; then timeout --kill-after=10 "$seconds" "$@"; else "$@"; fi
}

started=$(date +%s)
{
    echo "date: $(date -u)"; echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available(),
"devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
} 2>&1 | tee "$OUT/env.txt"

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    cuda=1
else
    cuda=0
    echo "CUDA is not available: the cuda tests skip, and the benchmark runs a CPU dry run."
fi

echo "== (a) tests marked cuda"
if [ "$cuda" = 1 ]; then
    # the files that hold cuda-marked tests (collecting the rest would import packages,
    # e.g. optuna, that a GPU machine may lack)
    mapfile -t test_paths < <(grep -rl --include="test_*.py" "mark.cuda\|pytestmark.*cuda" tests)
else
    test_paths=(tests/test_cuda.py)   # collecting the whole suite only to skip it is slow
fi
limit "$TESTS_SECONDS" "$PY" -m pytest -p no:cacheprovider -q -rs -m cuda \
    --continue-on-collection-errors "${test_paths[@]}" \
    2>&1 | tee "$OUT/cuda_tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "cuda tests: exit $tests_rc after $(( $(date +%s) - started )) s"

echo "== (b) benchmarks/curvature_batched.py: batched backpropagations against the loop"
if [ "$cuda" = 1 ] && [ "$CURVATURE_SECONDS" -gt 0 ]; then
    limit "$CURVATURE_SECONDS" "$PY" benchmarks/curvature_batched.py --device cuda --repeats 2 \
        --problems cifar10_3c3d cifar100_allcnnc 2>&1 | tee "$OUT/curvature_batched.txt"
    curv_rc=${PIPESTATUS[0]}
else
    echo "skipped (without CUDA, or CURVATURE_SECONDS=0; on a CPU: python benchmarks/curvature_batched.py)"
    curv_rc=0
fi

echo "== (c) benchmarks/gpu_overhead.py"
if [ "$cuda" = 1 ]; then
    bench_args=(--time-limit "$BENCH_SECONDS" --cell-seconds 5)
else
    bench_args=(--device cpu --quick --parts side --problems cifar10_3c3d --configs economy)
fi
limit $(( BENCH_SECONDS + 50 )) "$PY" benchmarks/gpu_overhead.py "${bench_args[@]}" \
    --json "$OUT/gpu_overhead.json" 2>&1 | tee "$OUT/gpu_overhead.txt"
bench_rc=${PIPESTATUS[0]}

echo "== (d) benchmarks/gpu_memory_peak.py: what is live at GPT-2's tracked peak"
if [ "$cuda" = 1 ] && [ "$MEMORY_SECONDS" -gt 0 ]; then
    limit "$MEMORY_SECONDS" "$PY" benchmarks/gpu_memory_peak.py 2>&1 \
        | grep -v '^\[transformers\]' | tee "$OUT/gpu_memory_peak.txt"
else
    echo "skipped (without CUDA, or MEMORY_SECONDS=0; a dry run: python benchmarks/gpu_memory_peak.py --device cpu)"
fi

echo "== (e) benchmarks/host_overhead.py --device cuda: the CPU proxy's problems on the GPU"
if [ "$cuda" = 1 ] && [ "$HOST_SECONDS" -gt 0 ]; then
    limit "$HOST_SECONDS" bash -c '"$0" benchmarks/host_overhead.py --device cuda --steps 60 &&
        "$0" benchmarks/host_overhead.py --device cuda --every 10 --steps 200 \
            --problems 3c3d resnet18_gn &&
        "$0" benchmarks/host_overhead.py --device cuda --phases --every 10 --steps 20 \
            --problems 3c3d gpt2 &&
        "$0" benchmarks/replay_bound.py --device cuda --steps 20 &&
        "$0" benchmarks/tensor_block.py --device cuda &&
        "$0" benchmarks/capture_audit.py --device cuda --problems 3c3d gpt2' "$PY" 2>&1 \
        | grep -v '^\[transformers\]' | tee "$OUT/host_overhead.txt"
else
    echo "skipped (without CUDA, or HOST_SECONDS=0; on a CPU: python benchmarks/host_overhead.py)"
fi

echo "== (f) benchmarks/host_profile.py --device-only: the heaviest kernels of a tracked step"
if [ "$cuda" = 1 ] && [ "$DEVICE_SECONDS" -gt 0 ]; then
    limit "$DEVICE_SECONDS" bash -c '"$0" benchmarks/stacked_dots.py
        for problem in "gpt2_124m 8 python" "resnet18_gn 128" "3c3d 128"; do
            set -- $problem
            only=--device-only  # (GPT-2 also by Python function: is its host time Python?)
            [ "${3:-}" = python ] && only=
            "$0" benchmarks/host_profile.py --model "$1" --batch "$2" $only --steps 3 \
                --top 16 | sed -n "/^[a-z0-9_]* economy/p;
                    /== Python functions by cumulative/,/== torch.profiler/p;
                    /== by device time/,\$p"
        done' "$PY" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/device_kernels.txt"
else
    echo "skipped (without CUDA, or DEVICE_SECONDS=0)"
fi

echo "== (g) the Triton kernels on and off: GPT-2 124M and ResNet-18 GroupNorm cells"
if [ "$cuda" = 1 ] && [ "$KERNELS_SECONDS" -gt 0 ]; then
    limit "$KERNELS_SECONDS" bash -c 'for off in 1 0 1 0; do
            echo "-- kernels $([ $off = 1 ] && echo off || echo on)"
            COCKPIT_TENSOR_SUMS=$((1 - off)) COCKPIT_ROW_DOTS=$((1 - off)) \
                COCKPIT_FUSED_HISTOGRAM=$((1 - off)) "$0" benchmarks/gpu_overhead.py \
                --parts gpt2 resnet --cell-seconds 4 | grep -E "GPT-2|ResNet"
        done' "$PY" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/kernels_ab.txt"
else
    echo "skipped (without CUDA, or KERNELS_SECONDS=0, the default)"
fi

{
    echo "cuda available: $cuda"
    echo "cuda tests: exit $tests_rc (0 passed or skipped; 5 none collected; 124 time limit)"
    tail -n 3 "$OUT/cuda_tests.txt"
    echo "gpu_overhead: exit $bench_rc"
    echo "curvature_batched: exit $curv_rc"
    echo "seconds: $(( $(date +%s) - started ))"
} | tee "$OUT/summary.txt"
[ "$tests_rc" = 0 ] || [ "$tests_rc" = 5 ] || exit 1
exit "$bench_rc"
