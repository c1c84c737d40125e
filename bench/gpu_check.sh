#!/usr/bin/env bash
# One command for a fresh GPU machine without network: install and build remat, check every op
# against PyTorch, run the GPU tests and the benchmarks, and bring every log and table back in one
# archive, with a summary printed last. docs/gpu_check.md has the whole procedure.
#
# The call, in the repository root of the copy of a clean tree on the GPU machine, whose folder
# $OUT comes back (at most 8 files of it): with a time limit of 420 s for the command,
#   REMAT_COMMIT=<commit> bash bench/gpu_check.sh
# (420 s: the 380 s budget, the last summary and archive, a margin). In the local checkout,
# `bash bench/gpu_check.sh --command` checks that nothing is uncommitted (the results must name the
# code that ran) and prints that line with the commit filled in. What comes back, in $OUT:
# summary.txt (read it first), console.log, and gpu_check.tar.gz (every log, CSV, markdown and
# plot), each rewritten after every step: a command killed at any point still brings back what
# the steps before it made. Then, locally:
#   bash scripts/unpack_gpu_results.sh gpu_check.tar.gz
# puts its tables under bench/results/<date>-<gpu>-<commit>/, ready to commit.
#
# Time: at most GPU_CHECK_BUDGET seconds (380), 10 of them for the summary and archive after each
# step. With the machine's start (1-3 minutes) a first run takes 7-9 minutes of a 15-minute
# allocation, and leaves time for a targeted rerun (the settings below). The steps that always run
# come first, cheapest first; their limits and their modelled times on the H200 machine are in the
# table below, the reason for each model beside it. The rest (`remat bench moe`, `remat memory`,
# more tests, the exhaustive autotune test, racecheck) runs only with the time left. Each step gets
# SIGINT 5 s before its limit (the Python steps then write what they have) and SIGKILL at it, and
# never more than what is left of the budget. bench/dry_run_gpu_check.sh runs this script with
# stubs on any machine, in seconds, on the modelled clock, and prints the modelled totals.
# In the background from the install, and ended before the first benchmark (timings need a quiet
# machine): the warmers, which compile what the smoke check and the benchmarks launch (remat's
# Triton kernels at the benchmarks' shapes, every attention tuning candidate among them; the
# torch.compile and FlexAttention peers, a case per process); the GPU tests of the Triton kernels
# (they need no CUDA extension: they run during its build); after the build, those of the CUDA
# backend and compute-sanitizer's memcheck of every kernel, beside the smoke check.
#
# Settings, for a targeted rerun (environment variables):
#   GPU_CHECK_SUITES="attention block"   the benchmark suites (default: layernorm rms_norm gelu gated mlp
#                                        attention block; attention_varlen, linear_cross_entropy and
#                                        experts (or moe, its other name) run only when named here;
#                                        experts also runs with the time left, as the extra moe)
#   GPU_CHECK_SKIP_BUILD=1               no CUDA extension: the Triton kernels only
#   GPU_CHECK_SKIP_SMOKE=1               no smoke check
#   GPU_CHECK_SKIP_TESTS=1               no GPU tests and no memcheck
#   GPU_CHECK_EXTRAS="memory rest"       what runs with the time left, in order (default: moe memory
#                                        rest exhaustive; "" for none; moe: `remat bench moe`, the experts
#                                        suite, unless GPU_CHECK_SUITES has it); GPU_CHECK_RACECHECK=1
#                                        adds racecheck
#   GPU_CHECK_LIMITS="bench_attention=150 build=120"   a step's limit in seconds, by its key below
#   GPU_CHECK_BUDGET=380                 the whole run's seconds
#   ARCHIVE_DIR=DIR                      where the archive, summary.txt and console.log go (default:
#                                        $OUT when it is set, else nowhere: the work folder only)
#   bash bench/gpu_check.sh [WORK_DIR]   the work folder, every file (default bench/out/gpu_check;
#                                        never inside $OUT, which takes 8 files at most)
set -uo pipefail
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-380}
# For the summary and archive rewritten after every step (~0.3 s each: a Python reading a few CSVs,
# tar of a few MB; ~4 s in all) and the last ones.
RESERVE=10
WARM_WAIT=90  # the benchmarks wait for the warmers until at least this long after they started
MAX_ARCHIVE_BYTES=$((15 * 1024 * 1024))  # what comes back: 16 MiB a file
ALL_SUITES=(layernorm rms_norm gelu gated mlp attention block)
KNOWN_SUITES=" ${ALL_SUITES[*]} attention_varlen linear_cross_entropy experts "  # the last three: only when asked for
declare -A SUITE_ALIASES=([moe]=experts)  # remat.bench.ALIASES: GPU_CHECK_SUITES takes these names too
EXTRA_SUITES=()  # suites run with the time left (the extra moe): warmed with the others, and in the summary
PIP_INSTALL=(-m pip install --no-index --disable-pip-version-check --no-build-isolation --no-deps -e .)

declare -A NAME LIMIT MODEL
set_step() {  # set_step KEY LIMIT MODEL NAME: a step's limit and modelled time, in seconds
    LIMIT[$1]=$2 MODEL[$1]=$3 NAME[$1]=$4
}
# Modelled on the H200 machine (16 cores, torch 2.11, Triton 3.6), until a run measures them
# (steps.tsv and the summary give each step's real seconds). A limit is its model, plus the 5 s
# between SIGINT and SIGKILL, plus a margin.
#        key              limit model  name                          why the model
set_step environment        10    5  "environment"               # nvidia-smi ~1 s; a Python importing torch and triton ~3 s (cold disk)
set_step install            14    8  "install (Triton only)"     # pip without index or isolation ~2 s; setuptools' editable wheel ~4 s; nothing compiles
set_step build              95   85  "build (CUDA extension)"    # 6 sources in parallel; the longest, rms_norm.cu (423 kernels), 75 s for sm_90 on one CI core; pip and the link ~10 s
set_step reinstall          14    8  "reinstall (Triton only)"   # as install; only when a failed build left no importable remat
set_step smoke              40   30  "smoke"                     # 14 (suite, dtype) processes at once, ~8 s to start side by side; the longest group, attention: 27 remat runs and 9 float64 references up to s=16384, ~20 s; kernels compiled by the warmer
set_step wait               20    0  "wait for the background work"  # how long the benchmarks wait after the smoke check; the model of each job below says
set_step bench_layernorm    15    9  "bench: layernorm"          # each suite: ~4 s to start (torch, remat, CUDA, nvidia-smi); then 4 cases x 4 implementations x ~25 sub-ms calls with their checks ~2 s; torch.compile loaded from the cache ~1.5 s a shape
set_step bench_rms_norm     15    9  "bench: rms_norm"           # as layernorm: 4 cases
set_step bench_gelu         15    9  "bench: gelu"               # as layernorm: 6 smaller cases
set_step bench_gated        15    9  "bench: gated"              # as layernorm: 4 cases
set_step bench_mlp          17   11  "bench: mlp"                # 3 cases of matmul-bound layers (ms calls) and their float64 checks ~5 s
set_step bench_attention    65   55  "bench: attention"          # 27 tuning decisions x ~5 compiled candidates, each timed in <= 40 ms, ~15 s; 27 cases x 7 implementations x ~25 calls of 1-20 ms ~20 s; 9 float64 references ~5 s; 8 FlexAttention graphs from Inductor's cache (Dynamo still traces) ~8 s
set_step bench_block        44   35  "bench: block"              # 14 policies of a 2-layer GPT block (b=8 s=2048 h=2048), each checked, then ~25 steps of ~15 ms: ~15 s; 5 compiled policies from the cache, Dynamo tracing ~3 s each
# Only when asked for (GPU_CHECK_SUITES), not yet measured, not in the budget above.
set_step bench_attention_varlen 25 18 "bench: attention_varlen"  # 6 cases, 2 FlexAttention graphs, its tuning
set_step bench_linear_cross_entropy 40 30 "bench: linear_cross_entropy"  # 3 vocabularies at 8192 tokens: products of ~5e13 FLOP, their float64 references, a torch.compile peer
# In the background, niced (limit: the longest one may live; the wait before the benchmarks ends it earlier).
set_step warm_triton       300   75  "warm Triton kernels"       # 44 (suite, dtype, case) items (46 with the extra moe's experts) in 6 processes: ~160 kernels (every bf16 attention candidate of 7 variants, ~100) at ~2.5 s for sm_90
set_step warm_compile      300  100  "warm torch.compile peers"  # 25 (suite, implementation, case) items in 8 processes: 8 FlexAttention graphs ~30 s each, 5 GPT-block policies ~45 s, 12 small graphs ~8 s: ~560 core-seconds
set_step tests_triton      300  120  "tests: triton"             # from the install: pytest, 4 workers; ~420 tests whose ragged shapes compile their own kernels (~300 at ~1.5 s)
set_step tests_cuda        300   25  "tests: cuda"               # from the build's end: pytest, 8 workers, ~10 s to import and collect; ~400 tests of precompiled kernels ~0.1 s each
set_step memcheck          300   50  "memcheck"                  # from the build's end: compute-sanitizer starting torch ~25 s, then every op's small calls ~25 s
# With the time left.
set_step bench_experts      60   35  "bench: experts"            # remat bench moe: ~4 s to start, transformers ~3 s to import; 2 cases (fwd, fwd+bwd) of Qwen3-30B-A3B's experts at 1024 tokens, each checked against float64; remat's two policies (Triton kernels warmed), two eager loops over 128 experts (~50 ms a call with a sync per expert) ~6 s, grouped_mm; batched_mm skipped (77 GB of gathered weights); Liger, when installed, untuned (LIGER_FUSED_MOE_AUTOTUNE=0): ~8 kernels to compile, ~20 s more
set_step memory             40   25  "memory"                    # remat memory on gpt2-medium: each policy measured once
set_step tests_rest        150  120  "tests: rest"               # the rest of the suite (Hugging Face models, planner, CLI), 8 workers
set_step tests_exhaustive   90   60  "tests: exhaustive"         # every tuning candidate of 5 head dims x 3 dtypes: ~200 compiles, 8 workers
set_step racecheck         120   90  "racecheck"                 # compute-sanitizer's racecheck is ~10x slower than memcheck on the same calls

# The GPU tests in groups. The kernel files' GPU tests run first, in two groups: the Triton
# kernels' (no CUDA extension needed, so during its build) and the CUDA backend's after it. -k
# matches the file names too, so the rest group leaves out exactly what those two ran.
KERNEL_FILES=(test_attention_cuda.py test_layer_norm.py test_rms_norm_kernels.py test_gelu.py test_gated_kernels.py
    test_attention.py test_attention_features.py test_attention_dropout.py test_attention_varlen.py)
FUSED_FILES=(test_fused.py test_gated_mlp.py)
KERNEL_TESTS=("${KERNEL_FILES[@]/#/tests/ops/}" "${FUSED_FILES[@]/#/tests/fused/}")
IN_KERNEL_FILES="($(printf '%s or ' "${KERNEL_FILES[@]}" "${FUSED_FILES[@]}" | sed 's/ or $//'))"
SELECT_TRITON="$IN_KERNEL_FILES and cuda-triton and not opcheck and not torch_compile"
SELECT_CUDA="$IN_KERNEL_FILES and cuda and not cuda-triton and not opcheck and not torch_compile"
EXHAUSTIVE="every_candidate_matches_the_reference"  # ~200 compiles: only with time left

MODEL_TIME=${GPU_CHECK_MODEL_TIME:-0}  # 1 (the dry run): the clock is the sum of the modelled times
CLOCK=0
now() {  # seconds since the start: real ones, or the modelled ones in the dry run
    if [ "$MODEL_TIME" = 1 ]; then echo "$CLOCK"; else echo $((SECONDS - START)); fi
}

FAILED=0  # the exit status: 1 when a step failed or ran out of time
PART=always  # the part of the run the steps now belong to: always, extra (with the time left), background
LAST_STEP=""
add_row() {  # add_row STEP LIMIT SECONDS STATUS: a row of steps.tsv and a line on the console
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$PART" >> "$STEPS"
    echo "   $1: $4 ($3 s)"
    LAST_STEP=$1
}

record() {  # record STEP LIMIT SECONDS STATUS: add_row, then the summary and the archive rewritten
    add_row "$@"
    checkpoint
}

status_of() {
    case $1 in
        0) echo "ok" ;;
        124) echo "timed out" ;;
        137) echo "killed at its limit" ;;
        *) echo "failed (exit $1)" ;;
    esac
}

# run_step KEY LOG CMD...: CMD with SIGINT at its limit - 5 s and SIGKILL at the limit, given no more
# than what is left of the budget (skipped under 10 s); its output goes to LOG.
run_step() {
    local key=$1 log=$2
    shift 2
    local name=${NAME[$key]:-$key} limit=${LIMIT[$key]}
    local left=$((BUDGET - RESERVE - $(now)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        record "$name" "$limit" 0 "skipped: no time left"
        return 1
    fi
    echo "== $name (limit $limit s, $(date +%T))"
    local begin=$SECONDS model=()
    # The dry run's stubs take the modelled time from here: a step modelled past its limit times out there.
    [ "$MODEL_TIME" = 1 ] && model=(env "GPU_CHECK_STEP_MODEL=${MODEL[$key]:-0}")
    "${model[@]}" timeout -k 5 -s INT $((limit - 5)) "$@" > "$log" 2>&1
    local rc=$? seconds=$((SECONDS - begin))
    if [ "$MODEL_TIME" = 1 ]; then
        seconds=${MODEL[$key]:-0}
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then seconds=$limit; fi
        CLOCK=$((CLOCK + seconds))
    fi
    record "$name" "$limit" "$seconds" "$(status_of $rc)"
    # What runs with the time left may be cut by the budget: no failure. Everything else that fails is.
    if [ $rc -ne 0 ] && ! { [ "$PART" = extra ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; }; }; then FAILED=1; fi
    return $rc
}

skip_step() {  # skip_step KEY WHY: a row saying that the step was left out, and why
    record "${NAME[$1]}" "-" 0 "skipped: $2"
}

declare -A BACKGROUND=() BACKGROUND_BEGIN=() BACKGROUND_LOG=()
# background KEY LOG CMD...: CMD at low CPU priority, in its own process group (timeout's), so that it
# and its worker processes can be stopped together; output in LOG.
background() {
    local key=$1 log=$2
    shift 2
    nice -n 10 timeout -k 5 -s INT "${LIMIT[$key]}" "$@" > "$log" 2>&1 &
    BACKGROUND[$key]=$! BACKGROUND_BEGIN[$key]=$(now) BACKGROUND_LOG[$key]=$log
}

running() { jobs -rp | grep -qx "$1"; }

# finish_background KEY DEADLINE: waited for until the clock reaches DEADLINE, then stopped if it
# still runs; its row in steps.tsv says how it ended; returns its exit status (1 when stopped).
finish_background() {
    local key=$1 deadline=$2 pid=${BACKGROUND[$1]:-}
    [ -z "$pid" ] && return 0
    while [ "$(now)" -lt "$deadline" ] && running "$pid"; do sleep 1; done
    local stopped=0
    if running "$pid"; then
        kill -INT -- -"$pid" 2> /dev/null
        sleep 2
        kill -KILL -- -"$pid" 2> /dev/null
        stopped=1
    fi
    wait "$pid"
    local rc=$? seconds=$(($(now) - BACKGROUND_BEGIN[$key]))
    if [ "$MODEL_TIME" = 1 ]; then  # the stub has long finished: the model says when the real one would
        local end=$((BACKGROUND_BEGIN[$key] + MODEL[$key]))
        seconds=${MODEL[$key]}
        if [ "$end" -gt "$deadline" ]; then
            stopped=1 end=$deadline seconds=$((deadline - BACKGROUND_BEGIN[$key]))
        fi
        [ "$end" -gt "$CLOCK" ] && CLOCK=$end
    fi
    unset "BACKGROUND[$key]"
    local status
    status=$([ $stopped -eq 1 ] && echo "stopped, still running" || status_of $rc)
    PART=background add_row "background: ${NAME[$key]}" "-" "$seconds" \
        "$status; $(tail -n 1 "${BACKGROUND_LOG[$key]}" 2> /dev/null | cut -c1-120)"
    [ $stopped -eq 1 ] && return 1
    return $rc
}

# quiet_point DEADLINE: every background job ended (waited for until DEADLINE, then stopped) before
# the benchmarks; the wait is a step of its own.
quiet_point() {
    local deadline=$1 begin key
    begin=$(now)
    for key in warm_triton warm_compile tests_triton tests_cuda memcheck; do
        [ -n "${BACKGROUND[$key]:-}" ] || continue
        case $key in
            # A warmer stopped early is no failure: what it compiled is cached, the rest compiles in its step.
            warm_*) finish_background "$key" "$deadline" ;;
            *) finish_background "$key" "$deadline" || FAILED=1 ;;
        esac
        [ "$key" = memcheck ] && tail -n 1 "$OUT_DIR/memcheck.log" > "$OUT_DIR/memcheck_summary.txt"
    done
    local most=$((deadline - begin))
    [ $most -lt 0 ] && most=0
    record "${NAME[wait]}" "$most" "$(($(now) - begin))" "ok"
}

sanitize() {  # sanitize TOOL: every kernel's small calls under compute-sanitizer
    compute-sanitizer --tool "$1" --error-exitcode 3 "$PYTHON" bench/sanitize_check.py > "$OUT_DIR/sanitizer_$1.log" 2>&1
    local rc=$?
    echo "compute-sanitizer $1: exit $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all ops ran|not supported" \
        "$OUT_DIR/sanitizer_$1.log" | tail -n 2 | tr '\n' ' ')"
    return $rc
}

# pytest_command GROUP WORKERS PER_TEST ARGS...: sets PYTEST to the command of one group of GPU tests,
# with a limit per test (pytest-timeout when installed) and several workers (pytest-xdist when installed).
pytest_command() {
    local group=$1 workers=$2 per_test=$3
    shift 3
    PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider --durations=30 --junitxml="$OUT_DIR/pytest_$group.xml")
    [ "$HAVE_XDIST" = 1 ] && PYTEST+=(-n "$workers")
    [ "$HAVE_TIMEOUT" = 1 ] && PYTEST+=(--timeout "$per_test")
    # SIGINT: pytest stops, prints its summary and writes the junit XML of what ran.
    PYTEST+=("$@")
}

pytest_group() {  # pytest_group KEY WORKERS PER_TEST ARGS...: a group of GPU tests as a step
    local key=$1 group=${1#tests_}
    pytest_command "$group" "${@:2}"
    run_step "$key" "$OUT_DIR/pytest_$group.log" "${PYTEST[@]}"
    tail -n 1 "$OUT_DIR/pytest_$group.log"
}

checkpoint() {  # the summary rewritten and the archive repacked, after every step
    write_summary --running "$LAST_STEP"
    pack_archive
}

# write_summary [ARGS]: summary.txt from bench/summarize.py, replaced whole, in the work folder and
# beside the archive (a reader never sees half of one).
write_summary() {
    local summary="$OUT_DIR/summary.txt" modelled=()
    [ "$MODEL_TIME" = 1 ] && modelled=(--modelled)
    timeout 10 "$PYTHON" bench/summarize.py "$OUT_DIR" --budget "$BUDGET" --elapsed "$(now)" \
        --suites "${SUITES[@]}" "${EXTRA_SUITES[@]}" "${modelled[@]}" "$@" > "$summary.partial" 2>&1 || cat "$STEPS" >> "$summary.partial"
    mv -f "$summary.partial" "$summary"
    if [ -n "${ARCHIVE_DIR:-}" ]; then
        cp "$summary" "$ARCHIVE_DIR/summary.txt.partial" && mv -f "$ARCHIVE_DIR/summary.txt.partial" "$ARCHIVE_DIR/summary.txt"
    fi
}

# pack_archive: the work folder as ARCHIVE_DIR/gpu_check.tar.gz, replaced whole. Over the size that
# comes back, it is packed again without the files over 1 MiB (a runaway log; the tables are small).
pack_archive() {
    [ -n "${ARCHIVE_DIR:-}" ] || return 0
    local archive="$ARCHIVE_DIR/gpu_check.tar.gz" parent folder big=()
    parent=$(dirname "$OUT_DIR") folder=$(basename "$OUT_DIR")
    # Exit status 1 is "a file changed as it was read": console.log grows while it is packed.
    tar czf "$archive.partial" -C "$parent" "$folder" 2> /dev/null
    [ $? -le 1 ] || { rm -f "$archive.partial"; return 0; }
    if [ "$(wc -c < "$archive.partial")" -gt "$MAX_ARCHIVE_BYTES" ]; then
        while IFS= read -r file; do big+=(--exclude="$file"); done < <(cd "$parent" && find "$folder" -type f -size +1M)
        tar czf "$archive.partial" -C "$parent" "${big[@]}" "$folder" 2> /dev/null
        echo "the archive was over $((MAX_ARCHIVE_BYTES >> 20)) MiB: packed without ${#big[@]} files over 1 MiB"
    fi
    mv -f "$archive.partial" "$archive"
}

# commit_tag: the commit the results name. In a git checkout (this tree's own, not one around it),
# its HEAD ("-dirty" when the tree has changes, with a warning when REMAT_COMMIT says otherwise); in
# a copy without .git, REMAT_COMMIT.
commit_tag() {
    local head dirty=""
    if [ "$(git rev-parse --show-toplevel 2> /dev/null)" = "$(pwd -P)" ] && head=$(git rev-parse --short=12 HEAD 2> /dev/null); then
        [ -n "$(git status --porcelain 2> /dev/null)" ] && dirty="-dirty"
        if [ -n "${REMAT_COMMIT:-}" ] && [[ $head != "$REMAT_COMMIT"* ]] && [[ $REMAT_COMMIT != "$head"* ]]; then
            echo "warning: REMAT_COMMIT=$REMAT_COMMIT but this tree is at $head: the results name $head$dirty" >&2
        fi
        [ -n "$dirty" ] && echo "warning: the tree has uncommitted changes: the results name $head$dirty" >&2
        echo "$head$dirty"
    elif [ -n "${REMAT_COMMIT:-}" ]; then
        echo "$REMAT_COMMIT"
    else
        echo "warning: no git folder and no REMAT_COMMIT: the results name commit unknown" >&2
        echo "unknown"
    fi
}

print_command() {  # the call for the GPU machine, after checking that the local tree is clean
    local changes
    changes=$(git status --porcelain) || return 1
    if [ -n "$changes" ]; then
        printf 'error: the tree has uncommitted changes; commit them first, so that the results name the code that ran:\n%s\n' \
            "$changes" >&2
        return 1
    fi
    echo "REMAT_COMMIT=$(git rev-parse --short=12 HEAD) bash bench/gpu_check.sh"
}

is_set() { [ "${!1:-0}" = 1 ]; }

# The install, then the build with the warmers and the Triton tests beside it; `remat info` says which
# backends the steps below get.
install_and_build() {
    run_step install "$OUT_DIR/install.log" env REMAT_SKIP_CUDA_BUILD=1 "$PYTHON" "${PIP_INSTALL[@]}"
    start_background_work
    if is_set GPU_CHECK_SKIP_BUILD; then
        skip_step build "GPU_CHECK_SKIP_BUILD=1"
    elif ! run_step build "$OUT_DIR/build.log" env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
            MAX_JOBS="${MAX_JOBS:-16}" "$PYTHON" "${PIP_INSTALL[@]}"; then
        tail -n 20 "$OUT_DIR/build.log"
        # pip replaces an install only once the new one is built: the Triton-only one should remain.
        if ! "$PYTHON" -c "import remat" > /dev/null 2>&1; then
            run_step reinstall "$OUT_DIR/reinstall.log" env REMAT_SKIP_CUDA_BUILD=1 "$PYTHON" "${PIP_INSTALL[@]}"
        fi
    fi
    timeout 60 "$PYTHON" -m remat info > "$OUT_DIR/backends.txt" 2>&1
    cat "$OUT_DIR/backends.txt"
}

start_background_work() {
    local warm_suites=("${SUITES[@]}" "${EXTRA_SUITES[@]}")
    is_set GPU_CHECK_SKIP_SMOKE || warm_suites+=(layernorm rms_norm gelu gated mlp attention block)
    mapfile -t warm_suites < <(printf '%s\n' "${warm_suites[@]}" | awk '!seen[$0]++')
    WARM_STARTED=$(now)
    # bf16: every attention candidate (the benchmarks tune); fp16: the table's (the smoke check's)
    background warm_triton "$OUT_DIR/warm_triton.log" "$PYTHON" bench/warm_triton_cache.py --jobs 6 \
        --suites "${warm_suites[@]}" --dtypes bf16 fp16 --tuned bf16
    background warm_compile "$OUT_DIR/warm_compile.log" env TORCHINDUCTOR_COMPILE_THREADS=1 \
        "$PYTHON" bench/warm_compile_cache.py --jobs 8 --suites "${SUITES[@]}"
    if ! is_set GPU_CHECK_SKIP_TESTS && [ "$HAVE_PYTEST" = 1 ]; then
        pytest_command triton 4 30 "${KERNEL_TESTS[@]}" -k "$SELECT_TRITON"
        background tests_triton "$OUT_DIR/pytest_triton.log" "${PYTEST[@]}"
    fi
}

# The smoke check, with the CUDA backend's tests and memcheck beside it (none of them times anything).
correctness() {
    if is_set GPU_CHECK_SKIP_TESTS; then
        skip_step tests_cuda "GPU_CHECK_SKIP_TESTS=1"
    else
        if [ "$HAVE_PYTEST" != 1 ]; then
            skip_step tests_cuda "pytest is not installed"
        elif ! grep -q "^cuda *yes" "$OUT_DIR/backends.txt"; then
            skip_step tests_cuda "no CUDA extension (see the build)"
        else
            pytest_command cuda 8 30 "${KERNEL_TESTS[@]}" -k "$SELECT_CUDA"
            background tests_cuda "$OUT_DIR/pytest_cuda.log" "${PYTEST[@]}"
        fi
        if command -v compute-sanitizer > /dev/null; then
            background memcheck "$OUT_DIR/memcheck.log" bash -c \
                "$(declare -f sanitize); OUT_DIR='$OUT_DIR' PYTHON='$PYTHON' sanitize memcheck"
        else
            echo "compute-sanitizer not found: memory checks skipped" > "$OUT_DIR/memcheck_summary.txt"
        fi
    fi
    if is_set GPU_CHECK_SKIP_SMOKE; then
        skip_step smoke "GPU_CHECK_SKIP_SMOKE=1"
    else
        run_step smoke "$OUT_DIR/smoke.log" "$PYTHON" bench/smoke_check.py --out "$OUT_DIR/smoke"
        tail -n 1 "$OUT_DIR/smoke.log"
    fi
}

bench_suite() {  # bench_suite SUITE: its benchmark as a step
    run_step "bench_$1" "$OUT_DIR/bench_$1.log" "$PYTHON" -m remat bench "$1" \
        --quick --dtype bf16 --no-progress --out "$OUT_DIR/bench/$1"
    grep -E "^wrote" "$OUT_DIR/bench_$1.log"
}

benchmarks() {
    local suite
    for suite in "${SUITES[@]}"; do
        bench_suite "$suite"
    done
}

extras() {  # with the time left, in the order asked for
    local extra
    for extra in "${EXTRAS[@]}"; do
        case $extra in
            moe) [ ${#EXTRA_SUITES[@]} -gt 0 ] && bench_suite experts ;;
            memory) run_step memory "$OUT_DIR/memory.log" "$PYTHON" -m remat memory --model gpt2-medium --batch 8 \
                --seq 1024 --budget 20 --out "$OUT_DIR/memory" ;;
            rest) [ "$HAVE_PYTEST" = 1 ] && pytest_group tests_rest 8 20 tests --ignore tests/package/test_cuda_compile.py \
                --ignore tests/package/test_triton_aot.py \
                -k "not ($SELECT_TRITON) and not ($SELECT_CUDA) and not $EXHAUSTIVE and not compiles_without_spills" ;;
            exhaustive) [ "$HAVE_PYTEST" = 1 ] && pytest_group tests_exhaustive 8 60 tests/ops/test_autotune.py \
                -k "$EXHAUSTIVE" ;;
            racecheck) command -v compute-sanitizer > /dev/null && run_step racecheck "$OUT_DIR/racecheck.log" \
                bash -c "$(declare -f sanitize); OUT_DIR='$OUT_DIR' PYTHON='$PYTHON' sanitize racecheck" ;;
        esac
    done
}

always_run_keys() {  # the steps that always run in this configuration (the reinstall only after a failed build)
    local keys=(environment install)
    is_set GPU_CHECK_SKIP_BUILD || keys+=(build)
    is_set GPU_CHECK_SKIP_SMOKE || keys+=(smoke)
    keys+=(wait "${SUITES[@]/#/bench_}")
    echo "${keys[@]}"
}

main() {
    # Here: a pipeline's subshell does not inherit the caller's traps. SIGPIPE ignored: a signal that
    # also ends tee must not end this shell (on writing to the console) before its summary.
    trap on_signal TERM INT HUP
    trap '' PIPE
    printf 'step\tlimit\tseconds\tstatus\tpart\n' > "$STEPS"
    local key limits=0 modelled=0
    for key in $(always_run_keys); do
        limits=$((limits + LIMIT[$key])) modelled=$((modelled + MODEL[$key]))
    done
    echo "gpu_check: budget $BUDGET s; the steps that always run have limits summing to $limits s (+ $RESERVE s" \
        "for the summaries), modelled on the H200 at $modelled s and the wait for the background work;" \
        "work folder $OUT_DIR${ARCHIVE_DIR:+; archive in $ARCHIVE_DIR}"
    echo "commit $REMAT_COMMIT; suites: ${SUITES[*]}; with the time left: ${EXTRAS[*]:-nothing}"
    [ -n "$COMMIT_WARNINGS" ] && echo "$COMMIT_WARNINGS"
    HAVE_PYTEST=0 HAVE_XDIST=0 HAVE_TIMEOUT=0
    "$PYTHON" -c "import pytest" 2> /dev/null && HAVE_PYTEST=1
    "$PYTHON" -c "import xdist" 2> /dev/null && HAVE_XDIST=1
    "$PYTHON" -c "import pytest_timeout" 2> /dev/null && HAVE_TIMEOUT=1

    run_step environment "$OUT_DIR/environment.txt" bash -c \
        "nvidia-smi; \"$PYTHON\" -c \"import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)\""
    tail -n 1 "$OUT_DIR/environment.txt"
    echo "gpu=$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)" >> "$OUT_DIR/run.txt"

    install_and_build
    local correctness_start
    correctness_start=$(now)
    correctness
    # The background work may use the smoke check's limit and the wait's (the warmers at least
    # WARM_WAIT s from their start): then the benchmarks have the machine to themselves.
    local deadline=$((correctness_start + LIMIT[wait]))
    is_set GPU_CHECK_SKIP_SMOKE || deadline=$((deadline + LIMIT[smoke]))
    [ $deadline -lt $((WARM_STARTED + WARM_WAIT)) ] && deadline=$((WARM_STARTED + WARM_WAIT))
    quiet_point $deadline
    benchmarks
    echo "== the steps that always run took $(now) s$([ "$MODEL_TIME" = 1 ] && echo " (modelled on the H200)") of the $BUDGET s budget"

    PART=extra
    extras

    write_summary
    pack_archive
    cat "$OUT_DIR/summary.txt"
    return $FAILED
}

# on_signal: a run stopped from outside (SIGTERM, SIGINT, SIGHUP) leaves its summary and archive
# up to date first (SIGKILL cannot be caught: the last step's checkpoint is what comes back then).
on_signal() {
    trap '' PIPE TERM INT HUP
    PART=background record "interrupted" "-" "-" "stopped by a signal" > /dev/null 2>&1
    exit 143
}

# read_settings: the suites, the extras and the limits asked for; exits with a message when one is wrong.
read_settings() {
    local index suite extra limit
    read -r -a SUITES <<< "${GPU_CHECK_SUITES:-${ALL_SUITES[*]}}"
    for index in "${!SUITES[@]}"; do
        suite=${SUITE_ALIASES[${SUITES[$index]}]:-${SUITES[$index]}}
        SUITES[index]=$suite
        [[ $KNOWN_SUITES == *" $suite "* ]] || { echo "error: GPU_CHECK_SUITES: no suite '$suite' (known:$KNOWN_SUITES)" >&2; exit 2; }
    done
    read -r -a EXTRAS <<< "${GPU_CHECK_EXTRAS-moe memory rest exhaustive}"
    is_set GPU_CHECK_RACECHECK && EXTRAS+=(racecheck)
    for extra in "${EXTRAS[@]}"; do
        [[ " moe memory rest exhaustive racecheck " == *" $extra "* ]] \
            || { echo "error: GPU_CHECK_EXTRAS: no '$extra' (known: moe memory rest exhaustive racecheck)" >&2; exit 2; }
    done
    # The extra moe is the experts suite, run with the time left; not twice when GPU_CHECK_SUITES has it.
    if [[ " ${EXTRAS[*]} " == *" moe "* ]] && [[ " ${SUITES[*]} " != *" experts "* ]]; then
        EXTRA_SUITES=(experts)
    fi
    for limit in ${GPU_CHECK_LIMITS:-}; do
        [[ $limit =~ ^([a-z_]+)=([0-9]+)$ ]] && [ -n "${LIMIT[${BASH_REMATCH[1]}]:-}" ] \
            || { echo "error: GPU_CHECK_LIMITS: '$limit' is not KEY=SECONDS with a key of bench/gpu_check.sh's table" >&2; exit 2; }
        LIMIT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
    done
}

# setup WORK_DIR: the settings, the folders and the commit; exits with a message when one is wrong.
setup() {
    read_settings
    OUT_DIR=$(realpath -m "$1")
    ARCHIVE_DIR=${ARCHIVE_DIR:-${OUT:-}}
    if [ -n "$ARCHIVE_DIR" ]; then
        ARCHIVE_DIR=$(realpath -m "$ARCHIVE_DIR")
        case $OUT_DIR/ in
            "$ARCHIVE_DIR"/*) echo "error: the work folder $OUT_DIR is inside $ARCHIVE_DIR, which takes the archive alone;" \
                "give another one (default bench/out/gpu_check)" >&2; exit 2 ;;
        esac
    fi
    # A previous run's work folder (it has run.txt) is replaced: its files would travel with this run's.
    if [ -f "$OUT_DIR/run.txt" ]; then
        rm -rf "$OUT_DIR"
    elif [ -d "$OUT_DIR" ] && [ -n "$(ls -A "$OUT_DIR")" ]; then
        echo "error: the work folder $OUT_DIR holds files of something else: give an empty or new one" >&2
        exit 2
    fi
    mkdir -p "$OUT_DIR" ${ARCHIVE_DIR:+"$ARCHIVE_DIR"} || exit 2
    local tag
    tag=$(commit_tag 2>&1)  # its warnings, then the tag: main prints the warnings on the console
    REMAT_COMMIT=$(tail -n 1 <<< "$tag") COMMIT_WARNINGS=$(sed '$d' <<< "$tag")
    export REMAT_COMMIT
    STEPS="$OUT_DIR/steps.tsv"
    printf 'date=%s\ncommit=%s\n' "$(date -u +%Y-%m-%d)" "$REMAT_COMMIT" > "$OUT_DIR/run.txt"
}

# Run, unless sourced (tests/tools/test_bench_gpu_check.py sources it to test its functions).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    cd "$(dirname "$0")/.." || exit 2
    if [ "${1:-}" = "--command" ]; then
        print_command
        exit
    fi
    setup "${1:-bench/out/gpu_check}"
    START=$SECONDS
    export PYTHONUNBUFFERED=1  # logs written as they happen: a step killed at its limit keeps them
    # Liger's fused MoE (a peer in the experts suite, when installed) autotunes ~130 kernel configurations
    # on its first call, minutes: one configuration each here (its row says "autotune off").
    export LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0}
    export REMAT_CACHE_DIR=${REMAT_CACHE_DIR:-$OUT_DIR/autotune}  # attention blocks tuned here, kept with the results
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/remat-gpu-check-inductor}
    # Before any step: what comes back says the run started, even if it is killed at once.
    : > "$OUT_DIR/console.log"
    echo "gpu_check started $(date -u '+%F %T UTC'); no step has finished yet (console.log: what runs now)" \
        > "$OUT_DIR/summary.txt"
    if [ -n "$ARCHIVE_DIR" ]; then
        cp "$OUT_DIR/summary.txt" "$ARCHIVE_DIR/summary.txt"
        : > "$ARCHIVE_DIR/console.log"
    fi
    # The pipeline ends only when tee has written everything: both copies of the console are whole.
    main 2>&1 | tee "$OUT_DIR/console.log" ${ARCHIVE_DIR:+"$ARCHIVE_DIR/console.log"}
    exit "${PIPESTATUS[0]}"
fi
