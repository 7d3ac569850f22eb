#!/usr/bin/env bash
# The whole GPU suite in one device call: tests/gpu's files in three pytest processes sharing the GPU (their work is
# mostly XLA compilation on the host's cores), each lane its own files, against the installed package as
# run_device.sh. XLA_PYTHON_CLIENT_PREALLOCATE=false lets three processes' XLA and the library's workspaces share the
# GPU's memory. The lanes: the bf16 GEMM, collective, layer and combine files and the multiprocess file; the FP8
# files; the files that time out peers, the command buffers and the loopback harness (every file not named in the
# first two, so a new file runs). The multiprocess file sits in the first lane, the shortest, to keep the last one
# (the loopback suites) well inside the lane limit.
#
#   bash tests/gpu/run_lanes.sh [pytest args...]    (e.g. -k "not racecheck and not synccheck"; JMO_LANE_S: each
#                                                     lane's time limit, default 520 s)
# Logs in $OUT (the device tool's output folder) or /tmp/jmo-gpu-out: lane_A.log, lane_B.log, lane_S.log. Exits 1 if a
# lane failed or ran out of time. JMO_LANES_DRY=1 skips the build (the package and tools already importable): the
# orchestration alone, e.g. on a machine without a GPU, where the tests skip (PYTHON: the interpreter, default python3).
set -uo pipefail
OUT=${OUT:-/tmp/jmo-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
[ -n "${JMO_LANES_DRY:-}" ] || source tests/gpu/build_gpu.sh || exit 1
G=$PWD/tests/gpu
PY=$(command -v "${PYTHON:-python3}")
export XLA_PYTHON_CLIENT_PREALLOCATE=false
A=(test_gpu_collective.py test_gpu_layer.py test_gpu_grouped_gemm.py test_gpu_expert_combine.py
   test_gpu_multiprocess.py)
B=()
S=()
for f in "$G"/test_gpu_*.py; do
  f=$(basename "$f")
  case " ${A[*]} " in *" $f "*) continue ;; esac
  if [[ $f == *fp8* ]]; then B+=("$f"); else S+=("$f"); fi
done
t0=$(date +%s)
pids=()
for lane in A B S; do
  declare -n files=$lane
  (cd /tmp && timeout "${JMO_LANE_S:-520}" "$PY" -m pytest -q -p no:cacheprovider -rs "${files[@]/#/$G/}" "$@" \
     > "$OUT/lane_$lane.log" 2>&1
   lane_rc=$?
   echo "lane $lane: rc $lane_rc after $(( $(date +%s) - t0 )) s: ${files[*]}"
   exit $lane_rc) &
  pids+=($!)
  unset -n files
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for lane in A B S; do
  echo "--- lane $lane"
  grep -E "^FAILED|^ERROR|TIMEOUT" "$OUT/lane_$lane.log" | tail -12 | cut -c1-300
  tail -1 "$OUT/lane_$lane.log" | cut -c1-300
  grep -qE "[0-9]+ failed|^ERROR|TIMEOUT" "$OUT/lane_$lane.log" && rc=1
  tail -1 "$OUT/lane_$lane.log" | grep -qE "passed|skipped|deselected" || rc=1
done
exit $rc
