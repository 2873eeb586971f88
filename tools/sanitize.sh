#!/usr/bin/env bash
# Build crfkit._C with checks the release build cannot give, into its own folder, and run the
# CPU kernel tests against that build.
#
#   tools/sanitize.sh                  AddressSanitizer + UndefinedBehaviorSanitizer (-O1 -g)
#   tools/sanitize.sh --debug          a plain -O0 -g build: undefined behaviour that -O3 hides
#                                      (a dead load is removed there) crashes here instead
#   tools/sanitize.sh --tsan           ThreadSanitizer, two threads (see the note below)
#   tools/sanitize.sh [mode] -x -k lanes   anything after the mode goes to pytest
#
# `make sanitize` and `make debug-test` run the first two. Run both whenever csrc/ changes.
#
# Each mode builds into build/<mode>/ (object files kept, so a rerun recompiles only what
# changed) and assembles build/<mode>/pkg/crfkit: the checkout's Python files plus that _C.
# The tests import crfkit from there (PYTHONPATH, and python -P so the checkout's own crfkit,
# with its release _C, is not first on sys.path); the in-place crfkit/_C*.so is never touched.
# Only the compiled backend is tested (CRFKIT_TEST_BACKENDS=compiled, tests/conftest.py): the
# reference and numba run no C++ code. The run fails on a non-zero pytest exit and on any
# sanitizer report found in its output.
#
# The instrumented library needs the sanitizer runtimes loaded before anything else, which an
# uninstrumented python cannot do on its own: they are preloaded (LD_PRELOAD) from the compiler
# that builds the extension ($CXX, else c++). ASAN_OPTIONS: detect_leaks=0 because CPython and
# torch keep allocations alive until exit by design, which LeakSanitizer would report.
#
# ThreadSanitizer (--tsan) builds and runs, but cannot judge these kernels: torch's CPU thread
# pool (at::parallel_for) is GNU OpenMP (libgomp), which is not built with ThreadSanitizer. TSan
# sees the worker threads being created, but not the synchronisation inside libgomp's barriers
# (futexes and atomics in uninstrumented code) that orders a parallel region's work before the
# code after it, so it reports a race wherever the calling thread touches memory a worker used
# in the region: e.g. a std::vector freed after at::parallel_for returns that a worker read in
# it. Every report of a trial run paired the main thread with a thread started by
# gomp_team_start, in every kernel (log_partition, kbest, viterbi, sequence_score), and inside
# torch's own code (intrusive_ptr reference counts). A usable run needs a libgomp (or LLVM
# libomp with Archer) built with -fsanitize=thread and a torch built against it. The mode is
# kept for that; its reports are not evidence of a bug by themselves.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=sanitize
case "${1:-}" in
  --debug) mode=debug; shift ;;
  --tsan) mode=tsan; shift ;;
  --sanitize) shift ;;
esac
PYTHON=${PYTHON:-python3}
CXX_FOR_RUNTIMES=${CXX:-c++}
TESTS=(tests/test_parity.py tests/test_brute_force.py tests/test_numerics.py tests/test_bad_input.py)
out=build/$mode
# One copy of the kernels, for this CPU (the dispatch build compiles three: slower, and the
# sanitizers see the same code). Another CRFKIT_ARCH (e.g. none: the 16-byte vector paths) gets
# its own folder, so that switching back and forth does not recompile everything each time.
export CRFKIT_ARCH=${CRFKIT_ARCH:-native}
if [ "$CRFKIT_ARCH" != native ]; then out=build/$mode-$CRFKIT_ARCH; fi

echo "== tools/sanitize.sh: $mode build in $out (MAX_JOBS=${MAX_JOBS:-all cores})"
start=$(date +%s)
CRFKIT_BUILD_MODE=$mode "$PYTHON" setup.py -q build_ext --build-lib "$out/lib" --build-temp "$out/temp"
echo "== built in $(( $(date +%s) - start )) s"

# The package to test: the Python sources of this checkout, with this mode's _C and build info.
rm -rf "$out/pkg"
mkdir -p "$out/pkg"
"$PYTHON" - "$out" <<'EOF'
import glob, os, shutil, sys
out = sys.argv[1]
shutil.copytree("crfkit", os.path.join(out, "pkg", "crfkit"),
                ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.py"))
for built in glob.glob(os.path.join(out, "lib", "crfkit", "_C*.so")) + [os.path.join(out, "lib", "crfkit", "_build_info.py")]:
    shutil.copy2(built, os.path.join(out, "pkg", "crfkit"))
EOF

runtime_env=()
case $mode in
  sanitize)
    asan=$("$CXX_FOR_RUNTIMES" -print-file-name=libasan.so)
    ubsan=$("$CXX_FOR_RUNTIMES" -print-file-name=libubsan.so)
    runtime_env=(
      "LD_PRELOAD=$asan $ubsan"
      "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:print_summary=1"
      "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:print_summary=1"
    )
    ;;
  tsan)
    runtime_env=(
      "LD_PRELOAD=$("$CXX_FOR_RUNTIMES" -print-file-name=libtsan.so)"
      "TSAN_OPTIONS=halt_on_error=0:second_deadlock_stack=1:report_signal_unsafe=0"
      # two intra-op threads (the CPU kernels split batches with at::parallel_for)
      "OMP_NUM_THREADS=2"
    )
    ;;
esac

# The interpreter itself, not a wrapper script (a pyenv shim is a bash script, and bash with the
# ThreadSanitizer runtime preloaded crashes at start): only python gets the runtimes.
interpreter=$("$PYTHON" -c "import sys; print(sys.executable)")
run() {
  env "${runtime_env[@]}" PYTHONPATH="$PWD/$out/pkg" CRFKIT_BACKEND=compiled CRFKIT_TEST_BACKENDS=compiled \
    "$interpreter" -P "$@"
}

# The tests must import this build, not the checkout's or an installed crfkit.
run -c "
import crfkit, crfkit._C, sys
expected = '$PWD/$out/pkg/crfkit/'
assert crfkit.__file__.startswith(expected) and crfkit._C.__file__.startswith(expected), (crfkit.__file__, crfkit._C.__file__)
assert crfkit.backend_info()['backend'] == 'compiled', crfkit.backend_info()
print('== testing', crfkit._C.__file__)
"

log=$out/pytest.log
start=$(date +%s)
set +e
run -m pytest -q -p no:cacheprovider --capture=sys "${TESTS[@]}" "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
echo "== pytest exit status $status after $(( $(date +%s) - start )) s (log: $log)"
reports=$(grep -cE "runtime error:|ERROR: AddressSanitizer|WARNING: ThreadSanitizer|SUMMARY: (Address|UndefinedBehavior|Thread)Sanitizer" "$log" || true)
if [ "$reports" != 0 ]; then
  echo "== $reports sanitizer report line(s) in $log:"
  grep -E "runtime error:|ERROR: AddressSanitizer|WARNING: ThreadSanitizer|SUMMARY: " "$log" | head -20
  exit 1
fi
exit "$status"
