"""expert_combine on the CUDA kernels (EP=1, one GPU) with w transposed in place (transpose_rhs, the backward pass's
dx = da @ W1^T) against float64 numpy, on each producer engine, beside the plain call on the transposed weights; and
bitwise-identical repeats. The CPU suite's helpers (tests/test_expert_combine.py). Skips where there is no GPU."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import gpu_devices, rel_err, requires_gpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import test_expert_combine as base  # noqa: E402  pylint: disable=g-import-not-at-top

pytestmark = requires_gpu

# (K, N, dtype, engine with w transposed; None: the device's tensor-core engine, wgmma on Hopper, else mma.sync)
CASES = [
    (384, 256, jnp.bfloat16, None),            # K, N multiples of 64: wgmma on Hopper (B loaded K-major)
    (200, 136, jnp.bfloat16, "mma.sync bf16"),
    (200, 140, jnp.bfloat16, "mma.sync bf16"),  # N not a multiple of 8: plain w takes SIMT, transposed w mma.sync
    (200, 136, jnp.float32, "simt fp32"),
]


def _mesh():
  return jax.sharding.Mesh(np.array(gpu_devices()[:1]), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("K,N,dtype,engine", CASES)
def test_transpose_rhs_gpu(K, N, dtype, engine):
  from jax_moe_overlap import _jmo, cuda_workspace  # pylint: disable=g-import-not-at-top
  hopper = cuda_workspace.device_info(gpu_devices()[0].local_hardware_id).compute_capability[0] == 9
  want = engine or ("wgmma bf16" if hopper else "mma.sync bf16")
  assert _jmo.cuda_producer_path(dtype == jnp.bfloat16, K, N, transpose_rhs=True) == want
  c = base.make_case(_mesh(), N, dtype, tokens=256, seed=K + N)  # 512 slots over 8 experts: multi-tile segments
  lhs, w, gates = base.operands(c, K, N, dtype, seed=K)
  w_t = jnp.swapaxes(w, 1, 2)  # [E, N, K]
  fn_t = base.combine_fn(c, True)
  y_t, slot_t = fn_t(c.ids, gates, lhs, w_t)
  y, slot = base.combine_fn(c, False)(c.ids, gates, lhs, w)
  y_ref, slot_ref = base.reference(c, gates, lhs, w)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  errs = {"y_t": rel_err(y_t, y_ref), "slot_t": rel_err(slot_t, slot_ref), "y": rel_err(y, y_ref)}
  print(K, N, want, {k: f"{v:.2e}" for k, v in errs.items()})
  assert all(v < tol for v in errs.values()), errs
  assert np.isfinite(np.asarray(y_t, np.float32)).all()
  for _ in range(3):  # deterministic: the same bits every call
    again, _ = fn_t(c.ids, gates, lhs, w_t)
    assert np.array_equal(np.asarray(again).view(np.uint8), np.asarray(y_t).view(np.uint8))
