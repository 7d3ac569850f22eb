"""impl="overlap" under quantization="fp8" (fp8_overlap.py) on the GPUs: the dispatch kernels moving packed e4m3
rows (uint8, D + D / 32 bytes) between ranks (peer writes at R > 1), the FP8 grouped GEMM on Hopper, the expert
outputs and the input gradient back in bfloat16 by the dispatch kernels (unfused) or by
expert_combine on e4m3 operands (fused, below), against impl="collective" under fp8 (the
same recipe and kernels, its rows through XLA's collectives), forward and the gradients of x, gates, w1 and w2, on a
mesh over every visible GPU (and one GPU as well when there are several), with skipped slots, dropless and with
drops.

Tolerance: within 1e-2 relative (the FP8 kernel's tolerance, as impl="collective" against impl="xla" in
test_gpu_grouped_gemm_fp8.py). Both impls hand the kernels the same quantized operands, so the results are expected
bitwise equal (the CPU tests hold them so, tests/test_fp8_overlap.py); on the GPU XLA compiles the two programs' own
element-wise work (the quantizer, the combine's float32 sum, the token sum of dx) in fusions of its own choice, so
the test asserts the tolerance and prints whether each result is also bitwise equal. Then: two calls give the same
bits; the program's dispatch calls carry uint8 rows (on one GPU there is none: no row crosses a link, and the block
is impl="collective"'s) and no dispatch_gemm runs; with the fused FP8 combine (call_site.FP8_FUSED_COMBINE_ON_GPU,
the default; R > 1), GEMM2 and the way back are one expert_combine on e4m3 operands, and the input gradient's GEMM
and its way back another; switched off, the dispatch kernels take the rows back. Skips
where there is no Hopper GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo
from jax_moe_overlap import call_site
from cases import layer_inputs, rel_err
from gpu_common import gpu_mesh, rank_counts, requires_gpu
# (requires_hopper's condition names _hopper in this module)
from test_gpu_grouped_gemm_fp8 import _hopper, requires_hopper  # noqa: F401
from jax_moe_overlap.plan import SKIP

pytestmark = [requires_gpu, requires_hopper]

RANKS = rank_counts()
T_PER_RANK, D, F, E, K = 512, 256, 384, 8, 2


def _inputs(R, seed):
  x, ids, gates, w1, w2 = layer_inputs(T_PER_RANK * R, D, F, E, K, "skewed", seed, dtype=jnp.bfloat16)
  rng = np.random.default_rng(seed + 1)
  ids = np.where(rng.random(ids.shape) < 0.1, SKIP, np.asarray(ids))
  ids[::13] = SKIP
  cot = jnp.asarray(rng.standard_normal((T_PER_RANK * R, D)).astype(np.float32))
  return x, jnp.asarray(ids.astype(np.int32)), gates, w1.astype(jnp.float32), w2.astype(jnp.float32), cot


def _grads(mesh, ids, cot, impl, cf):
  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, capacity_factor=cf,
                                 quantization="fp8")
    return jnp.sum(y.astype(jnp.float32) * cot), (y, dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def check_within_tolerance(label, got, want):
  """y and the gradients (dx, dgates, dw1, dw2) against impl="collective"'s: finite, nonzero, within 1e-2 relative;
  prints each difference and whether it is bitwise equal."""
  for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), got, want):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    assert np.all(np.isfinite(a)) and float(np.max(np.abs(b))) > 0, name
    err = rel_err(a, b)
    print(f"{label} {name}: relative difference {err:.3e}, bitwise equal: {np.array_equal(a, b)}")
    assert err < 1e-2, (name, err)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused-combine"])
@pytest.mark.parametrize("cf", [None, 0.75], ids=["dropless", "cf0.75"])
@pytest.mark.parametrize("R", RANKS, ids=lambda r: f"R{r}")
def test_overlap_fp8_matches_collective_fp8(R, cf, fused, monkeypatch):
  if fused and R == 1:
    pytest.skip("one GPU: the layer takes impl='collective''s block (no way back to fuse; "
                "test_gpu_expert_combine.py and test_gpu_multiprocess.py run the fused FP8 combine there)")
  monkeypatch.setattr(call_site, "FP8_FUSED_COMBINE_ON_GPU", fused)
  mesh = gpu_mesh(R)
  x, ids, gates, w1, w2, cot = _inputs(R, 40 + R)
  f = _grads(mesh, ids, cot, "overlap", cf)
  hlo = f.lower(x, gates, w1, w2).as_text()
  rows = [re.findall(r"tensor<[^>]*>", re.search(r":\s*\((.*)\)\s*->", line).group(1))[0]
          for line in hlo.splitlines() if "@jmo_dispatch(" in line]
  if R == 1:  # no row crosses a link: impl="collective"'s block (xla_path.fp8_one_rank_block), no dispatch call
    assert rows == [] and "@jmo_grouped_matmul_fp8(" in hlo, rows
  elif fused:  # GEMM2 and the way back, dx = da W1^T and its way back: each one expert_combine on e4m3 operands
    assert [r.endswith("xui8>") for r in rows] == [True, True], rows
    assert f"x{D + D // 32}xui8>" in rows[0] and hlo.count("@jmo_expert_combine(") == 2
  else:
    assert [r.endswith("xui8>") for r in rows] == [True, False, True, False], rows
    assert f"x{D + D // 32}xui8>" in rows[0] and "@jmo_expert_combine(" not in hlo
  assert "@jmo_dispatch_gemm(" not in hlo
  (_, (y, dropped)), grads = f(x, gates, w1, w2)
  (_, (y_ref, dropped_ref)), grads_ref = _grads(mesh, ids, cot, "collective", cf)(x, gates, w1, w2)
  assert int(dropped) == int(dropped_ref) and (int(dropped) > 0) == (cf is not None)
  check_within_tolerance(f"R={R} cf={cf}", (y, *grads), (y_ref, *grads_ref))
  (_, (y2, _)), grads2 = f(x, gates, w1, w2)
  for a, b in zip(jax.tree.leaves((y, grads)), jax.tree.leaves((y2, grads2))):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
