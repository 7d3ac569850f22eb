"""The overlap layer (CUDA kernels) through JAX on a mesh over every visible GPU (R = all of them, and R = 1 as well
when there are several) vs the pure-JAX reference: forward and gradients under balanced, skewed, one-rank and
empty-expert routing, dropped capacity, the Flax module, 1000 consecutive calls and a rank held back.

At R > 1 the ranks are separate GPUs: the kernels write each other's memory through peer access. The bodies are
tests/layer_checks.py (bfloat16 operands vs the reference in float32 on the same bf16-rounded inputs, relative error
below 1e-2, outputs computed into NaN-poisoned buffers); tests/test_moe.py runs them on CPU devices too. Skips where
there is no GPU.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from gpu_common import gemm_engine, gpu_devices, gpu_mesh, is_hopper, rank_counts, requires_gpu
import layer_checks as checks  # tests/layer_checks.py (tests/ is on pytest's pythonpath)

pytestmark = requires_gpu

RANKS = rank_counts()
R_ALL = RANKS[-1]
by_ranks = pytest.mark.parametrize("R", RANKS, ids=lambda r: f"R{r}")
KINDS = ["balanced", "skewed", "one_rank", "empty_experts"]


def test_gemm_engine_and_device_queries():
  from jax_moe_overlap import engines, workspace_cuda  # pylint: disable=g-import-not-at-top
  info = workspace_cuda.device_info(gpu_devices()[0].local_hardware_id)
  assert info.sm_count > 0 and info.compute_capability >= (8, 0), info
  # The layer tests below (D = 256, F = 384) run the engine named here: wgmma on Hopper, mma.sync elsewhere; every op
  # (expert_combine's producer, the grouped GEMMs, dispatch_gemm) selects with the same rule.
  hopper = engines.wgmma_runs_on(info.compute_capability)
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert gemm_engine(bf16, 384, 256) == ("wgmma bf16" if hopper else "mma.sync bf16")
  assert gemm_engine(bf16, 384, 256, outer=True, M=1024) == ("wgmma bf16" if hopper else "mma.sync bf16")
  assert gemm_engine(bf16, 256, 768, swiglu=True) == ("wgmma bf16" if hopper else None)
  assert gemm_engine(bf16, 200, 136) == "mma.sync bf16"   # K, N not multiples of 64
  assert gemm_engine(f32, 384, 256) == "simt fp32"
  # w transposed in place (the backward pass's dx = da @ W1^T: K = 2F = 768, N = D = 256 here): the same engines,
  # except that only K must be a multiple of 8 for mma.sync (w's rows hold K elements).
  assert gemm_engine(bf16, 768, 256, transpose_rhs=True) == ("wgmma bf16" if hopper else "mma.sync bf16")
  assert gemm_engine(bf16, 200, 140) == "simt fp32"
  assert gemm_engine(bf16, 200, 140, transpose_rhs=True) == "mma.sync bf16"
  assert gemm_engine(bf16, 204, 136, transpose_rhs=True) == "simt fp32"
  assert gemm_engine(f32, 384, 256, transpose_rhs=True) == "simt fp32"


@pytest.mark.parametrize("kind", KINDS)
@by_ranks
def test_moe_experts_forward_and_grads(R, kind):
  checks.check_layer(gpu_mesh(R), kind, seed=100 * R + KINDS.index(kind))


@by_ranks
def test_dropped_capacity_like_the_reference(R):
  # capacity_factor 0.5 under skewed routing: slots dropped by the plan's rule, counted and zeroed as the reference.
  checks.check_layer(gpu_mesh(R), "skewed", capacity_factor=0.5, seed=100 * R + 50)


@by_ranks
def test_flax_module_forward_and_grads(R):
  checks.check_module(gpu_mesh(R), seed=100 * R + 3)


@by_ranks
def test_dispatch_gemm_equals_two_calls(R):
  if not is_hopper():
    pytest.skip("dispatch_gemm runs on Hopper (sm_90a) only")
  checks.check_dispatch_gemm(gpu_mesh(R))


@by_ranks
def test_dispatch_gemm_x_recv_copied_equals_two_calls(R):
  # CallConfig(x_recv_from_tiles=False): the fused kernel's side units copy x_recv (read by the backward's GEMMs).
  if not is_hopper():
    pytest.skip("dispatch_gemm runs on Hopper (sm_90a) only")
  checks.check_dispatch_gemm(gpu_mesh(R), x_recv_from_tiles=False)


def _one_gpu_dispatch_gemm(seed, w_shape):
  """A one-GPU dispatch_gemm set-up (Hopper, two pushers): (mesh, info, make_plan(ids), cap, (T, k), x [T, D] bf16,
  w of `w_shape` with its D and N taken from (E, D, N) as named, ids [T, k] of two distinct experts, a spare key)."""
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.call_site import RankInfo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.workspace import Workspace, WorkspaceSizes  # pylint: disable=g-import-not-at-top
  mesh, T, k, E, D, N = gpu_mesh(1), 300, 2, 4, 256, 384
  cap_e = plan_lib.expert_capacity(T, 1, k, E, None)
  cap = plan_lib.recv_capacity(T, 1, k, E, cap_e)
  info = RankInfo(Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=2 * D, recv_rows=cap, ret_rows=T * k,
                                                               num_segments=E)),
                  jmo.CallConfig(dispatch_pushers=2))
  kx, kw, ki, spare = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = jax.random.normal(kx, (T, D), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, w_shape(E, D, N)) / 16).astype(jnp.bfloat16)
  ids = jax.random.randint(ki, (T, k), 0, E, jnp.int32)
  ids = ids.at[:, 1].set((ids[:, 0] + 1 + ids[:, 1] % (E - 1)) % E)  # two distinct experts a token

  def make_plan(ids):
    return plan_lib.make_plan(ids, plan_lib.local_counts(ids, E).reshape(1, 1, E), jnp.int32(0), cap_e)

  return mesh, info, make_plan, cap, (T, k), x, w, ids, spare


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w", "w_transposed"])
def test_dispatch_gemm_bf16_product_equals_two_calls(transpose_rhs):
  """dispatch_gemm's plain product rounded once to bf16 (out_dtype; the layer's backward asks its dh so,
  expert_gemms.dgrad_dtype) on one GPU: the kept rows bit for bit those of dispatch + grouped_matmul with a bf16
  output, in both of w's layouts."""
  if not is_hopper():
    pytest.skip("dispatch_gemm runs on Hopper (sm_90a) only")
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.grouped_gemm import grouped_matmul  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.workspace_calls import dispatch, dispatch_gemm  # pylint: disable=g-import-not-at-top
  mesh, info, make_plan, cap, (T, k), x, w, ids, _ = _one_gpu_dispatch_gemm(
      7, lambda E, D, N: (E, N, D) if transpose_rhs else (E, D, N))
  slot_rows = jnp.arange(T * k, dtype=jnp.int32) // k

  def both(ids, x, w):
    plan = make_plan(ids)
    _, fused, _ = dispatch_gemm(x, slot_rows, w, plan, cap, info, transpose_rhs=transpose_rhs,
                                out_dtype=jnp.bfloat16)
    x_recv = dispatch(x, slot_rows, plan, cap, info)
    two = grouped_matmul(x_recv, w, plan.expert_rows, transpose_rhs=transpose_rhs,
                         preferred_element_type=jnp.bfloat16)
    return fused, two, plan.recv_rows.reshape(1)

  f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P(), P()),
                            check_vma=False))
  fused, two, kept = f(ids, x, w)
  kept = int(kept[0])
  fused, two = np.asarray(fused), np.asarray(two)
  assert fused.dtype == two.dtype == jnp.bfloat16 and kept == T * k
  assert fused[:kept].tobytes() == two[:kept].tobytes(), "the bf16 product differs from the two calls'"
  assert np.isfinite(fused[:kept].astype(np.float32)).all() and np.abs(fused[:kept].astype(np.float32)).max() > 0


def test_dispatch_gemm_row_scale_equals_the_scaled_rows():
  """dispatch_gemm's row_scale (its pushers and own-row copies scaling each slot's row, the backward's d_out W2^T
  form: W2 read transposed, a bf16 product) on one GPU: x_recv and out bit for bit the call's on the [P, D] array of
  scaled rows (what expert_block.SCALE_IN_DISPATCH relies on in the fused backward)."""
  if not is_hopper():
    pytest.skip("dispatch_gemm runs on Hopper (sm_90a) only")
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.workspace_calls import dispatch_gemm  # pylint: disable=g-import-not-at-top
  mesh, info, make_plan, cap, (T, k), x, w, ids, ks = _one_gpu_dispatch_gemm(9, lambda E, D, N: (E, N, D))
  slots = jnp.arange(T * k, dtype=jnp.int32)
  scale = jax.random.uniform(ks, (T * k,), jnp.float32, 0.01, 1.0).at[3].set(0.0).at[4].set(-0.5)
  rows = (scale[:, None] * jnp.repeat(x, k, axis=0).astype(jnp.float32)).astype(jnp.bfloat16)

  def both(ids, x, scale, rows, w):
    plan = make_plan(ids)
    got = dispatch_gemm(x, slots // k, w, plan, cap, info, transpose_rhs=True, out_dtype=jnp.bfloat16,
                        row_scale=scale)[:2]
    want = dispatch_gemm(rows, slots, w, plan, cap, info, transpose_rhs=True, out_dtype=jnp.bfloat16)[:2]
    return (*got, *want, plan.recv_rows.reshape(1))

  f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P(),) * 5, out_specs=(P(),) * 5, check_vma=False))
  got_recv, got_out, want_recv, want_out, kept = (np.asarray(a) for a in f(ids, x, scale, rows, w))
  kept = int(kept[0])
  assert kept == T * k
  assert got_recv[:kept].tobytes() == want_recv[:kept].tobytes(), "x_recv differs from the scaled rows'"
  assert got_out[:kept].tobytes() == want_out[:kept].tobytes(), "out differs from the scaled rows' product"
  assert np.abs(got_out[:kept].astype(np.float32)).max() > 0


@by_ranks
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dispatch_row_scale_equals_the_scaled_rows(R, dtype):
  """dispatch's row_scale (the layer's unfused backward dispatches dy's rows scaled by the gates so) on the GPUs: the
  recv rows bit for bit those of the dispatch of the [P, D] array (scale[p] * x[p // k]).astype(dtype), with a zero
  and a negative scale."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.call_site import RankInfo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.workspace import Workspace, WorkspaceSizes  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.workspace_calls import dispatch  # pylint: disable=g-import-not-at-top
  dt = jnp.dtype(dtype)
  mesh, T, k, E, D = gpu_mesh(R), 300, 2, 4 * R, 260   # (bf16 rows of 520 bytes: most rows unaligned, per element)
  cap_e = plan_lib.expert_capacity(T, R, k, E, None)
  cap = plan_lib.recv_capacity(T, R, k, E // R, cap_e)
  info = RankInfo(Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=4 * D, recv_rows=cap, ret_rows=T * k,
                                                               num_segments=E)), jmo.CallConfig())
  kx, ks, ki = jax.random.split(jax.random.PRNGKey(11), 3)
  x = jax.random.normal(kx, (R * T, D), jnp.float32).astype(dt)
  scale = jax.random.uniform(ks, (R * T * k,), jnp.float32, 0.01, 1.0).at[3].set(0.0).at[4].set(-0.5)
  ids = jax.random.randint(ki, (R * T, k), 0, E, jnp.int32)
  ids = ids.at[:, 1].set((ids[:, 0] + 1 + ids[:, 1] % (E - 1)) % E)  # two distinct experts a token
  rows = (scale[:, None] * jnp.repeat(x, k, axis=0).astype(jnp.float32)).astype(dt)

  def both(ids, x, scale, rows):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts = jax.lax.all_gather(plan_lib.local_counts(ids, E).reshape(R, E // R), "expert")
    plan = plan_lib.make_plan(ids, counts, rank, cap_e)
    scaled = dispatch(x, jnp.arange(T * k, dtype=jnp.int32) // k, plan, cap, info, row_scale=scale)
    return scaled, dispatch(rows, jnp.arange(T * k, dtype=jnp.int32), plan, cap, info)

  spec = P("expert")
  f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec), check_vma=False))
  scaled, want = (np.asarray(a) for a in f(ids, x, scale, rows))
  assert scaled.tobytes() == want.tobytes(), "the scaled rows differ from the scaled array's"
  assert np.count_nonzero(scaled.astype(np.float32)) > 0


@pytest.mark.parametrize("fuse", [False, True])
def test_one_rank_backward_fuses_the_swiglu_gradient(fuse, monkeypatch):
  """With the layer taking the SwiGLU-gradient epilogue (expert_gemms.LAYER_FUSES_SWIGLU_GRAD; off by default, the
  unfused path measured faster), at R = 1 on Hopper the backward's dh = d_out W2^T and the SwiGLU's gradient are one
  grouped_matmul_swiglu_grad call: the program has it, and no [cap, 2F] concatenate (the unfused gradient's fusion)
  is left; elsewhere, and by default, the unfused path (grouped_matmul, then XLA). The gradients themselves:
  test_moe_experts_forward_and_grads. The fused epilogue reads the preactivation as the layer keeps it (bf16 here)."""
  from jax_moe_overlap import api, expert_gemms  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(expert_gemms, "LAYER_FUSES_SWIGLU_GRAD", fuse)
  # The flag is read while tracing: a layer program traced before (the other case, an earlier test with the same
  # shapes) would be reused by the library's program cache and JAX's.
  monkeypatch.setattr(api, "_programs", {})
  jax.clear_caches()
  layer = checks.Layer(gpu_mesh(1), "skewed", seed=7)
  fn = checks.layer_fn(layer.mesh, layer.ids, layer.target, "overlap")
  hlo = jax.jit(fn).lower(*layer.args(jnp.bfloat16)).compile().as_text()
  fused = 'custom_call_target="jmo_grouped_matmul_swiglu_grad"' in hlo
  concats = re.findall(rf"(?:bf16|f32)\[\d+,{2 * checks.F}\][^ ]* concatenate\(", hlo)
  print(f"R=1 backward: grouped_matmul_swiglu_grad {'in' if fused else 'not in'} the program, "
        f"{len(concats)} [*, 2F] concatenates")
  assert fused == (fuse and is_hopper()), hlo[-4000:]
  if fused:
    assert not concats, concats


@pytest.mark.parametrize("R", [R_ALL], ids=lambda r: f"R{r}")
def test_1000_consecutive_calls_are_identical(R):
  checks.check_repeats(gpu_mesh(R), 1000)


@pytest.mark.parametrize("R,rank", [(R_ALL, r) for r in sorted({0, R_ALL - 1})],
                         ids=[f"R{R_ALL}-rank{r}" for r in sorted({0, R_ALL - 1})])
def test_a_rank_held_back(R, rank):
  # 2 ms at the start of every custom call of that rank: the others wait for it at every exchange.
  checks.check_held_back(gpu_mesh(R), rank, delay_us=2000)
