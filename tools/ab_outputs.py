"""The library's GEMM, SwiGLU and FP8 quantizer kernels' outputs on fixed inputs, to compare two trees' bits on one
GPU (benchmarks/run_ab.sh's AB_BITS step): `dump` runs each kernel against whichever jax_moe_overlap is imported and
saves every output's bytes; `compare` prints, per output, how many elements differ between two dumps and by how many
units in the last place.

  PYTHONPATH=/tmp/jmo-site-base python3 tools/ab_outputs.py dump /tmp/base.npz
  PYTHONPATH=/tmp/jmo-site-new python3 tools/ab_outputs.py dump /tmp/new.npz
  python3 tools/ab_outputs.py compare /tmp/base.npz /tmp/new.npz

The inputs span the SwiGLU's whole range: rows scaled by powers of two from 2^-24 to 2^24 (gates whose exp
overflows or underflows, products that saturate e4m3), and for the element-wise kernels NaN, +-inf, -0 and
subnormals. Only the public API of jax_moe_overlap.grouped_gemm is used; a case an older tree's package cannot run
(an API it lacks) is reported and left out of its dump, and `compare` names the outputs only one dump holds.
"""
import sys

import numpy as np


def _row_scaled(rng, rows, cols):
  """float32 [rows, cols] normal draws, row r scaled by 2^(r mod 49 - 24)."""
  x = rng.standard_normal((rows, cols), dtype=np.float32)
  return x * np.exp2((np.arange(rows) % 49 - 24).astype(np.float32))[:, None]


def _with_specials(x):
  flat = x.reshape(-1)
  specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 88.8, -88.8, 104.0,
                       -104.0], np.float32)
  flat[7::997][:specials.size] = specials
  return x


def _leaves(name, tree):
  import jax
  leaves = [np.asarray(v) for v in jax.tree.leaves(tree) if v is not None]
  return {name if len(leaves) == 1 else f"{name} [{i}]": v for i, v in enumerate(leaves)}


def cases():
  """name -> a function returning {output name: array}: each kernel on its fixed inputs. A case whose API this tree's
  package lacks fails alone (``dump`` records it), so an older tree's package runs the rest."""
  import jax
  import jax.numpy as jnp
  from jax_moe_overlap import fp8
  from jax_moe_overlap import grouped_gemm as gg

  rng = np.random.default_rng(0)
  G, rows, K, F = 8, 2048, 1024, 512
  sizes = jnp.asarray(rng.multinomial(rows - 37, rng.dirichlet(np.ones(G) * 2)), jnp.int32)  # rows past the groups
  x = _row_scaled(rng, rows, K)
  w = rng.standard_normal((G, K, 2 * F), dtype=np.float32) / np.sqrt(K)
  a32 = _with_specials(_row_scaled(rng, rows, 2 * F))
  a_kept = _row_scaled(rng, rows, 2 * F)
  dh = _with_specials(_row_scaled(rng, rows, F))
  dy = rng.standard_normal((rows, K), dtype=np.float32)
  xq, xs = jax.jit(fp8.quantize_rows)(jnp.asarray(x))
  wq = jax.jit(fp8.quantize_weight)(jnp.asarray(w))
  tiles = fp8.column_tiles(rows, sizes)
  out = {}

  def fp8_swiglu():
    got = {}
    for name, keep_a in (("fp8 fused", True), ("fp8 fused, no a", False)):
      got |= _leaves(name, jax.jit(lambda *o, keep_a=keep_a: gg.grouped_matmul_swiglu_fp8(*o, keep_a=keep_a))(
          xq, xs, wq.values, wq.scales, sizes))
    return got
  out["grouped_matmul_swiglu_fp8"] = fp8_swiglu
  out["swiglu_forward_fp8"] = lambda: _leaves("swiglu_forward_fp8", jax.jit(gg.swiglu_forward_fp8)(jnp.asarray(a32)))

  def swiglu_backward():
    aq, a_s = jax.jit(fp8.quantize_rows)(jnp.asarray(a_kept))
    return _leaves("swiglu_backward_fp8", jax.jit(lambda *o: gg.swiglu_backward_fp8(*o, tiles))(
        aq, a_s, jnp.asarray(dh)))
  out["swiglu_backward_fp8"] = swiglu_backward

  def fp8_gemm():
    got = {}
    for dt in (jnp.float32, jnp.bfloat16):
      got |= _leaves(f"grouped_matmul_fp8 -> {jnp.dtype(dt).name}", jax.jit(
          lambda *o, dt=dt: gg.grouped_matmul_fp8(*o, preferred_element_type=dt))(xq, xs, wq.values, wq.scales, sizes))
    return got
  out["grouped_matmul_fp8"] = fp8_gemm
  out["quantize_weight_fp8"] = lambda: _leaves("quantize_weight_fp8", jax.jit(gg.quantize_weight_fp8)(jnp.asarray(w)))
  out["quantize_columns_fp8"] = lambda: _leaves("quantize_columns_fp8", jax.jit(
      lambda v: gg.quantize_columns_fp8(v, tiles))(jnp.asarray(a32)))

  # bf16: K a multiple of 64 runs the wgmma engine on Hopper (GEMM1 + SwiGLU fused), K = 1000 the other engine (the
  # grouped GEMM writes a and the element-wise kernel reads it: engines.swiglu_fused).
  def bf16_swiglu():
    got = {}
    for k in (K, 1000):
      xb, wb = jnp.asarray(x[:, :k], jnp.bfloat16), jnp.asarray(w[:, :k], jnp.bfloat16)
      for keep in (False, True):
        got |= _leaves(f"bf16 swiglu K={k} keep_a={keep}", jax.jit(
            lambda *o, keep=keep: gg.grouped_matmul_swiglu(*o, keep_preactivation=keep))(xb, wb, sizes))
    return got
  out["grouped_matmul_swiglu"] = bf16_swiglu

  def bf16_gemm():
    got = {}
    for k in (K, 1000):
      xb, wb = jnp.asarray(x[:, :k], jnp.bfloat16), jnp.asarray(w[:, :k], jnp.bfloat16)
      for dt in (jnp.float32, jnp.bfloat16):
        got |= _leaves(f"grouped_matmul K={k} -> {jnp.dtype(dt).name}", jax.jit(
            lambda *o, dt=dt: gg.grouped_matmul(*o, preferred_element_type=dt))(xb, wb, sizes))
    return got
  out["grouped_matmul"] = bf16_gemm

  def bf16_swiglu_grad():
    d_out = jnp.asarray(dy, jnp.bfloat16)
    w2t = jnp.asarray(np.swapaxes(w[:, :, :F], 1, 2), jnp.bfloat16)  # [G, F, K]: dh = d_out W2^T
    return _leaves("grouped_matmul_swiglu_grad", jax.jit(
        lambda *o: gg.grouped_matmul_swiglu_grad(*o, transpose_rhs=True))(d_out, w2t, sizes, jnp.asarray(a_kept)))
  out["grouped_matmul_swiglu_grad"] = bf16_swiglu_grad
  return out


def save(path, outputs):
  """{name: array} -> an .npz of each array's bits as unsigned integers of its width (float8 as uint8), beside its
  dtype's name ("dtype:<name>"): what ``compare`` reads."""
  bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}
  np.savez(path, **{k: np.ascontiguousarray(v).view(bits[v.dtype.itemsize]) for k, v in outputs.items()},
           **{f"dtype:{k}": np.array(str(v.dtype)) for k, v in outputs.items()})


def _ordered(u, bits):
  """Sign-magnitude float bits to integers in the floats' order, so that a difference counts ulps."""
  u = u.astype(np.int64)
  sign = 1 << (bits - 1)
  return np.where(u & sign, -(u & (sign - 1)), u)


def dump(path):
  out, failed, runs = {}, {}, cases()
  for case, run in runs.items():
    try:
      out |= run()
    except Exception as e:  # pylint: disable=broad-except  (an older tree's package may lack an API: noted, not fatal)
      failed[case] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      print(f"{case}: not run: {failed[case]}")
  save(path, out)
  print(f"{len(out)} outputs of {len(runs) - len(failed)} of {len(runs)} cases, {sum(v.nbytes for v in out.values())} "
        f"bytes -> {path}")


def compare(path_a, path_b):
  """Prints each output's differing elements and their largest distance in ulps, and the outputs only one dump holds.
  Returns 0 when every output is in both and the same bits, 2 when one differs, 3 when none differs but one is
  missing from a dump."""
  a, b = np.load(path_a), np.load(path_b)
  names_a = [k for k in a.files if not k.startswith("dtype:")]
  names_b = {k for k in b.files if not k.startswith("dtype:")}
  worst = 0
  for k in names_a:
    if k not in names_b:
      continue
    x, y = a[k], b[k]
    if x.shape != y.shape:
      print(f"{k:40s} shapes differ: {x.shape} against {y.shape}")
      worst = 2
      continue
    differ = np.count_nonzero(x != y)
    ulps = np.abs(_ordered(x, 8 * x.itemsize) - _ordered(y, 8 * y.itemsize)) if differ else np.zeros(1)
    print(f"{k:40s} {str(a['dtype:' + k]):14s} {differ:9d} of {x.size:9d} elements differ, at most "
          f"{int(ulps.max())} ulp")
    worst = max(worst, 2 if differ else 0)
  only = [f"{k} (only in {path_a})" for k in names_a if k not in names_b]
  only += [f"{k} (only in {path_b})" for k in sorted(names_b - set(names_a))]
  for line in only:
    print(f"not compared: {line}")
  return worst if worst or not only else 3


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "dump":
    dump(sys.argv[2])
  elif len(sys.argv) == 4 and sys.argv[1] == "compare":
    sys.exit(compare(sys.argv[2], sys.argv[3]))
  else:
    sys.exit(__doc__)
