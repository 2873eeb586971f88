#!/usr/bin/env bash
# A/B timing of two versions of the CUDA kernels on one GPU machine, in one device call.
#
#   here:   mkdir -p .scratch/old && git archive OLD_REV | tar -x -C .scratch/old
#           (.scratch/ ignored through .git/info/exclude; name it in the device call's carry)
#   there:  bash tools/gpu_ab.sh .scratch/old [ROUNDS] [PROFILE ARGS...]
#
# Builds crfkit._C from OLD (a source tree) and from this tree, each with the system compiler
# (see gpu_checks.sh for why), then runs benchmarks/profile_gpu.py (of this tree) against each
# build in turn, ROUNDS times (default 3), alternating, so that clock and thermal drift hit both
# alike. The device machine's git history may predate this session's commits, hence a source
# tree rather than a revision. Logs go to $OUT (./gpu_out elsewhere).
set -uo pipefail
OLD=${1:?usage: gpu_ab.sh OLD_SOURCE_TREE [ROUNDS] [profile_gpu.py args]}
ROUNDS=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=$(nproc)

build() {  # build <tree> <log>
    (cd "$1" && rm -rf build crfkit/_C*.so && $PY setup.py build_ext --inplace >"$2" 2>&1) \
        || { echo "build of $1 failed, see $2"; tail -20 "$2"; exit 1; }
}
build "$OLD" "$OUT/build_old.log" &
build "$PWD" "$OUT/build_new.log" &
wait

for round in $(seq "$ROUNDS"); do
    for side in old new; do
        tree=$([ $side = old ] && echo "$(cd "$OLD" && pwd)" || echo "$PWD")
        echo "== round $round, $side ($tree)"
        PYTHONPATH=$tree $PY benchmarks/profile_gpu.py "$@" 2>&1 | grep "^|" | tee -a "$OUT/ab_$side.md"
    done
done
