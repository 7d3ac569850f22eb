"""dispatch_gemm's FP8 kernel (ffi/cuda/ops/dispatch_gemm.cu over Fp8PackedRowsOperands: packed e4m3 rows dispatched
and multiplied by the FP8 grouped GEMM's loop where they land) on the GPUs: the call against dispatch +
fp8.unpack_rows + grouped_matmul_swiglu_fp8 / grouped_matmul_fp8 (the same loop and promotion over the same rows:
bit for bit in the kept rows, every result computed into the poison), GEMM1 with the recipe's SwiGLU kept for
training and for inference, the float32 product, send once; then the FP8 layer with the dispatches fused
(call_site.FP8_FUSED_DISPATCH_ON_GPU switched on, R > 1) against impl="collective" under fp8 within the FP8 kernels'
tolerance, its program holding two dispatch_gemm calls on uint8 rows (x with GEMM1, dy with dh = dy W2^T). On a
mesh over every visible GPU (and one GPU); d_model a multiple of 512 (the kernel's rule: the packed rows' stride a
multiple of 16 bytes). Skips where there is no Hopper GPU."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_overlap import call_site
from cases import layer_inputs
from gpu_common import gpu_mesh, rank_counts, requires_gpu
# (requires_hopper's condition names _hopper in this module)
from test_gpu_grouped_gemm_fp8 import _hopper, requires_hopper  # noqa: F401
from test_gpu_fp8_overlap import _grads, check_within_tolerance
from test_dispatch_gemm import check_fp8_call
from jax_moe_overlap.plan import SKIP

pytestmark = [requires_gpu, requires_hopper]

RANKS = rank_counts()
D, F, E, K = 512, 384, 8, 2


# (d_model 1536: the scale tails' TMA boxes past the first 4 chunks; the plain form's N = 640: a last column tile
# whose second half is past N, its block scale clamped to the last block.)
# (x_recv kept: stored by the GEMM tiles, the default, and copied by the side units; with d_model 1536 and 1024 the
# tiles store the scale tails of several 4-chunk boxes.)
@pytest.mark.parametrize("d_model,N,kind,cf,skip,swiglu,keep,send_once,from_tiles", [
    pytest.param(D, 2 * F, "skewed", None, True, True, True, False, True, id="swiglu-train"),
    pytest.param(D, 2 * F, "skewed", None, True, True, True, False, False, id="swiglu-train-x_recv-copied"),
    pytest.param(1536, 2 * F, "skewed", 0.75, False, True, False, False, True, id="swiglu-inference-drops-D1536"),
    pytest.param(1536, 2 * F, "skewed", None, False, True, True, False, True, id="swiglu-train-D1536"),
    pytest.param(D, 2 * F, "all_to_one", None, True, True, True, True, True, id="swiglu-train-send-once"),
    pytest.param(D, 2 * F, "skewed", None, True, False, True, False, True, id="plain"),
    pytest.param(1024, 640, "skewed", None, False, False, True, True, True, id="plain-N640-D1024-send-once"),
    pytest.param(1024, 640, "skewed", None, False, False, True, True, False,
                 id="plain-N640-D1024-send-once-x_recv-copied")])
@pytest.mark.parametrize("R", RANKS, ids=lambda r: f"R{r}")
def test_fp8_call_equals_dispatch_unpack_and_fp8_gemm(R, d_model, N, kind, cf, skip, swiglu, keep, send_once,
                                                      from_tiles):
  check_fp8_call(gpu_mesh(R), 512, d_model, N, kind, cf, skip, swiglu, keep, send_once,
                 x_recv_from_tiles=from_tiles)


@pytest.mark.parametrize("R", [r for r in RANKS if r > 1] or [2], ids=lambda r: f"R{r}")
def test_fp8_layer_with_fused_dispatch_matches_collective(R, monkeypatch):
  if R not in RANKS:
    pytest.skip("one GPU: the layer takes impl='collective''s block (no dispatch to fuse)")
  monkeypatch.setattr(call_site, "FP8_FUSED_DISPATCH_ON_GPU", True)
  mesh = gpu_mesh(R)
  x, ids, gates, w1, w2 = layer_inputs(512 * R, D, F, E, K, "skewed", 7, dtype=jnp.bfloat16)
  rng = np.random.default_rng(8)
  ids = jnp.asarray(np.where(rng.random(ids.shape) < 0.1, SKIP, np.asarray(ids)).astype(np.int32))
  cot = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
  w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)
  f = _grads(mesh, ids, cot, "overlap", None)
  hlo = f.lower(x, gates, w1, w2).as_text()
  # The forward's x with GEMM1 (w1's e4m3 values [E_l, 2F, D]) and the backward's dy with dh = dy W2^T ([E_l, F, D]).
  calls = [line for line in hlo.splitlines() if "@jmo_dispatch_gemm(" in line]
  assert len(calls) == 2 and all(f"x{D + D // 32}xui8>" in c for c in calls), calls
  assert f"x{2 * F}x{D}xf8E4M3FN>" in calls[0] and f"x{F}x{D}xf8E4M3FN>" in calls[1], calls
  (_, (y, _)), g = f(x, gates, w1, w2)
  (_, (y_ref, _)), g_ref = _grads(mesh, ids, cot, "collective", None)(x, gates, w1, w2)
  check_within_tolerance(f"R={R}", (y, *g), (y_ref, *g_ref))
