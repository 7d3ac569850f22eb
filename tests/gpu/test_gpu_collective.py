"""impl="collective" on the GPUs (R = every visible GPU, and 1): ragged_all_to_all (NCCL between GPUs) for the
exchange and this library's grouped GEMMs for the experts, bfloat16 against the float32 reference on the same
(bf16-rounded) inputs, forward and gradients, dropless and with drops; two calls bitwise equal; the compiled program
runs the grouped-GEMM custom calls, with GEMM1's SwiGLU in its epilogue on Hopper (no preactivation written in the
forward pass). Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import pytest

import jax_moe_overlap as jmo
import layer_checks as checks  # tests/layer_checks.py (tests/ is on pytest's pythonpath)
from gpu_common import is_hopper, gpu_mesh, rank_counts, requires_gpu

pytestmark = requires_gpu

by_ranks = pytest.mark.parametrize("R", rank_counts(), ids=lambda r: f"R{r}")


@pytest.mark.parametrize("kind,cf", [("skewed", None), ("skewed", 0.5), ("one_rank", None), ("empty_experts", None)])
@by_ranks
def test_collective_forward_and_grads(R, kind, cf):
  layer = checks.Layer(gpu_mesh(R), kind, seed=100 * R + 7, capacity_factor=cf)
  fn = jax.jit(checks.layer_fn(layer.mesh, layer.ids, layer.target, "collective", cf))
  args = layer.args(jnp.bfloat16)
  out = fn(*args)
  ref = layer.reference()
  (_, (y, dropped)), _ = out
  (_, (y_ref, dropped_ref)), _ = ref
  errs = checks.errors(out, ref)
  print(f"collective R={R} {kind} cf={cf} dropped={int(dropped)} (reference {int(dropped_ref)}) {errs}")
  assert y.dtype == jnp.bfloat16
  assert int(dropped) == int(dropped_ref) and (int(dropped) > 0) == (cf is not None)
  assert float(jnp.linalg.norm(y_ref)) > 0
  assert all(v < checks.TOL for v in errs.values()), errs
  assert checks.bits(fn(*args)) == checks.bits(out), "a second call differs"


@by_ranks
def test_collective_runs_the_grouped_gemm_custom_calls(R):
  layer = checks.Layer(gpu_mesh(R), "skewed", seed=5)
  x, gates, w1, w2 = layer.args(jnp.bfloat16)
  forward = jax.jit(lambda x, g, w1, w2: jmo.moe_experts(x, layer.ids, g, w1, w2, mesh=layer.mesh,
                                                         impl="collective")[0])
  hlo = forward.lower(x, gates, w1, w2).compile().as_text()
  gemm1 = [l for l in hlo.splitlines() if 'custom_call_target="jmo_grouped_matmul_swiglu"' in l]
  assert gemm1 and 'custom_call_target="jmo_grouped_matmul"' in hlo, hlo[-4000:]
  if is_hopper():  # the SwiGLU in GEMM1's epilogue: the preactivation output has no rows
    assert all(f"f32[0,{2 * checks.F}]" in l for l in gemm1), gemm1
