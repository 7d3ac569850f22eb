"""The bare grouped GEMMs (jax_moe_overlap.grouped_gemm) against numpy, on the CPU handlers: random group sizes with
empty groups and a tail of rows past the last group, the transposed-rhs form, the weight-gradient form, both
dtypes, and the errors; and expert_mlp, the communication-free expert work built on the grouped GEMMs (XLA's
ragged_dot on CPU); grouped_matmul_swiglu, GEMM1 with its SwiGLU; and grouped_matmul_swiglu_grad, the backward's
d_out W2^T with the SwiGLU's gradient. tests/gpu/test_gpu_grouped_gemm.py runs the same GEMM cases on the CUDA
kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_overlap import expert_gemms, grouped_gemm
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu, grouped_matmul_swiglu_grad
from jax_moe_overlap.grouped_gemm import grouped_outer
from jax_moe_overlap.expert_gemms import expert_mlp, swiglu

CASES = [  # (M, K, N, group sizes): empty groups, partial tiles, a tail of rows past the last group
    (37, 24, 40, [5, 0, 20, 12]),
    (64, 16, 8, [64]),
    (50, 32, 24, [0, 0, 30]),  # 20 tail rows
    (96, 40, 136, [1, 33, 2, 0, 60]),
]


def _ref_matmul(lhs, rhs, sizes, transpose):
  out = np.zeros((lhs.shape[0], rhs.shape[1] if transpose else rhs.shape[2]), np.float64)
  off = 0
  for g, n in enumerate(sizes):
    w = rhs[g].T if transpose else rhs[g]
    out[off:off + n] = lhs[off:off + n] @ w
    off += n
  return out


def _ref_swiglu(a):
  F = a.shape[1] // 2
  g = a[:, :F]
  return g / (1.0 + np.exp(-g)) * a[:, F:]


def check_grouped_matmul_swiglu(case, dtype, keep, tol, seed=0):
  """grouped_matmul_swiglu against float64 numpy (GEMM1, then the SwiGLU): h and, when kept, a; the rows past the
  groups zero in both. Returns the call (jitted), its operands and (h, a) for the GPU tests' further checks."""
  M, K, F, sizes = case
  lhs, rhs = _inputs(seed + M + K, (M, K), (len(sizes), K, 2 * F), dtype=dtype)
  fn = jax.jit(lambda x, w, s: grouped_matmul_swiglu(x, w, s, keep_preactivation=keep))
  gs = jnp.asarray(sizes, jnp.int32)
  h, a = fn(lhs, rhs, gs)
  ref_a = _ref_matmul(_f64(lhs), _f64(rhs), sizes, False)
  assert h.shape == (M, F) and h.dtype == dtype
  assert _rel(h.astype(jnp.float32), _ref_swiglu(ref_a)) < tol
  assert np.all(np.asarray(h[sum(sizes):].astype(jnp.float32)) == 0.0)
  if keep:
    assert a.shape == (M, 2 * F) and a.dtype == jnp.float32
    assert _rel(a, ref_a) < 1e-5
    assert np.all(np.asarray(a[sum(sizes):]) == 0.0)
  else:
    assert a is None
  return fn, (lhs, rhs, gs), (h, a)


SWIGLU_CASES = [  # (M, K, F, group sizes)
    (37, 24, 20, [5, 0, 20, 12]),
    (50, 32, 12, [0, 0, 30]),  # 20 tail rows
]


@pytest.mark.parametrize("case", SWIGLU_CASES)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("keep", [True, False])
def test_grouped_matmul_swiglu(case, dtype, tol, keep):
  check_grouped_matmul_swiglu(case, dtype, keep, tol)


def check_preactivation_rounded_once(case, seed=0):
  """bfloat16 operands, a kept in bfloat16 (preactivation_dtype): a is the float32 preactivation of the same call
  rounded once (bit for bit, the rows past the groups zero) and h the same bits, since h is computed from the float32
  values either way. Returns a in bfloat16."""
  M, K, F, sizes = case
  lhs, rhs = _inputs(seed + M + K, (M, K), (len(sizes), K, 2 * F), dtype=jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  call = lambda a_dtype: jax.jit(lambda x, w, s: grouped_matmul_swiglu(x, w, s, keep_preactivation=True,
                                                                     preactivation_dtype=a_dtype))(lhs, rhs, gs)
  h32, a32 = call(jnp.float32)
  h16, a16 = call(jnp.bfloat16)
  assert a16.dtype == jnp.bfloat16 and a16.shape == a32.shape
  assert np.array_equal(np.asarray(a16).view(np.uint16), np.asarray(a32.astype(jnp.bfloat16)).view(np.uint16))
  assert np.array_equal(np.asarray(h16).view(np.uint16), np.asarray(h32).view(np.uint16))
  return a16


def raw_swiglu_call_keeping_bf16_a(lhs, rhs, gs):
  """The jmo_grouped_matmul_swiglu custom call itself (past the wrapper's choice of a's dtype) on bf16 operands with a
  bf16 a: (h, a)."""
  M, F = lhs.shape[0], rhs.shape[2] // 2
  out = (jax.ShapeDtypeStruct((M, F), jnp.bfloat16), jax.ShapeDtypeStruct((M, 2 * F), jnp.bfloat16))
  return jax.jit(lambda *o: jax.ffi.ffi_call(grouped_gemm.GROUPED_MATMUL_SWIGLU, out)(*o))(lhs, rhs, gs)


@pytest.mark.parametrize("case", SWIGLU_CASES)
def test_grouped_matmul_swiglu_keeps_a_rounded_once(case):
  check_preactivation_rounded_once(case)
  # The CPU handler itself rounds a kept in bf16 (the wrapper asks for it where the process's GPU has the fused
  # epilogue, engines.swiglu_fused; a CPU-only process rounds float32 a in XLA): the custom call with a bf16 result.
  M, K, F, sizes = case
  lhs, rhs = _inputs(M + K, (M, K), (len(sizes), K, 2 * F), dtype=jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  h, a = raw_swiglu_call_keeping_bf16_a(lhs, rhs, gs)
  h32, a32 = grouped_matmul_swiglu(lhs, rhs, gs, keep_preactivation=True)
  assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(a32.astype(jnp.bfloat16)).view(np.uint16))
  assert np.array_equal(np.asarray(h).view(np.uint16), np.asarray(h32).view(np.uint16))
  lhs, rhs = _inputs(3, (10, 8), (2, 8, 6), dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="preactivation's dtype must be float32 or the operands' dtype bfloat16, got "
                                      "float16"):
    grouped_matmul_swiglu(lhs, rhs, jnp.asarray([5, 5], jnp.int32), keep_preactivation=True,
                          preactivation_dtype=jnp.float16)


def test_grouped_matmul_swiglu_bad_operands_raise():
  lhs, rhs = _inputs(6, (10, 8), (2, 8, 6), dtype=jnp.float32)
  sizes = jnp.asarray([5, 5], jnp.int32)
  with pytest.raises(ValueError, match="do not fit"):
    grouped_matmul_swiglu(lhs, rhs[:, :, :5], sizes, keep_preactivation=True)  # odd 2F
  with pytest.raises(ValueError, match="do not fit"):
    grouped_matmul_swiglu(lhs, rhs[:, :4], sizes, keep_preactivation=True)
  with pytest.raises(TypeError, match="share a dtype"):
    grouped_matmul_swiglu(lhs, rhs.astype(jnp.bfloat16), sizes, keep_preactivation=False)


def _ref_swiglu_grad(a, dh):
  """float64: the input gradient of silu(a[:, :F]) * a[:, F:] for dh, analytically."""
  F = a.shape[1] // 2
  g, u = a[:, :F], a[:, F:]
  sig = 1.0 / (1.0 + np.exp(-g))
  return np.concatenate([dh * u * (sig + g * sig * (1.0 - sig)), dh * g * sig], axis=1)


def _into_poison(fn, *args):
  """fn(*args) jitted, its output computed into a donated NaN-filled buffer (an element fn does not write stays NaN);
  asserts that XLA took the donation."""
  shape = jax.eval_shape(fn, *args)
  poison = jnp.full(shape.shape, jnp.nan, shape.dtype)
  before = poison.unsafe_buffer_pointer()
  out = jax.jit(lambda p, *a: fn(*a), donate_argnums=0, keep_unused=True)(poison, *args)
  assert out.unsafe_buffer_pointer() == before, "XLA declined the poisoned buffer"
  return out


def check_grouped_matmul_swiglu_grad(case, transpose, dtype, tol, seed=0, a_dtype=jnp.float32):
  """grouped_matmul_swiglu_grad against float64 numpy (dh = d_out @ W^T per group, then SwiGLU's gradient at a), its
  output computed into NaN: every row of the groups within tol, the rows past them zero. a (in a_dtype: float32, or
  the operands' dtype as the layer keeps it) is random on every row (the tail too: the call must not read it there).
  Returns the call (jitted), its operands and da for the GPU tests."""
  M, K, F, sizes = case
  G = len(sizes)
  d_out, w, a = _inputs(seed + 7 * M + K, (M, K), (G, F, K) if transpose else (G, K, F), (M, 2 * F), dtype=dtype)
  a = (a.astype(jnp.float32) * 2.0).astype(a_dtype)  # the gate past the silu's knee both ways
  gs = jnp.asarray(sizes, jnp.int32)
  fn = lambda x, w, s, a: grouped_matmul_swiglu_grad(x, w, s, a, transpose_rhs=transpose)
  da = _into_poison(fn, d_out, w, gs, a)
  assert da.shape == (M, 2 * F) and da.dtype == dtype
  rows = sum(sizes)
  dh = _ref_matmul(_f64(d_out), _f64(w), sizes, transpose)[:rows]
  ref = _ref_swiglu_grad(np.asarray(a, np.float64)[:rows], dh)
  got = np.asarray(da.astype(jnp.float32), np.float64)
  assert np.isfinite(got).all()
  if rows:
    assert _rel(got[:rows], ref) < tol, _rel(got[:rows], ref)
  assert np.all(got[rows:] == 0.0)
  return jax.jit(fn), (d_out, w, gs, a), da


SWIGLU_GRAD_CASES = [  # (M, K, F, group sizes): empty and skewed groups, a tail of rows past the last group
    (37, 24, 20, [5, 0, 20, 12]),
    (50, 32, 12, [0, 0, 30]),     # 20 tail rows
    (40, 16, 8, [0, 40, 0]),      # one group has every row
    (16, 8, 4, [0, 0]),           # no rows at all: da is all zero
]


def _swiglu_grad_params():
  """Every (case, transpose, dtype); four of them, each case and each option once, in the default pass, the rest slow."""
  quick = {(0, True, "float32"), (1, False, "bfloat16"), (2, True, "bfloat16"), (3, False, "float32")}
  for i, case in enumerate(SWIGLU_GRAD_CASES):
    for transpose in (True, False):
      for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        marks = () if (i, transpose, jnp.dtype(dtype).name) in quick else (pytest.mark.slow,)
        yield pytest.param(case, transpose, dtype, tol, marks=marks)


@pytest.mark.parametrize("case,transpose,dtype,tol", list(_swiglu_grad_params()))
def test_grouped_matmul_swiglu_grad(case, transpose, dtype, tol):
  check_grouped_matmul_swiglu_grad(case, transpose, dtype, tol)


@pytest.mark.parametrize("case,transpose", [(SWIGLU_GRAD_CASES[0], True),
                                            pytest.param(SWIGLU_GRAD_CASES[1], False, marks=pytest.mark.slow)])
def test_grouped_matmul_swiglu_grad_preactivation_in_bf16(case, transpose):
  # The layer keeps a in its compute dtype (expert_gemms.kept_preactivation_dtype): the call takes a bf16 a beside bf16
  # operands, each value taken to float32.
  check_grouped_matmul_swiglu_grad(case, transpose, jnp.bfloat16, 1e-2, a_dtype=jnp.bfloat16)


def test_grouped_matmul_swiglu_grad_is_the_unfused_math():
  # The call = grouped_matmul's float32 dh (the CPU handlers' one row loop: the same bits), then jax.vjp of swiglu,
  # rounded once: within a float32 ulp or two of it (the exp of C++ and of XLA:CPU may differ in the last bit).
  d_out, w, a = _inputs(21, (45, 32), (3, 24, 32), (45, 48), dtype=jnp.float32)
  gs = jnp.asarray([20, 0, 19], jnp.int32)
  fused = grouped_matmul_swiglu_grad(d_out, w, gs, a, transpose_rhs=True)
  unfused = expert_gemms.swiglu_grad(a, grouped_matmul(d_out, w, gs, transpose_rhs=True), jnp.float32)
  np.testing.assert_allclose(np.asarray(fused), np.asarray(unfused), rtol=2e-6, atol=1e-6)


def test_grouped_matmul_swiglu_grad_bad_operands_raise():
  d_out, w, a = _inputs(8, (10, 8), (2, 6, 8), (10, 12), dtype=jnp.float32)
  sizes = jnp.asarray([5, 5], jnp.int32)
  with pytest.raises(ValueError, match="contraction K"):
    grouped_matmul_swiglu_grad(d_out, w, sizes, a)  # w [G, 6, 8] as stored [G, K, F]: K = 6, d_out has 8
  with pytest.raises(ValueError, match=r"a must be \[10, 12\]"):
    grouped_matmul_swiglu_grad(d_out, w, sizes, a[:, :10], transpose_rhs=True)
  with pytest.raises(ValueError, match="in float32 or lhs's dtype float32, got bfloat16"):
    grouped_matmul_swiglu_grad(d_out, w, sizes, a.astype(jnp.bfloat16), transpose_rhs=True)
  with pytest.raises(ValueError, match="do not fit"):
    grouped_matmul_swiglu_grad(d_out, w, sizes[:1], a, transpose_rhs=True)
  with pytest.raises(TypeError, match="share a dtype"):
    grouped_matmul_swiglu_grad(d_out, w.astype(jnp.bfloat16), sizes, a, transpose_rhs=True)
  with pytest.raises(Exception, match="group sizes must be >= 0 and sum to at most 10"):
    jax.block_until_ready(grouped_matmul_swiglu_grad(d_out, w, jnp.asarray([6, 6], jnp.int32), a,
                                                     transpose_rhs=True))


def _ref_outer(lhs, rhs, sizes):
  out, off = [], 0
  for n in sizes:
    out.append(lhs[off:off + n].T @ rhs[off:off + n])
    off += n
  return np.stack(out)


def _inputs(seed, *shapes, dtype):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _f64(x):
  return np.asarray(x.astype(jnp.float32), np.float64)


def _rel(got, ref):
  return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype,out_dtype,tol", [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-5),
                                                  (jnp.bfloat16, None, 1e-2)])
def test_grouped_matmul(case, transpose, dtype, out_dtype, tol):
  M, K, N, sizes = case
  G = len(sizes)
  lhs, rhs = _inputs(M + K, (M, K), (G, N, K) if transpose else (G, K, N), dtype=dtype)
  out = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, transpose_rhs=transpose, preferred_element_type=out_dtype))(
      lhs, rhs, jnp.asarray(sizes, jnp.int32))
  assert out.shape == (M, N) and out.dtype == (out_dtype or dtype)
  ref = _ref_matmul(_f64(lhs), _f64(rhs), sizes, transpose)
  assert _rel(out.astype(jnp.float32), ref) < tol
  assert np.all(np.asarray(out[sum(sizes):].astype(jnp.float32)) == 0.0)  # tail rows are zero, not garbage


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,out_dtype,tol", [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-5),
                                                  (jnp.bfloat16, None, 1e-2)])
def test_grouped_outer(case, dtype, out_dtype, tol):
  M, K, N, sizes = case
  lhs, rhs = _inputs(M * K, (M, K), (M, N), dtype=dtype)
  out = jax.jit(lambda a, b, s: grouped_outer(a, b, s, preferred_element_type=out_dtype))(
      lhs, rhs, jnp.asarray(sizes, jnp.int32))
  assert out.shape == (len(sizes), K, N) and out.dtype == (out_dtype or dtype)
  ref = _ref_outer(_f64(lhs), _f64(rhs), sizes)
  assert _rel(out.astype(jnp.float32), ref) < tol
  for g, n in enumerate(sizes):
    if n == 0:
      assert np.all(np.asarray(out[g].astype(jnp.float32)) == 0.0)


def test_matches_ragged_dot():
  lhs, rhs = _inputs(3, (40, 16), (3, 16, 24), dtype=jnp.float32)
  sizes = jnp.asarray([10, 0, 25], jnp.int32)
  ours = grouped_matmul(lhs, rhs, sizes)
  xla = jax.lax.ragged_dot(lhs, rhs, sizes)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-5, atol=1e-5)


def test_expert_mlp_value_and_grads():
  """expert_mlp (the benchmarks' compute-alone probe) = per group swiglu(x @ w1) @ w2, zero tail rows, and its
  custom backward (expert_block's backward GEMMs) = autodiff of that per-group loop."""
  sizes, D, F = [5, 0, 20, 12], 16, 8
  x, w1, w2, ct = _inputs(7, (41, D), (4, D, 2 * F), (4, F, D), (41, D), dtype=jnp.float32)   # 4 tail rows

  def ref(x, w1, w2):
    out, off = jnp.zeros_like(x), 0
    for g, n in enumerate(sizes):
      out = out.at[off:off + n].set(swiglu(x[off:off + n] @ w1[g]) @ w2[g])
      off += n
    return out

  gs = jnp.asarray(sizes, jnp.int32)

  def value_and_vjp(f):   # jitted: the per-group reference is many small ops
    def run(x, w1, w2, ct):
      out, vjp = jax.vjp(f, x, w1, w2)
      return out, vjp(ct)
    return jax.jit(run)

  got, grads = value_and_vjp(lambda *a: expert_mlp(*a, gs))(x, w1, w2, ct)
  want, ref_grads = value_and_vjp(ref)(x, w1, w2, ct)
  # Float32 sums whose terms reach ~50 round to ~1e-5 on their own: absolute errors are judged on each output's scale.
  for a, r in zip((got, *grads), (want, *ref_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


@pytest.mark.slow
def test_expert_mlp_grads_with_the_fused_swiglu_grad(monkeypatch):
  """expert_mlp's backward with the SwiGLU's gradient in the backward GEMM's call (grouped_matmul_swiglu_grad, as on a
  Hopper GPU; its CPU handler here) = the default (XLA's ragged_dot, then jax.vjp of swiglu), within float32
  rounding: the wiring (operands, W2 read transposed, d_gate | d_up) of expert_grads' fused branch."""
  sizes, D, F = [5, 0, 20, 12], 16, 8
  x, w1, w2, ct = _inputs(9, (41, D), (4, D, 2 * F), (4, F, D), (41, D), dtype=jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def grads():
    jax.clear_caches()
    return jax.jit(lambda *a: jax.vjp(lambda x, w1, w2: expert_mlp(x, w1, w2, gs), *a[:3])[1](a[3]))(x, w1, w2, ct)

  default = grads()
  monkeypatch.setattr(expert_gemms, "gemm2_grad_swiglu_grad",
                      lambda d_out, w2, s, a, dt: grouped_matmul_swiglu_grad(d_out, w2, s, a, transpose_rhs=True))
  fused = grads()
  for f, d in zip(fused, default):
    np.testing.assert_allclose(np.asarray(f), np.asarray(d), rtol=1e-5, atol=1e-5 * float(np.abs(d).max()))


def test_bad_group_sizes_raise():
  lhs, rhs = _inputs(4, (10, 8), (2, 8, 8), dtype=jnp.float32)
  with pytest.raises(Exception, match="group sizes must be >= 0 and sum to at most 10"):
    jax.block_until_ready(grouped_matmul(lhs, rhs, jnp.asarray([6, 6], jnp.int32)))
  with pytest.raises(Exception, match="group 0 has -1 rows"):
    jax.block_until_ready(grouped_outer(lhs, lhs, jnp.asarray([-1, 2], jnp.int32)))


def test_bad_operands_raise():
  lhs, rhs = _inputs(5, (10, 8), (2, 8, 8), dtype=jnp.float32)
  sizes = jnp.asarray([5, 5], jnp.int32)
  with pytest.raises(ValueError, match="do not fit"):
    grouped_matmul(lhs, rhs[:, :4], sizes)
  with pytest.raises(ValueError, match="do not fit"):
    grouped_matmul(lhs, rhs, sizes[:1])
  with pytest.raises(TypeError, match="share a dtype"):
    grouped_matmul(lhs, rhs.astype(jnp.bfloat16), sizes)
  with pytest.raises(TypeError, match="preferred_element_type"):
    grouped_matmul(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes, preferred_element_type=jnp.float16)
  with pytest.raises(TypeError, match="integer"):
    grouped_outer(lhs, lhs, sizes.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"\[M, K\] and \[M, N\]"):
    grouped_outer(lhs, lhs[:4], sizes)
