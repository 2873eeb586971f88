#!/usr/bin/env bash
# Everything issue 5 needs from a GPU machine, in one command (the device tool's machines are
# lent for minutes: few, full calls). Run from the repository root on a machine with a CUDA GPU:
#
#     bash tools/gpu_checks.sh [STAGES]      # STAGES: comma list of env,build,test,sanitize,
#                                            # sanitize_chunked,marginals_backward,counts_backward,
#                                            # kbest_ab,bench,host,
#                                            # host_breakdown,train_step,test_chunked,time_parallel,
#                                            # host_trace,ab,host_ab,initcheck
#                                            # (default: env..train_step of the first line's set)
#
# Each stage is time-boxed so the whole run ends inside one device call (10 minutes); a stage
# that fails or runs out of time is reported and the next one still runs. Logs and results go to
# $OUT (the device tool's folder; ./gpu_out elsewhere). Environment:
#   CRFKIT_PREBUILT=path.so   use this build of crfkit._C instead of building (same torch only)
#   GPU_TEST_ARGS             extra pytest arguments for the test stages (e.g. -k kbest)
#   SANITIZE_K                the sanitize stage's -k expression (default: not compile)
#   BENCH_ARGS, BENCH_SHARE   arguments for benchmarks/bench_gpu.py (default --quick); its share of
#                             the time left (percent, default 45)
#   MARGINALS_BACKWARD_ARGS, MARGINALS_BACKWARD_SHARE  likewise for bench_gpu_marginals_backward.py
#                             (default: its shapes; 30 percent)
#   COUNTS_BACKWARD_ARGS, COUNTS_BACKWARD_SHARE  likewise for its --op expected_transition_counts
#   BUDGET_S                  seconds the whole run may take (default 560)
#   KBEST_AB_SHAPES           shapes of the kbest_ab stage (default 1x128x9,32x512x9,256x128x9,1024x128x9)
#   KBEST_AB_ROUNDS, KBEST_AB_KS, KBEST_AB_KERNELS  rounds, K values and kernels of the kbest_ab
#                             stage (default 3; 5 15; per_sentence per_tag)
#   AB_OLD                    the ab and host_ab stages: a source tree of other CUDA kernels (e.g.
#                             .gpu_payload/old from `git archive`; the build stage builds it beside
#                             this one); profile_gpu.py (ab) or profile_gpu_host.py and its
#                             --breakdown (host_ab) time both builds alternately, AB_ROUNDS times
#                             (default 2); ab on AB_SHAPES (default 1x128x9,256x128x9,32x512x9,1024x128x37)
#   INITCHECK_K               the initcheck stage's -k expression (default: kbest or viterbi)
# Peer libraries for the benchmark: wheels in .whl/ (and pure packages in .whl/pure/) are put
# on PYTHONPATH first, as the device tool's README describes; without them the peers are
# reported "not installed".
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${1:-env,build,test,sanitize,kbest_ab,bench,host,train_step}
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
note() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# stage NAME SHARE_OF_REMAINING(percent) COMMAND...: run with a timeout, log to $OUT/NAME.log
stage() {
    local name=$1 share=$2; shift 2
    local limit=$(( $(left) * share / 100 ))
    if (( limit < 10 )); then note "$name: skipped, no time left"; return 0; fi
    local t0=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    note "$name: rc $rc in $(( $(date +%s) - t0 )) s (limit $limit s)"
    return $rc
}

if [ -d .whl ]; then
    mkdir -p /tmp/site
    ls .whl/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --ignore-requires-python --upgrade --target /tmp/site .whl/*.whl
    [ -d .whl/pure ] && cp -r .whl/pure/* /tmp/site/
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if has env; then
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
        nvcc --version | tail -2
        $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
        nproc
    } 2>&1 | tee "$OUT/env.log" | tee -a "$SUMMARY"
fi

if has build; then
    if [ -n "${CRFKIT_PREBUILT:-}" ]; then
        cp "$CRFKIT_PREBUILT" crfkit/ && note "build: using $CRFKIT_PREBUILT"
    else
        # The visible GPU's architecture only (setup.py leaves TORCH_CUDA_ARCH_LIST to torch when
        # a GPU is visible); -j from the cores; one CPU kernel copy for this machine
        # (CRFKIT_ARCH=native: the portable build's three ISA copies took 197 s on the H200
        # machine, against about 55 s); the system compiler where there is one (see below).
        export CRFKIT_ARCH=${CRFKIT_ARCH:-native}
        if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
        jobs=$(nproc)
        if [ -n "${AB_OLD:-}" ]; then  # the A/B stages' other tree, built at the same time
            jobs=$(( jobs / 2 ))
            (cd "$AB_OLD" && rm -rf build crfkit/_C*.so && MAX_JOBS=$jobs timeout $(( $(left) * 60 / 100 )) \
                $PY setup.py build_ext --inplace >"$OUT/build_old.log" 2>&1) &
            old_build=$!
        fi
        MAX_JOBS=$jobs stage build 60 $PY setup.py build_ext --inplace || tail -40 "$OUT/build.log"
        if [ -n "${AB_OLD:-}" ]; then
            wait "$old_build"; note "build of AB_OLD ($AB_OLD): rc $?"
        fi
        # An extension must use the process's shared libstdc++ (torch's). The GPU image's
        # default compiler (CC/CXX = /opt/gcc/bin/gcc, g++: wrapper scripts) linked libstdc++
        # into crfkit._C statically, and the first error message that formats a number then
        # crashed the process (a second copy of the iostream locale state, never initialised;
        # seen 2026-11-22 on the H100 machine). Rebuild with the system compiler if so.
        if ! ldd crfkit/_C*.so 2>/dev/null | grep -q libstdc++ && [ -x /usr/bin/g++ ]; then
            note "build: crfkit._C has no dynamic libstdc++ (CXX=${CXX:-unset}): rebuilding with /usr/bin/g++"
            rm -rf build crfkit/_C*.so
            CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=$(nproc) stage build 60 $PY setup.py build_ext --inplace \
                || tail -40 "$OUT/build.log"
        fi
        grep -E "warning|error" "$OUT/build.log" | grep -v -E "project.license|SetuptoolsDeprecation" | head -20
        cp crfkit/_C*.so "$OUT/" 2>/dev/null
    fi
    $PY -c "import crfkit; print(crfkit.backend_info())" 2>&1 | tee -a "$SUMMARY"
fi

if has test; then
    # shellcheck disable=SC2086
    stage test 40 $PY -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_cuda.py ${GPU_TEST_ARGS:-}
    tail -25 "$OUT/test.log"
    grep -E "passed|failed" "$OUT/test.log" | tail -1 >>"$SUMMARY"
fi

if has sanitize; then
    # memcheck over the CUDA tests (torch.compile excluded: it only adds host-side compilation).
    # The python under the sanitizer is slow to start; the tool's report goes to the log.
    stage sanitize 35 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
        $PY -m pytest -q -x --tb=short -p no:cacheprovider tests/test_cuda.py -k "${SANITIZE_K:-not compile}" \
        ${GPU_TEST_ARGS:-}
    tail -15 "$OUT/sanitize.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -2 >>"$SUMMARY"
fi

if has sanitize_chunked; then
    # The parallel-in-time kernels under the sanitizer: memcheck over the whole suite with every
    # forward-backward / Viterbi call chunked, then initcheck (reads of never-written memory:
    # the chunk buffers are at::empty) and synccheck (warp-shuffle masks) over the chunked tests.
    stage sanitize_chunked 50 env CRFKIT_CUDA_TIME_PARALLEL=always compute-sanitizer --tool memcheck \
        --error-exitcode 9 --print-limit 20 $PY -m pytest -q -x --tb=short -p no:cacheprovider \
        tests/test_cuda.py -k "${SANITIZE_K:-not compile}"
    tail -8 "$OUT/sanitize_chunked.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_chunked.log" | tail -2 | sed 's/^/memcheck (chunked): /' >>"$SUMMARY"
    for tool in initcheck synccheck; do
        stage "sanitize_chunked_$tool" 30 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
            $PY -m pytest -q -x --tb=short -p no:cacheprovider tests/test_cuda.py -k "time_chunked and dtype1"
        tail -6 "$OUT/sanitize_chunked_$tool.log"
        grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_chunked_$tool.log" | tail -2 | sed "s/^/$tool: /" >>"$SUMMARY"
    done
fi

if has marginals_backward; then
    # The marginals' gradient: crfkit's kernel against autograd through the reference and
    # through torch-struct (benchmarks/bench_gpu_marginals_backward.py).
    # shellcheck disable=SC2086
    stage marginals_backward "${MARGINALS_BACKWARD_SHARE:-30}" $PY benchmarks/bench_gpu_marginals_backward.py \
        ${MARGINALS_BACKWARD_ARGS:-} --out "$OUT/gpu_marginals_backward"
    tail -12 "$OUT/marginals_backward.log"
fi

if has counts_backward; then
    # The same for the expected transition counts' gradient (the same kernel, the transitions'
    # direction).
    # shellcheck disable=SC2086
    stage counts_backward "${COUNTS_BACKWARD_SHARE:-30}" $PY benchmarks/bench_gpu_marginals_backward.py \
        --op expected_transition_counts ${COUNTS_BACKWARD_ARGS:-} --out "$OUT/gpu_counts_backward"
    tail -12 "$OUT/counts_backward.log"
fi

if has host_breakdown; then
    # The host's time per call split into its pieces (benchmarks/profile_gpu_host.py --breakdown).
    stage host_breakdown 30 $PY benchmarks/profile_gpu_host.py --breakdown --out "$OUT/gpu_host_breakdown"
    tail -30 "$OUT/host_breakdown.log"
fi

if has kbest_ab; then
    # The two CUDA k-best kernels (csrc/cuda/kbest.cu, CRFKIT_CUDA_KBEST_KERNEL) on the same
    # build, alternating, K = 5 and 15, three rounds: the numbers that set the `auto` rule.
    # (`stage` runs its command under timeout, so the loop is a bash -c script, not a function.)
    stage kbest_ab 25 env PY="$PY" SHAPES="${KBEST_AB_SHAPES:-1x128x9,32x512x9,256x128x9,1024x128x9}" \
        ROUNDS="${KBEST_AB_ROUNDS:-3}" KS="${KBEST_AB_KS:-5 15}" \
        KERNELS="${KBEST_AB_KERNELS:-per_sentence per_tag}" bash -c '
        for round in $(seq "$ROUNDS"); do
            for kernel in $KERNELS; do
                for k in $KS; do
                    echo "== round $round, $kernel, K = $k"
                    CRFKIT_CUDA_KBEST_KERNEL=$kernel $PY benchmarks/profile_gpu.py --ops kbest --k "$k" \
                        --shapes "$SHAPES" | grep "^|"
                done
            done
        done'
    tail -40 "$OUT/kbest_ab.log"
fi

if has bench; then
    # shellcheck disable=SC2086
    stage bench "${BENCH_SHARE:-45}" $PY benchmarks/bench_gpu.py ${BENCH_ARGS:---quick} --out "$OUT/gpu_bench"
    tail -40 "$OUT/bench.log"
fi

if has host; then
    # The host's cost per call, checked and deferred error mode (benchmarks/profile_gpu_host.py).
    stage host 30 $PY benchmarks/profile_gpu_host.py --out "$OUT/gpu_host"
    tail -24 "$OUT/host.log"
fi

if has train_step; then
    # A BERT-base + CRF training step with crfkit (checked and deferred) and the peers' CRFs.
    stage train_step 90 $PY benchmarks/bench_gpu_training_step.py --out "$OUT/gpu_training_step"
    tail -12 "$OUT/train_step.log"
fi

if has test_chunked; then
    # The whole CUDA suite with every log Z / marginals call on the parallel-in-time path.
    # shellcheck disable=SC2086
    stage test_chunked 40 env CRFKIT_CUDA_TIME_PARALLEL=always $PY -m pytest -q -rfE --tb=short \
        -p no:cacheprovider tests/test_cuda.py ${GPU_TEST_ARGS:-}
    tail -25 "$OUT/test_chunked.log"
    grep -E "passed|failed" "$OUT/test_chunked.log" | tail -1 >>"$SUMMARY"
fi

if has time_parallel; then
    # Sequential against chunked (parallel in time) log Z / marginals, and torch-struct.
    # shellcheck disable=SC2086
    stage time_parallel "${TIME_PARALLEL_SHARE:-60}" $PY benchmarks/bench_gpu_time_parallel.py ${TIME_PARALLEL_ARGS:-} \
        --out "$OUT/gpu_time_parallel"
    tail -40 "$OUT/time_parallel.log"
fi

if has host_trace; then
    # Where the host's time of a log Z forward + backward goes (torch.profiler, CPU side).
    stage host_trace 30 $PY benchmarks/profile_gpu_host.py --trace --shapes 1x128x9
    tail -60 "$OUT/host_trace.log"
fi

if has initcheck; then
    # Reads of memory no kernel wrote (the decoders write their outputs whole, unfilled by the
    # host): initcheck over the decoders' tests, torch's reads of the outputs included.
    stage initcheck 35 compute-sanitizer --tool initcheck --error-exitcode 9 --print-limit 20 \
        $PY -m pytest -q -x --tb=short -p no:cacheprovider tests/test_cuda.py -k "${INITCHECK_K:-kbest or viterbi}"
    tail -8 "$OUT/initcheck.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/initcheck.log" | tail -2 | sed 's/^/initcheck: /' >>"$SUMMARY"
fi

# The A/B stages' loop (a bash -c script, since `stage` runs its command under timeout): AB_ROUNDS
# rounds, each running the command line RUN with AB_OLD's tree on PYTHONPATH, then this one's.
ALTERNATE_BUILDS='
    for round in $(seq "$ROUNDS"); do
        for side in old new; do
            tree=$PWD; [ $side = old ] && tree=$(cd "$OLD" && pwd)
            echo "== round $round, $side ($tree)"
            export PYTHONPATH=$tree
            eval "$RUN"
        done
    done'

if has host_ab; then
    # The host's cost per call (profile_gpu_host.py, then its --breakdown) of both builds.
    stage host_ab 70 env PY="$PY" OLD="${AB_OLD:?the host_ab stage needs AB_OLD}" ROUNDS="${AB_ROUNDS:-2}" \
        RUN='$PY benchmarks/profile_gpu_host.py | grep "^|"; $PY benchmarks/profile_gpu_host.py --breakdown | grep "^|"' \
        bash -c "$ALTERNATE_BUILDS"
    tail -60 "$OUT/host_ab.log"
fi

if has ab; then
    # This tree's kernels against AB_OLD's (both built), profile_gpu.py of this tree.
    stage ab 95 env PY="$PY" OLD="${AB_OLD:?the ab stage needs AB_OLD}" ROUNDS="${AB_ROUNDS:-2}" \
        SHAPES="${AB_SHAPES:-1x128x9,256x128x9,32x512x9,1024x128x37}" \
        RUN='$PY benchmarks/profile_gpu.py --shapes "$SHAPES" | grep "^|"' bash -c "$ALTERNATE_BUILDS"
    tail -60 "$OUT/ab.log"
fi

echo "==== summary ($(( $(date +%s) - START )) s)"
cat "$SUMMARY"
