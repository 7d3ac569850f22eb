"""Loopback harness on one GPU (R = 2, 4, 8 ranks sharing the device) and compute-sanitizer on it at a small size.
(Its expert x tensor groups, the tensor suite: tests/gpu/test_gpu_tensor_parallel.py.)

Under compute-sanitizer the harness runs one rank only: the tools serialize kernels, and ranks sharing one GPU spin on
each other's kernels, so R >= 2 would only time out there.

The harness is tools/loopback (python -m tools.loopback.run), whose runner tools/CMakeLists.txt builds
(tests/gpu/build_gpu.sh). Skips where there is no GPU.
"""

import re

import pytest

from gpu_common import compute_sanitizer, requires_gpu, run_loopback

pytestmark = requires_gpu


@pytest.mark.watchdog_s(600)  # the subprocess's own limit is 540 s
def test_loopback_full_suite():
  proc = run_loopback(["--suite", "full"], timeout=540)
  m = re.search(r"loopback: (\d+) of (\d+) cases passed", proc.stdout)
  assert m, proc.stdout[-2000:]
  assert proc.returncode == 0 and m.group(1) == m.group(2), proc.stdout[-4000:]
  for r in (2, 4, 8):
    for routing in ("balanced", "moderate", "extreme"):
      assert re.search(rf"PASS R={r} .* routing={routing} ", proc.stdout), (r, routing)
  assert "forced_timeout_at" in proc.stdout and "timed out" in proc.stdout
  # A stream held past the timeout (work the library's timeout does not bound): the recovery gives up within it.
  assert re.search(r"PASS R=4 .* forced_timeout_at=5 stream_held_ms=1500", proc.stdout)
  # w transposed in place (--transpose-rhs) on each producer engine (wgmma on Hopper where K, N are multiples of 64).
  assert re.search(r"PASS R=2 .* K=384 N=320 dtype=bf16 w=transposed .* producer (wgmma|mma\.sync) bf16", proc.stdout)
  assert re.search(r"PASS R=4 .* K=200 N=140 dtype=bf16 w=transposed .* producer mma\.sync bf16", proc.stdout)
  assert re.search(r"PASS R=2 .* dtype=f32 w=transposed .* producer simt fp32", proc.stdout)


def _hopper_suite(suite: str, cases: int, why_hopper: str):
  """Runs loopback suite `suite` on a Hopper GPU (else skips, saying `why_hopper`) within 240 s: every one of its
  `cases` cases must pass. Returns the process (its stdout for the caller's checks)."""
  from gpu_common import is_hopper  # pylint: disable=g-import-not-at-top
  if not is_hopper():
    pytest.skip(why_hopper)
  proc = run_loopback(["--suite", suite], timeout=240)
  m = re.search(r"loopback: (\d+) of (\d+) cases passed", proc.stdout)
  assert m and proc.returncode == 0 and m.group(1) == m.group(2) and int(m.group(2)) == cases, proc.stdout[-4000:]
  return proc


@pytest.mark.watchdog_s(300)  # the subprocess's own limit is 240 s
def test_loopback_dispatch_gemm_suite():
  """dispatch_gemm (the dispatch and GEMM1 in one launch, GEMM1 tiles waiting per source): R = 1, 2, 4, 8 x three
  routings, each in another of its result modes (plain, the training forward, the inference forward), x_recv exact,
  GEMM1 and its SwiGLU against the host in float32, bitwise equal to the two calls, bit-identical repeats, a forced
  timeout in a per-source wait reported by the next call, then recovery, and pushes over an emulated link; sending a
  token's row once per destination rank (the default at two ranks or more) beside cases that send one row per slot;
  x_recv stored by the GEMM tiles (the default) and, in the plain and training modes, copied by the side units
  (x_recv_from_tiles=False); the plain product rounded to bf16 at R = 2 and 4 (the layer's backward dh), and the same
  with every row scaled by its slot's gate (row_scale), with the dispatch alone scaled at R = 4 beside them. Hopper
  only (the wgmma engine)."""
  proc = _hopper_suite("dispatch-gemm", 25, "dispatch_gemm runs on Hopper (sm_90a) only")
  for r in (1, 2, 4, 8):
    for mode in ("plain", "train", "infer"):
      assert re.search(rf"PASS R={r} .* dispatch_gemm pushers=\d+ mode={mode}", proc.stdout), (r, mode)
  assert "forced_timeout_at" in proc.stdout and "timed out" in proc.stdout
  assert re.search(r"PASS R=2 .* mode=\w+ link=20GB/s", proc.stdout)
  for r, mode in ((1, "train"), (2, "plain"), (4, "train"), (8, "train")):
    assert re.search(rf"PASS R={r} .* mode={mode} x_recv=copied", proc.stdout), (r, mode)
  for r in (2, 4):
    assert re.search(rf"PASS R={r} .* mode=plain out=bf16", proc.stdout), r
    assert re.search(rf"PASS R={r} .* mode=plain out=bf16 row_scale=gates", proc.stdout), r
  assert re.search(r"PASS R=4 .* dtype=f32 .* row_scale=gates", proc.stdout)


@pytest.mark.watchdog_s(300)  # the subprocess's own limit is 240 s
def test_loopback_combine_fp8_suite():
  """expert_combine with the FP8 producer (e4m3 lhs and w with their scales: the FP8 layer's GEMM2 and way back):
  R = 1, 2, 4, 8 with balanced and moderate routing, every band pushed, drops, the fixed C, float32 outputs, the
  serialized form and an emulated link, y and the slots' rows against the host's float32 products of the dequantized
  operands, bit-identical repeats. Hopper only (e4m3 wgmma)."""
  proc = _hopper_suite("combine-fp8", 14, "the FP8 producer runs on Hopper (sm_90a) only")
  for r in (1, 2, 4, 8):
    assert re.search(rf"PASS R={r} .* lhs,w=e4m3 .* producer wgmma e4m3", proc.stdout), r


def test_loopback_dispatch_gemm_fp8_suite():
  """dispatch_gemm's FP8 kernel (packed e4m3 rows dispatched and multiplied by the FP8 grouped GEMM's loop where they
  land; the FP8 combine after it): the dispatch-gemm suite's cases on packed rows (D = 1024, GEMM1's N = 768), the
  packed recv rows exact, GEMM1's float32 product, h and a (e4m3 with their scales) against the host's products of the
  dequantized operands, bitwise equal to the dispatch then the FP8 GEMM1 on the same rows unpacked, rows past the
  kept ones unwritten, bit-identical repeats, a forced timeout and recovery, an emulated link, one row per slot and
  send once, x_recv stored by the GEMM tiles and copied by the side units. Hopper only (e4m3 wgmma)."""
  proc = _hopper_suite("dispatch-gemm-fp8", 20, "dispatch_gemm's FP8 kernel runs on Hopper (sm_90a) only")
  for r in (1, 2, 4, 8):
    for mode in ("plain", "train", "infer"):
      assert re.search(rf"PASS R={r} .* x,w1,lhs,w=e4m3 .* dispatch_gemm pushers=\d+ mode={mode}",
                       proc.stdout), (r, mode)
  assert len(re.findall(r"PASS R=\d .* x,w1,lhs,w=e4m3 .* x_recv=copied", proc.stdout)) == 4, proc.stdout


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
@pytest.mark.watchdog_s(460)  # the subprocess's own limit is 400 s
def test_compute_sanitizer(tool):
  cs = compute_sanitizer()
  if cs is None:
    pytest.skip("compute-sanitizer not found")
  # racecheck runs the suite without its wgmma-producer cases, which do not finish under it in minutes
  # (tools/loopback/cases.py, suite "small-mma"); the shared signalling, decision and consumer code is in every case.
  suite = "small-mma" if tool == "racecheck" else "small"
  proc = run_loopback(["--suite", suite, "--timeout-ms", "60000"], timeout=400,
                      wrapper=[cs, "--tool", tool, "--error-exitcode", "99"])
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  assert re.search(r"(ERROR|RACECHECK) SUMMARY: 0 (errors|hazards)", out), out[-4000:]
  m = re.search(r"loopback: (\d+) of (\d+) cases passed", out)
  assert m and m.group(1) == m.group(2) and int(m.group(2)) > 0, out[-4000:]
