#!/usr/bin/env bash
# bench/gpu.sh - everything the CUDA backend needs a GPU for, in one call: build, the GPU tests,
# the benchmark table (build/bench_gpu, then its row kernels again at batch 64), the GPU trainer
# (bench/gpu_trainer.sh: its fp32 curve against the CPU's, fp16 and bf16, a resumed run, the
# predicted-vs-measured grid, GPT-2 small's tokens/s and MFU), then the GPU tests under
# compute-sanitizer (memcheck, and racecheck on the kernels with shared memory), the slowest part,
# last. GPU_LOGS=DIR also copies every log there.
# Needs only the CUDA toolkit (nvcc, cuBLASLt, compute-sanitizer), a C compiler and make.
# Run from anywhere: bash bench/gpu.sh   (NVCC=/path/to/nvcc to choose a toolkit). The test cases
# and the sanitizers' runs go GPU_JOBS processes at a time (default 4). With GPU_JOBS=8 and
# GPU_RACECHECK_MATMUL=0 it took 268 s on an H200 (one at a time, before the B 64 rows: 8.2
# minutes, of which the build about 1, the tests 2.5, the table and the trainer 0.5, the
# sanitizers 4); matmul's racecheck alone takes about 3 minutes more.
# Exit status: 0 when every test passed under every tool; the table is printed either way.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "gpu.sh: $*"; }
die() { echo "gpu.sh: error: $*" >&2; exit 1; }

NVCC=${NVCC:-$(command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)}
[ -n "$NVCC" ] && [ -x "$NVCC" ] || die "nvcc not found on PATH or in /usr/local/cuda/bin (set NVCC=)"
CUDA_BIN=$(dirname "$NVCC")
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || die "no C compiler (cc)"
command -v make >/dev/null 2>&1 || die "make not found"
CC=${CC:-$(command -v cc 2>/dev/null || command -v gcc)}
SAN=$(command -v compute-sanitizer 2>/dev/null || ls "$CUDA_BIN"/compute-sanitizer \
      "$CUDA_BIN"/../compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1 || true)
TIMEOUT=$(command -v timeout 2>/dev/null || true)
limit() { local s=$1; shift; if [ -n "$TIMEOUT" ]; then "$TIMEOUT" "$s" "$@"; else "$@"; fi; }

say "toolkit: $("$NVCC" --version | tail -n 2 | head -n 1)"
if command -v nvidia-smi >/dev/null 2>&1; then
    say "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)"
fi

say "building (make NVCC=$NVCC)"
make -j"$(nproc 2>/dev/null || echo 4)" NVCC="$NVCC" CC="$CC" memanat trainer build/test_cuda \
    build/bench_gpu
say "kernels: $(grep -c 'Compiling entry' build/ptxas.log) builds, \
$(grep -Ec '[1-9][0-9]* bytes spill (stores|loads)' build/ptxas.log || true) with spills (build/ptxas.log)"

status=0
# Runs go GPU_JOBS at a time (default 4; each its own process and CUDA context on the one GPU:
# the cases' host references and the sanitizers' instrumentation are what takes the time), each
# with its log build/gpu_NAME.log and exit status build/gpu_NAME.rc; report prints them in order.
JOBS=${GPU_JOBS:-4}
start() {  # start NAME SECONDS CMD...: in the background once fewer than JOBS run
    local name=$1 secs=$2
    shift 2
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n 2>/dev/null || sleep 1; done
    rm -f "build/gpu_$name.rc"
    { rc=0; limit "$secs" "$@" > "build/gpu_$name.log" 2>&1 || rc=$?
      echo "$rc" > "build/gpu_$name.rc"; } &
}
report() {  # report NAME: one result line per run, after wait
    local name=$1 rc
    rc=$(cat "build/gpu_$name.rc" 2>/dev/null || echo "none")
    say "== $name"
    grep -E '^\[FAIL\]|^SKIP|passed, .* failed|ERROR SUMMARY|RACECHECK SUMMARY' \
        "build/gpu_$name.log" 2>/dev/null | tail -n 20 || true
    if [ "$rc" = 124 ]; then say "$name: timed out (log: build/gpu_$name.log)"; fi
    if [ "$rc" != 0 ]; then say "$name: FAILED (exit $rc, log: build/gpu_$name.log)"; status=1;
    else say "$name: ok"; fi
}
run() { start "$@"; wait; report "$1"; }  # run NAME SECONDS CMD...: alone

# a run that selects no test: one SKIP line without a device, else the device's name
first=$(./build/test_cuda no-such-test 2>&1 | head -n 1 || true)
case "$first" in SKIP*) die "no CUDA device answers on this machine: $first" ;; esac
say "$first"
cases=$(./build/test_cuda --list)
# scratch reads the device's free memory before and after its kernels: alone, after the others
together=$(echo "$cases" | grep -vx scratch)
say "== tests ($(echo "$cases" | wc -l) cases, $JOBS at a time)"
for t in $together; do start "test_$t" 240 env MN_TEST_VERBOSE=1 ./build/test_cuda "$t"; done
wait
start test_scratch 240 env MN_TEST_VERBOSE=1 ./build/test_cuda scratch
wait
: > build/gpu_tests.log
for t in $cases; do
    cat "build/gpu_test_$t.log" >> build/gpu_tests.log
    grep -E '^\[FAIL\]' "build/gpu_test_$t.log" || true
    if [ "$(cat "build/gpu_test_$t.rc" 2>/dev/null)" != 0 ]; then
        say "test $t: FAILED (build/gpu_test_$t.log)"; status=1
    fi
done
say "tests: $(grep -c '^\[ OK \]' build/gpu_tests.log) passed, $(grep -c '^\[FAIL\] cuda/' \
build/gpu_tests.log) failed (build/gpu_tests.log)"
cp build/gpu_tests.log build/gpu_tests_errors.log  # max abs/rel errors per kernel and dtype
say "== benchmark"
limit 180 ./build/bench_gpu || { say "benchmark FAILED"; status=1; }
say "== the row kernels at llm.c's batch for this model (B 64: 65536 rows)"
limit 120 ./build/bench_gpu --batch 64 layernorm GELU softmax cross ||
    { say "benchmark (B 64) FAILED"; status=1; }
say "== trainer --device cuda"
limit 300 bash bench/gpu_trainer.sh || { say "GPU trainer checks FAILED (build/gpu_trainer/)";
                                         status=1; }

# the sanitizers last: the slowest part, and the table above is out already
if [ -n "$SAN" ]; then
    # each case in a process of its own (a case's name selects only it), JOBS at a time, scratch
    # alone; the device OOM that cache_oom induces on purpose is an API error memcheck would
    # count, so that case runs with API errors unreported
    for t in $together; do
        api=explicit
        [ "$t" = cache_oom ] && api=no
        start "memcheck_$t" 240 "$SAN" --tool memcheck --report-api-errors "$api" \
            --error-exitcode 3 ./build/test_cuda "$t"
    done
    racy="layernorm softmax crossentropy global_norm adamw adamw8bit adafactor"
    for t in $racy; do
        start "racecheck_$t" 240 "$SAN" --tool racecheck --error-exitcode 3 ./build/test_cuda "$t"
    done
    wait
    run memcheck_scratch 240 "$SAN" --tool memcheck --error-exitcode 3 ./build/test_cuda scratch
    for t in $together; do report "memcheck_$t"; done
    for t in $racy; do report "racecheck_$t"; done
    # matmul (the dGELU/dbias column kernel): cuBLAS's own sm90 GEMM kernels (nvjet_*) draw
    # hazard reports that are theirs, not ours, and the run takes about 3 minutes on an H100; it
    # fails on a hazard in a memanat kernel (mn__*) or a failed test. GPU_RACECHECK_MATMUL=0
    # leaves it out (said in the output) when the device time is short.
    if [ "${GPU_RACECHECK_MATMUL:-1}" = 0 ]; then
        say "racecheck_matmul: left out (GPU_RACECHECK_MATMUL=0)"
    else
        run racecheck_matmul 300 "$SAN" --tool racecheck --print-limit 100000 ./build/test_cuda \
            matmul
        if grep -q 'Race reported between.* at mn__' build/gpu_racecheck_matmul.log; then
            say "racecheck_matmul: a hazard in a memanat kernel"; status=1
        fi
        say "racecheck_matmul: $(grep -c 'Race reported between.* at nvjet' \
            build/gpu_racecheck_matmul.log || true) hazard reports inside cuBLAS's kernels (not ours)"
    fi
else
    say "compute-sanitizer not found next to nvcc: memcheck/racecheck skipped"; status=1
fi

say "errors per kernel: build/gpu_tests_errors.log; ptxas: build/ptxas.log"
if [ -n "${GPU_LOGS:-}" ]; then  # GPU_LOGS=DIR: keep the logs there too
    { mkdir -p "$GPU_LOGS" && cp build/gpu_*.log build/ptxas.log "$GPU_LOGS"/ &&
      cp -r build/gpu_trainer "$GPU_LOGS"/; } 2>/dev/null || say "could not copy the logs"
fi
exit $status
