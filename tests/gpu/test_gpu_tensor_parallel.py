"""Expert tensor parallelism on GPUs: the overlap layer (CUDA kernels) with a tensor axis, meshes (expert, tensor) over
the visible GPUs (tensor = 2 and 4 where they divide the GPU count: at 2 GPUs (expert=1, tensor=2), at 4 also
(expert=2, tensor=2), at 8 (expert=4, tensor=2) and (expert=2, tensor=4)). The bodies are tests/
tensor_parallel_checks.py: bfloat16 forward and gradients against the float32 oracle on the same bf16-rounded inputs
(relative error below 1e-2, outputs computed into NaN-poisoned buffers) with skipped slots, empty experts and dropped
capacity, at d_model 256 and d_ff 384 (the wgmma engine's operands on Hopper), and repeated calls bitwise equal, with
the shards' partials summed per slot and by GEMM2 + GatherRS (CallConfig(tensor_reduce=...)).
tests/test_tensor_parallel.py and tests/test_gather_rs.py run them on CPU devices. Skips where there is no GPU or fewer than 2.

The loopback harness's tensor suite runs the same exchange groups on one GPU (test_loopback_tensor_suite)."""

import re

import pytest

import jax_moe_overlap as jmo
from gpu_common import gpu_devices, requires_gpu, run_loopback
import tensor_parallel_checks as checks  # tests/ (on pytest's pythonpath)

REDUCES = pytest.mark.parametrize("reduce", ["per_slot", "gather_rs"])

pytestmark = requires_gpu


def _shapes():
  n = len(gpu_devices())
  return [{"expert": n // t, "tensor": t} for t in (2, 4) if n >= t and n % t == 0]


SHAPES = _shapes()
by_shape = pytest.mark.parametrize("shape", SHAPES or [None], ids=lambda s: "x".join(map(str, s.values())) if s
                                   else "none")


def _need(shape):
  if shape is None:
    pytest.skip("expert tensor parallelism needs at least 2 GPUs")


@pytest.mark.parametrize("kind,cf", [("skipped", None), ("empty_experts", None), ("skewed", 0.5)])
@REDUCES
@by_shape
def test_bfloat16_forward_and_grads(shape, kind, cf, reduce):
  _need(shape)
  checks.check_bfloat16(shape, kind=kind, cf=cf, tokens=256, d=256, f=384, devices=gpu_devices(),
                        config=jmo.CallConfig(tensor_reduce=reduce))


@REDUCES
@by_shape
def test_repeated_calls_bitwise_equal(shape, reduce):
  _need(shape)
  checks.check_repeatable(shape, "overlap", calls=50, tokens=256, devices=gpu_devices(),
                          config=jmo.CallConfig(tensor_reduce=reduce))


@by_shape
def test_gather_rs_serialized_gives_the_same_bits(shape):
  """GEMM2 + GatherRS with the reduce-scatter after GEMM2 (serialize=True) against the overlapped call: the same
  float32 sums in the same order, so the same bits."""
  _need(shape)
  checks.check_same_bits(shape, (jmo.CallConfig(tensor_reduce="gather_rs"),
                                 jmo.CallConfig(tensor_reduce="gather_rs", serialize=True)),
                         tokens=256, devices=gpu_devices())


@pytest.mark.watchdog_s(420)  # the subprocess's own limit is 360 s
def test_loopback_tensor_suite():
  """Expert tensor parallelism in the loopback harness (tools/loopback/tensor.py), on one GPU: the exchange group of
  R = 4 as 2 x 2 and R = 8 as 2 x 4 and 4 x 2 expert x tensor ranks, each choice as TP shard slots
  (tensor_parallel.shard_slots), each rank with its K / TP shard of whole experts, y against the whole experts in
  float32 (bf16 and float32; balanced, skewed and extreme routing, dropless and with drops; w transposed);
  dispatch_gemm at 2 x 2 in its three result modes against the whole experts' GEMM1; GEMM2 + GatherRS at 2 x 2,
  2 x 4 and 4 x 2 (y also bit for bit its float32 sums restated on the host from the GEMM rows it returns, those rows
  against the per-slot products), over an emulated link, and timed against its serialized form with identical
  outputs; bit-identical repeats everywhere. Hopper only (its dispatch_gemm cases take the wgmma engine)."""
  from gpu_common import is_hopper  # pylint: disable=g-import-not-at-top
  if not is_hopper():
    pytest.skip("the tensor suite's dispatch_gemm cases run on Hopper (sm_90a) only")
  proc = run_loopback(["--suite", "tensor"], timeout=360)
  m = re.search(r"loopback: (\d+) of (\d+) cases passed", proc.stdout)
  assert m and proc.returncode == 0 and m.group(1) == m.group(2) and int(m.group(2)) == 20, proc.stdout[-4000:]
  passed = [l for l in proc.stdout.splitlines() if l.startswith("PASS ")]
  per_slot = [l for l in passed if " gather_rs " not in l]
  gather = [l for l in passed if l not in per_slot]
  assert len(per_slot) == 12 and len(gather) == 8, proc.stdout[-4000:]
  for r, tp in ((4, 2), (8, 4), (8, 2)):
    assert any(re.match(rf"PASS R={r} TP={tp} .* dtype=bf16 .* dropless", l) for l in per_slot), (r, tp)
  assert any(re.match(r"PASS R=4 TP=2 .* dtype=f32 ", l) for l in per_slot)
  assert sum(bool(re.match(r"PASS R=\d+ TP=\d+ .* cf=", l)) for l in per_slot) == 4
  for mode in ("plain", "train", "infer"):
    assert any(re.match(rf"PASS R=4 TP=2 .* dispatch_gemm pushers=2 mode={mode}", l) for l in per_slot), mode
  for r, tp, dtype in ((4, 2, "bf16"), (4, 2, "f32"), (8, 4, "bf16"), (8, 2, "f32"), (8, 2, "bf16")):
    assert any(re.match(rf"PASS R={r} TP={tp} .* dtype={dtype} ", l) for l in gather), (r, tp, dtype)
  assert any("w=transposed" in l for l in gather) and any("link=20GB/s" in l for l in gather)
  for l in passed:  # every later call of every rank bit for bit its first call's (12 iterations, 3 data sets)
    ranks = int(re.match(r"PASS R=(\d+)", l).group(1))
    assert f"bit-identical repeats {9 * ranks} " in l, l
  # The timed GatherRS case: overlapped and serialized, outputs identical to the checked call's.
  timed = [l for l in proc.stdout.splitlines() if l.startswith("TIMED ")]
  assert len(timed) == 2 and all("identical=1" in l for l in timed), timed
