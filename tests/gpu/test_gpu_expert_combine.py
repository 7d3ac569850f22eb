"""expert_combine on the CUDA kernels (R = every visible GPU, and 1) with w transposed in place (transpose_rhs, the
backward pass's dx = da @ W1^T) against float64 numpy, on each producer engine, beside the plain call on the
transposed weights; the FP8 producer (expert_combine_fp8) against float64 numpy; bitwise-identical repeats; and the kernels' record of a call (Workspace.last_call_stats). The CPU
suite's helpers (tests/test_expert_combine.py). Skips where there is no GPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import gemm_engine, gpu_mesh, is_hopper, rank_counts, rel_err, requires_gpu
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
import test_expert_combine as base  # tests/test_expert_combine.py (tests/ is on pytest's pythonpath)

pytestmark = requires_gpu

# (K, N, dtype, engine with w transposed; None: the device's tensor-core engine, wgmma on Hopper, else mma.sync)
CASES = [
    (384, 256, jnp.bfloat16, None),            # K, N multiples of 64: wgmma on Hopper (B loaded K-major)
    (200, 136, jnp.bfloat16, "mma.sync bf16"),
    (200, 140, jnp.bfloat16, "mma.sync bf16"),  # N not a multiple of 8: plain w takes SIMT, transposed w mma.sync
    (200, 136, jnp.float32, "simt fp32"),
]


@pytest.mark.parametrize("K,N,dtype,engine", CASES)
@pytest.mark.parametrize("R", rank_counts(), ids=lambda r: f"R{r}")
def test_transpose_rhs_gpu(R, K, N, dtype, engine):
  want = engine or ("wgmma bf16" if is_hopper() else "mma.sync bf16")
  assert gemm_engine(dtype, K, N, transpose_rhs=True) == want
  # 512 slots per rank over 8 experts: multi-tile segments; at R > 1 each rank's slots spread over every GPU.
  c = base.make_case(gpu_mesh(R), N, dtype, tokens=256, seed=K + N + R)
  lhs, w, gates = base.operands(c, K, N, dtype, seed=K)
  w_t = jnp.swapaxes(w, 1, 2)  # [E, N, K]
  fn_t = base.combine_fn(c, True)
  y_t, slot_t = fn_t(c.ids, gates, lhs, w_t)
  y, slot = base.combine_fn(c, False)(c.ids, gates, lhs, w)
  y_ref, slot_ref = base.reference(c, gates, lhs, w)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  errs = {"y_t": rel_err(y_t, y_ref), "slot_t": rel_err(slot_t, slot_ref), "y": rel_err(y, y_ref)}
  print(f"R={R}", K, N, want, {k: f"{v:.2e}" for k, v in errs.items()})
  assert all(v < tol for v in errs.values()), errs
  assert np.isfinite(np.asarray(y_t, np.float32)).all()
  for _ in range(3):  # deterministic: the same bits every call
    again, _ = fn_t(c.ids, gates, lhs, w_t)
    assert np.array_equal(np.asarray(again).view(np.uint8), np.asarray(y_t).view(np.uint8))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("R", rank_counts(), ids=lambda r: f"R{r}")
def test_fp8_producer_gpu(R, out_dtype):
  """expert_combine_fp8 (the FP8 grouped GEMM's loop as ExpertKernel's producer, Hopper) against float64 numpy of
  the dequantized operands within 1e-2 relative (the FP8 kernel's tolerance: its tensor cores keep about 14 bits in
  each 128-wide chunk), bitwise-identical repeats; K, N and the rows not multiples of the 128 x 256 tile."""
  if not is_hopper():
    pytest.skip("the FP8 producer runs on Hopper GPUs")
  errs = base.check_fp8_producer(gpu_mesh(R), out_dtype, K=640, N=384, tokens=200, seed=R, tol=1e-2)
  print(f"R={R}", jnp.dtype(out_dtype).name, {k: f"{v:.2e}" for k, v in errs.items()})


# The combine gather's edge cases (combine_gather.cuh: one warp per token, 32 choices and 32 x kU vectors per lane
# at a time): N, dtype -> vectors of a row: 17 (fewer than the 32 lanes), 137 (a partial last chunk), 140 single
# elements (280-byte rows: no 16-byte vectors), 10 float32 vectors.
GATHER_CASES = [(136, jnp.bfloat16), (1096, jnp.bfloat16), (140, jnp.bfloat16), (40, jnp.float32)]


@pytest.mark.parametrize("N,dtype", GATHER_CASES)
@pytest.mark.parametrize("R", rank_counts(), ids=lambda r: f"R{r}")
def test_combine_gather_shapes_gpu(R, N, dtype):
  """top_k = 40 of 64 experts (two rounds of 32 choices) on rows that do not fill a warp's chunk: y and every slot's
  row against float64 numpy, bitwise-identical repeats."""
  K = 64
  c = base.make_case(gpu_mesh(R), N, dtype, tokens=64, seed=N + R, experts=64, top_k=40)
  lhs, w, gates = base.operands(c, K, N, dtype, seed=N)
  fn = base.combine_fn(c, False)
  y, slot = fn(c.ids, gates, lhs, w)
  y_ref, slot_ref = base.reference(c, gates, lhs, w)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  errs = {"y": rel_err(y, y_ref), "slot": rel_err(slot, slot_ref)}
  print(f"R={R}", N, dtype.__name__, {k: f"{v:.2e}" for k, v in errs.items()})
  assert all(v < tol for v in errs.values()), errs
  again, _ = fn(c.ids, gates, lhs, w)
  assert np.array_equal(np.asarray(again).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("R", rank_counts(), ids=lambda r: f"R{r}")
def test_last_call_stats_gpu(R):
  """After one expert_combine, every rank's record: the pinned C, the bytes its plan sends to the other ranks, and
  producer / consumer spans (none for a consumer with nothing to push); serialized, the consumer starts only after
  the producer's last tile (%globaltimer: a few us of slack)."""
  K, N = 384, 256
  c = base.make_case(gpu_mesh(R), N, jnp.bfloat16, tokens=256, seed=R)
  lhs, w, gates = base.operands(c, K, N, jnp.bfloat16, seed=R)
  owner = np.asarray(c.ids).reshape(R, -1) // (base.E // R)  # [source rank, slot] -> the rank computing it (dropless)
  remote = [int(np.sum(np.delete(owner, r, axis=0) == r)) * N * 2 for r in range(R)]
  for cfg in (CallConfig(consumer_ctas=3), CallConfig(consumer_ctas=5, serialize=True)):
    case = dataclasses.replace(c, info=RankInfo(c.info.workspace, cfg))
    jax.block_until_ready(base.combine_fn(case, False)(c.ids, gates, lhs, w))
    stats = c.info.workspace.last_call_stats()
    print(cfg, remote, stats)
    assert [s.rank for s in stats] == list(range(R))
    for s in stats:
      # The kernel reports the C it used: none when the rank has nothing to push (every rank at R = 1).
      assert s.consumers == (cfg.consumer_ctas if remote[s.rank] else 0) and s.pushed_bytes == remote[s.rank], s
      assert s.producer_us is not None and s.producer_us >= 0, s
      # The call's timeline: Begin, then the expert kernel, then CombineKernel on the same stream (1 us of timer slack).
      assert s.begin_us is not None and s.begin_us <= s.producer_start_us + 1, s
      assert s.kernel_start_us is not None and s.begin_us <= s.kernel_start_us + 1, s
      assert s.kernel_start_us <= s.producer_start_us + 1, s
      assert s.combine_start_us >= s.producer_end_us - 1 and s.call_us >= s.busy_us, s
      assert 0 <= s.producer_start_spread_us <= s.producer_us + 1, s
      if remote[s.rank] == 0:
        assert s.consumer_us is None, s
        continue
      assert s.consumer_us is not None and s.consumer_us >= 0 and s.busy_us >= max(s.producer_us, s.consumer_us), s
      if cfg.serialize:
        assert s.consumer_start_us >= s.producer_end_us - 5, s
