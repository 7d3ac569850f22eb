#!/usr/bin/env bash
# Call 5 (session 8), one H200, main after merging wip/s7-dispatch-gemm: the GPU tests without the sanitizer ones,
# in the session's last device minutes (whatever finishes under the limit is reported).
set -uo pipefail
S=$(date +%s)
exec > >(tee $OUT/call5.txt) 2>&1
source tests/gpu/build_gpu.sh || exit 1
echo "== elapsed $(( $(date +%s) - S )) s: build"
timeout $(( 215 - ($(date +%s) - S) )) python3 -m pytest -q -p no:cacheprovider tests/gpu \
  -k "not compute_sanitizer" --durations=5 > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -12 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -20
echo "== elapsed $(( $(date +%s) - S )) s"
