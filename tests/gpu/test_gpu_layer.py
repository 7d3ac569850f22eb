"""EP=1 on one GPU through JAX: the overlap layer (CUDA kernels) vs the pure-JAX reference, forward and gradients.

bfloat16 operands on the tensor-core producer, compared with the reference computed in float32 on the same
(bf16-rounded) inputs: relative error below 1e-2 (DESIGN §7). Skips where there is no GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpu_common import gpu_devices, rel_err, requires_gpu

pytestmark = requires_gpu

TOL = 1e-2


def _mesh():
  return jax.sharding.Mesh(np.array(gpu_devices()[:1]), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))


def _routing(kind, tokens, num_experts, k, rng):
  if kind == "balanced":
    return np.stack([rng.permutation(num_experts)[:k] for _ in range(tokens)]).astype(np.int32)
  if kind == "skewed":
    p = 1.0 / (np.arange(num_experts) + 1.0) ** 1.5
    p /= p.sum()
    return np.stack([rng.choice(num_experts, k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
  if kind == "empty_experts":  # only experts 0..k: the others get no rows at all
    return np.stack([rng.permutation(k + 1)[:k] for _ in range(tokens)]).astype(np.int32)
  raise ValueError(kind)


def _inputs(kind, tokens=256, d=256, f=384, num_experts=8, k=2, seed=0):
  rng = np.random.default_rng(seed)
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = jax.random.normal(ks[0], (tokens, d), jnp.float32).astype(jnp.bfloat16)
  gates = jax.nn.softmax(jax.random.normal(ks[1], (tokens, k)), axis=-1)
  w1 = (jax.random.normal(ks[2], (num_experts, d, 2 * f)) / np.sqrt(d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(ks[3], (num_experts, f, d)) / np.sqrt(f)).astype(jnp.bfloat16)
  ids = jnp.asarray(_routing(kind, tokens, num_experts, k, rng))
  return x, ids, gates, w1, w2


def test_producer_path_and_device_queries():
  from jax_moe_overlap import _jmo, cuda_workspace  # pylint: disable=g-import-not-at-top
  info = cuda_workspace.device_info(gpu_devices()[0].local_hardware_id)
  assert info.sm_count > 0 and info.compute_capability >= (8, 0), info
  # The layer tests below (D = 256, F = 384) run the engine named here: wgmma on Hopper, mma.sync elsewhere.
  hopper = info.compute_capability[0] == 9
  assert _jmo.cuda_producer_path(True, 384, 256) == ("wgmma bf16" if hopper else "mma.sync bf16")
  assert _jmo.cuda_grouped_gemm_path(True, 384, 256) == ("wgmma bf16" if hopper else "mma.sync bf16")
  assert _jmo.cuda_producer_path(True, 200, 136) == "mma.sync bf16"   # K, N not multiples of 64
  assert _jmo.cuda_producer_path(False, 384, 256) == "simt fp32"
  # w transposed in place (the backward pass's dx = da @ W1^T: K = 2F = 768, N = D = 256 here): the same engines,
  # except that only K must be a multiple of 8 for mma.sync (w's rows hold K elements).
  assert _jmo.cuda_producer_path(True, 768, 256, transpose_rhs=True) == ("wgmma bf16" if hopper else "mma.sync bf16")
  assert _jmo.cuda_producer_path(True, 200, 140) == "simt fp32"
  assert _jmo.cuda_producer_path(True, 200, 140, transpose_rhs=True) == "mma.sync bf16"
  assert _jmo.cuda_producer_path(True, 204, 136, transpose_rhs=True) == "simt fp32"
  assert _jmo.cuda_producer_path(False, 384, 256, transpose_rhs=True) == "simt fp32"


@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_experts"])
def test_moe_experts_forward_and_grads(kind):
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  x, ids, gates, w1, w2 = _inputs(kind)
  target = jax.random.normal(jax.random.PRNGKey(7), (x.shape[0], x.shape[1]), jnp.float32)

  def loss(impl, dtype):
    def f(x, gates, w1, w2):
      y, _ = jmo.moe_experts(x.astype(dtype), ids, gates, w1.astype(dtype), w2.astype(dtype), mesh=mesh,
                             impl=impl)
      return jnp.sum(y.astype(jnp.float32) * target), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

  (_, y), g = loss("overlap", jnp.bfloat16)(x, gates, w1, w2)
  (_, y_ref), g_ref = loss("reference", jnp.float32)(x, gates, w1, w2)
  assert np.isfinite(np.asarray(y, np.float32)).all()
  errs = {"y": rel_err(y, y_ref)}
  for name, a, b in zip(("dx", "dgates", "dw1", "dw2"), g, g_ref):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    errs[name] = rel_err(a, b)
  print(kind, {k_: f"{v:.2e}" for k_, v in errs.items()})
  assert all(v < TOL for v in errs.values()), errs
  assert float(jnp.linalg.norm(y_ref.astype(jnp.float32))) > 0


def test_flax_module_forward_and_grads():
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  kw = dict(mesh=mesh, rngs=nnx.Rngs(3))
  model = jmo.MoE(256, 384, 8, 2, impl="overlap", dtype=jnp.bfloat16, **kw)
  ref = jmo.MoE(256, 384, 8, 2, impl="reference", dtype=jnp.float32, mesh=mesh, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 128, 256), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
  target = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)

  def loss_fn(m):
    y, aux = m(x)
    return jnp.mean((y - target) ** 2) + 0.01 * aux.load_balance_loss, y

  step = nnx.jit(lambda m: nnx.value_and_grad(loss_fn, has_aux=True)(m))
  (l, y), g = step(model)
  (l_ref, y_ref), g_ref = step(ref)
  errs = {"loss": abs(float(l) - float(l_ref)) / abs(float(l_ref)), "y": rel_err(y, y_ref)}
  for name in ("router", "w1", "w2"):
    a = np.asarray(getattr(g, name)[...], np.float32)
    b = np.asarray(getattr(g_ref, name)[...], np.float32)
    assert np.isfinite(a).all(), name
    errs["d" + name] = rel_err(a, b)
  print({k_: f"{v:.2e}" for k_, v in errs.items()})
  assert all(v < TOL for v in errs.values()), errs


def test_1000_consecutive_calls_are_identical():
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  x, ids, gates, w1, w2 = _inputs("skewed", tokens=128, d=128, f=192, seed=5)
  fwd = jax.jit(lambda x, g, a, b: jmo.moe_experts(x, ids, g, a, b, mesh=mesh)[0])
  first = np.asarray(fwd(x, gates, w1, w2), np.float32)
  y_ref, _ = jmo.moe_experts(x.astype(jnp.float32), ids, gates, w1.astype(jnp.float32), w2.astype(jnp.float32),
                             mesh=mesh, impl="reference")
  assert rel_err(first, y_ref) < TOL
  outs = [fwd(x, gates, w1, w2) for _ in range(999)]
  diffs = sum(int(not np.array_equal(np.asarray(o, np.float32), first)) for o in outs)
  assert diffs == 0, f"{diffs} of 999 repeated calls differ from the first"
