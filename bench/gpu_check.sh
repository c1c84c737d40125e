#!/usr/bin/env bash
# One command for a fresh GPU machine without network: build the extension, check every op against
# PyTorch, run the tests and the benchmarks on the GPU, and leave every log, CSV, markdown and PNG
# in one folder, with a summary printed last.
#   REMAT_COMMIT=$(git rev-parse --short HEAD) ARCHIVE_DIR=DIR bash bench/gpu_check.sh [OUT_DIR]
# OUT_DIR defaults to bench/out/gpu_check. Uses the python3 and torch already installed there.
#
# Time: at most GPU_CHECK_BUDGET seconds (560). Each step has its own limit (SIGINT 5 s before
# it, on which the Python steps write what they have, and SIGKILL at it), cheapest first; those
# that always run sum to 550 s (the last 10 are for the summary):
#   environment 15, install (Triton only) 25, build of the CUDA extension 125 (if it fails: reinstall
#   without it, 15, and go on with Triton), smoke check 30, GPU tests 50 (kernels) + 30 (the rest), benchmarks:
#   layernorm 25, rms_norm 20, gelu 25, gated 20, mlp 25, attention 70, block 75. The build's limit is a
# guess until a GPU run measures it: the sources compile in parallel (MAX_JOBS), and the longest,
# rms_norm.cu (the RMSNorm styles' 423 kernels), takes 75 s for sm_90 on one core of a CI machine
# (attention.cu 37 s; with LayerNorm's kernels in the same file it took 93 s), plus pip's own time.
# Then, only with the time left: the exhaustive autotune-candidate test, `remat memory`, and
# compute-sanitizer's racecheck when GPU_CHECK_RACECHECK=1. A step is never given more than what
# is left of the budget.
# In the background, from the install to the first benchmark, other processes compile what the
# benchmarks would otherwise compile inside their limits: remat's attention kernels
# (warm_triton_cache.py) and the torch.compile and FlexAttention peers (warm_compile_cache.py);
# compute-sanitizer's memcheck runs the CUDA extension's kernels while the tests run.
# The benchmarks write their CSV after every case, so a suite cut short keeps what it measured.
# Results carry the GPU, driver, torch, triton and commit: on a copy of the tree without .git,
# pass REMAT_COMMIT. When $ARCHIVE_DIR is set, everything is also packed into
# $ARCHIVE_DIR/gpu_check.tar.gz, with summary.txt and console.log beside it.
set -uo pipefail
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-560}
RESERVE=10  # for the summary and the archive
SUITES=(layernorm rms_norm gelu gated mlp attention block)
START=$SECONDS

# Limits, in seconds (the sum of those that always run is printed first).
L_ENV=15 L_INSTALL=25 L_BUILD=125 L_REINSTALL=15 L_SMOKE=30 L_TESTS_KERNELS=50 L_TESTS_REST=30
declare -A L_BENCH=([layernorm]=25 [rms_norm]=20 [gelu]=25 [gated]=20 [mlp]=25 [attention]=70 [block]=75)

FAILED=0  # the exit status: 1 when a step failed or ran out of time
record() {  # record STEP LIMIT SECONDS STATUS: a row of steps.tsv, and a line on the console
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEPS"
    echo "   $1: $4 ($3 s)"
}

status_of() {
    case $1 in
        0) echo "ok" ;;
        124) echo "timed out" ;;
        137) echo "killed at its limit" ;;
        *) echo "failed (exit $1)" ;;
    esac
}

# run_step NAME LIMIT LOG CMD...: CMD with SIGINT at LIMIT - 5 s and SIGKILL at LIMIT, given no
# more than what is left of the budget (skipped under 10 s); its output goes to LOG.
run_step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET - RESERVE - (SECONDS - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        record "$name" "$limit" 0 "skipped: no time left"
        return 1
    fi
    echo "== $name (limit $limit s, $(date +%T))"
    local begin=$SECONDS
    timeout -k 5 -s INT $((limit - 5)) "$@" > "$log" 2>&1
    local rc=$?
    record "$name" "$limit" $((SECONDS - begin)) "$(status_of $rc)"
    [ $rc -ne 0 ] && FAILED=1
    return $rc
}

declare -A BACKGROUND=()
# background NAME LIMIT CMD...: CMD at low CPU priority, in its own process group (timeout's), so
# that it and its worker processes can be stopped together; output in NAME.log.
background() {
    local name=$1 limit=$2
    shift 2
    nice -n 10 timeout -k 5 -s INT "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 &
    BACKGROUND[$name]=$!
}

# finish_background NAME DEADLINE: waited for until $SECONDS reaches DEADLINE, then stopped if it
# still runs (the benchmarks need a quiet machine); its row in steps.tsv says how it ended;
# returns its exit status.
finish_background() {
    local name=$1 deadline=$2 pid=${BACKGROUND[$1]:-}
    [ -z "$pid" ] && return
    while [ "$SECONDS" -lt "$deadline" ] && jobs -rp | grep -qx "$pid"; do sleep 1; done
    local how=""
    if jobs -rp | grep -qx "$pid"; then
        kill -INT -- -"$pid" 2> /dev/null
        sleep 2
        kill -KILL -- -"$pid" 2> /dev/null
        how="stopped, still running: "
    fi
    wait "$pid"
    local rc=$?
    record "background: $name" "-" "-" "$how$(status_of $rc); $(tail -n 1 "$OUT_DIR/$name.log" 2> /dev/null | cut -c1-120)"
    unset "BACKGROUND[$name]"
    return $rc
}

sanitize() {  # sanitize TOOL: the CUDA extension's kernels under compute-sanitizer
    compute-sanitizer --tool "$1" --error-exitcode 3 "$PYTHON" bench/sanitize_check.py > "$OUT_DIR/sanitizer_$1.log" 2>&1
    local rc=$?
    echo "compute-sanitizer $1: exit $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all ops ran|not supported" \
        "$OUT_DIR/sanitizer_$1.log" | tail -n 2 | tr '\n' ' ')"
    return $rc
}

# pytest_group NAME LIMIT PER_TEST ARGS...: one group of GPU tests as a step, with a budget per
# test (pytest-timeout when installed) and several workers (pytest-xdist when installed).
pytest_group() {
    local name=$1 limit=$2 per_test=$3
    shift 3
    local options=(-q -p no:cacheprovider --durations=30 --junitxml="$OUT_DIR/pytest_$name.xml")
    "$PYTHON" -c "import xdist" 2> /dev/null && options+=(-n 8)
    "$PYTHON" -c "import pytest_timeout" 2> /dev/null && options+=(--timeout "$per_test")
    # SIGINT: pytest stops, prints its summary and writes the junit XML of what ran.
    run_step "tests: $name" "$limit" "$OUT_DIR/pytest_$name.log" "$PYTHON" -m pytest "${options[@]}" "$@"
    tail -n 1 "$OUT_DIR/pytest_$name.log"
}

# The CUDA attention kernels' tests first: pytest-xdist hands tests out in this order, so a group
# cut at its limit has run them, the hand-written tensor-core code that no other check exercises
# on a GPU (the Triton attention kernels they compare with are among warm_triton_cache's).
KERNEL_TESTS=(tests/ops/test_attention_cuda.py tests/ops/test_layer_norm.py tests/ops/test_rms_norm_kernels.py
    tests/ops/test_gelu.py tests/ops/test_gated_kernels.py tests/ops/test_attention.py
    tests/ops/test_attention_features.py tests/ops/test_attention_dropout.py tests/ops/test_attention_varlen.py
    tests/fused/test_fused.py tests/fused/test_gated_mlp.py)
KERNEL_SELECTION="cuda and not opcheck and not torch_compile"  # the GPU targets' numerics, bf16 attention included
EXHAUSTIVE="every_candidate_matches_the_reference"  # ~200 compiles: only with time left

main() {
    : > "$STEPS"
    printf 'step\tlimit\tseconds\tstatus\n' >> "$STEPS"
    local always=$((L_ENV + L_INSTALL + L_BUILD + L_REINSTALL + L_SMOKE + L_TESTS_KERNELS + L_TESTS_REST))
    for suite in "${SUITES[@]}"; do always=$((always + L_BENCH[$suite])); done
    echo "gpu_check: budget $BUDGET s; the steps that always run have limits summing to $always s; output in $OUT_DIR"
    [ -z "${REMAT_COMMIT:-}" ] && ! git rev-parse HEAD > /dev/null 2>&1 \
        && echo "warning: no git folder and no REMAT_COMMIT: results will say commit unknown"

    run_step "environment" $L_ENV "$OUT_DIR/environment.txt" bash -c \
        "nvidia-smi; \"$PYTHON\" -c \"import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)\""
    tail -n 1 "$OUT_DIR/environment.txt"

    # remat without its CUDA extension first (seconds): the cache warmers can start during the build.
    run_step "install (Triton only)" $L_INSTALL "$OUT_DIR/install.log" \
        env REMAT_SKIP_CUDA_BUILD=1 "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
    background warm_triton_cache 240 "$PYTHON" bench/warm_triton_cache.py --jobs 6 --dtypes bfloat16 float16
    background warm_compile_cache 240 env TORCHINDUCTOR_COMPILE_THREADS=1 "$PYTHON" bench/warm_compile_cache.py

    # `remat info` after the install: which backends the steps below get.
    local then_info="&& \"$PYTHON\" -m remat info > \"$OUT_DIR/backends.txt\""
    if ! run_step "build (CUDA extension)" $L_BUILD "$OUT_DIR/build.log" bash -c "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
            MAX_JOBS=${MAX_JOBS:-16} \"$PYTHON\" -m pip install --no-build-isolation --no-deps -e . $then_info"; then
        tail -n 20 "$OUT_DIR/build.log"
        run_step "reinstall (Triton only)" $L_REINSTALL "$OUT_DIR/reinstall.log" bash -c \
            "REMAT_SKIP_CUDA_BUILD=1 \"$PYTHON\" -m pip install --no-build-isolation --no-deps -e . $then_info"
    fi
    cat "$OUT_DIR/backends.txt" 2> /dev/null

    run_step "smoke" $L_SMOKE "$OUT_DIR/smoke.log" "$PYTHON" bench/smoke_check.py --out "$OUT_DIR/smoke"
    tail -n 1 "$OUT_DIR/smoke.log"

    # The background work may use what the tests' limits leave: it ends when they would have.
    local tests_end=$((SECONDS + L_TESTS_KERNELS + L_TESTS_REST))
    if command -v compute-sanitizer > /dev/null; then
        background memcheck $((L_TESTS_KERNELS + L_TESTS_REST)) bash -c "$(declare -f sanitize); OUT_DIR='$OUT_DIR' PYTHON='$PYTHON' sanitize memcheck"
    else
        echo "compute-sanitizer not found: memory checks skipped" > "$OUT_DIR/memcheck_summary.txt"
    fi
    # The ahead-of-time compile checks need no GPU and run in CI: left out here for time.
    pytest_group kernels $L_TESTS_KERNELS 30 "${KERNEL_TESTS[@]}" -k "$KERNEL_SELECTION"
    pytest_group rest $L_TESTS_REST 20 tests --ignore tests/build/test_cuda_compile.py --ignore tests/build/test_triton_aot.py \
        -k "not ($KERNEL_SELECTION) and not $EXHAUSTIVE and not compiles_without_spills"
    if [ -n "${BACKGROUND[memcheck]:-}" ]; then
        finish_background memcheck $tests_end || FAILED=1
        tail -n 1 "$OUT_DIR/memcheck.log" > "$OUT_DIR/memcheck_summary.txt"
    fi
    # A warmer still running is stopped: what it compiled is in the caches, the rest compiles in its step.
    finish_background warm_triton_cache $tests_end
    finish_background warm_compile_cache $tests_end
    for suite in "${SUITES[@]}"; do
        run_step "bench: $suite" "${L_BENCH[$suite]}" "$OUT_DIR/bench_$suite.log" "$PYTHON" -m remat bench "$suite" \
            --quick --dtype bf16 --no-progress --out "$OUT_DIR/bench/$suite"
        grep -E "^wrote" "$OUT_DIR/bench_$suite.log"
    done

    # Only with the time left, most useful first.
    pytest_group exhaustive 90 60 tests/ops/test_autotune.py -k "$EXHAUSTIVE"
    run_step "memory" 40 "$OUT_DIR/memory.log" "$PYTHON" -m remat memory --model gpt2-medium --batch 8 --seq 1024 \
        --budget 20 --out "$OUT_DIR/memory"
    if [ "${GPU_CHECK_RACECHECK:-0}" = 1 ] && command -v compute-sanitizer > /dev/null; then
        run_step "racecheck" 120 "$OUT_DIR/racecheck.log" bash -c "$(declare -f sanitize); OUT_DIR='$OUT_DIR' PYTHON='$PYTHON' sanitize racecheck"
    fi

    timeout 10 "$PYTHON" bench/summarize.py "$OUT_DIR" --budget "$BUDGET" --elapsed $((SECONDS - START)) \
        > "$OUT_DIR/summary.txt" 2>&1 || cat "$STEPS" >> "$OUT_DIR/summary.txt"
    cat "$OUT_DIR/summary.txt"
    return $FAILED
}

# Run, unless sourced (tests/tools/test_bench_gpu_check.py sources it to test run_step's budget).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    cd "$(dirname "$0")/.."
    OUT_DIR=${1:-bench/out/gpu_check}
    mkdir -p "$OUT_DIR"
    STEPS="$OUT_DIR/steps.tsv"
    export PYTHONUNBUFFERED=1  # logs written as they happen: a step killed at its limit keeps them
    export REMAT_CACHE_DIR=${REMAT_CACHE_DIR:-$OUT_DIR/autotune}  # attention blocks tuned here, kept with the results
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/remat-gpu-check-inductor}
    # The pipeline ends only when tee has written everything: the archive has the whole console.
    main 2>&1 | tee "$OUT_DIR/console.log"
    status=${PIPESTATUS[0]}
    if [ -n "${ARCHIVE_DIR:-}" ]; then
        mkdir -p "$ARCHIVE_DIR"
        tar czf "$ARCHIVE_DIR/gpu_check.tar.gz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
        cp "$OUT_DIR/summary.txt" "$OUT_DIR/console.log" "$ARCHIVE_DIR/"
    fi
    exit $status
fi
