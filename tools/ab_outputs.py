"""The SwiGLU kernels' outputs on fixed inputs, to compare two trees' bits on one GPU (benchmarks/run_ab.sh's AB_BITS
step): `dump` runs each kernel against whichever jax_moe_overlap is imported and saves every output's bytes;
`compare` prints, per output, how many elements differ between two dumps and by how many units in the last place.

  PYTHONPATH=/tmp/jmo-site-base python3 tools/ab_outputs.py dump /tmp/base.npz
  PYTHONPATH=/tmp/jmo-site-new python3 tools/ab_outputs.py dump /tmp/new.npz
  python3 tools/ab_outputs.py compare /tmp/base.npz /tmp/new.npz

The inputs span the SwiGLU's whole range: rows scaled by powers of two from 2^-24 to 2^24 (gates whose exp
overflows or underflows, products that saturate e4m3), and for the element-wise kernels NaN, +-inf, -0 and
subnormals. Only the public API of jax_moe_overlap.grouped_gemm is used, so an older tree's package runs it too.
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


def outputs():
  import jax
  import jax.numpy as jnp
  from jax_moe_overlap import fp8
  from jax_moe_overlap import grouped_gemm as gg

  rng = np.random.default_rng(0)
  out = {}
  G, rows, K, F = 8, 2048, 1024, 512
  sizes = jnp.asarray(rng.multinomial(rows - 37, rng.dirichlet(np.ones(G) * 2)), jnp.int32)  # rows past the groups
  x = _row_scaled(rng, rows, K)
  w = rng.standard_normal((G, K, 2 * F), dtype=np.float32) / np.sqrt(K)

  xq, xs = jax.jit(fp8.quantize_rows)(jnp.asarray(x))
  wq = jax.jit(fp8.quantize_weight)(jnp.asarray(w))
  for name, keep_a in (("fp8 fused", True), ("fp8 fused, no a", False)):
    got = jax.jit(lambda *a, keep_a=keep_a: gg.grouped_matmul_swiglu_fp8(*a, keep_a=keep_a))(
        xq, xs, wq.values, wq.scales, sizes)
    for i, v in enumerate(jax.tree.leaves(got)):
      out[f"{name} [{i}]"] = np.asarray(v)

  a = _with_specials(_row_scaled(rng, rows, 2 * F))
  for i, v in enumerate(jax.tree.leaves(jax.jit(gg.swiglu_forward_fp8)(jnp.asarray(a)))):
    out[f"swiglu_forward_fp8 [{i}]"] = np.asarray(v)

  aq, a_s = jax.jit(fp8.quantize_rows)(jnp.asarray(_row_scaled(rng, rows, 2 * F)))
  dh = jnp.asarray(_with_specials(_row_scaled(rng, rows, F)))
  tiles = fp8.column_tiles(rows, sizes)
  for i, v in enumerate(jax.tree.leaves(jax.jit(lambda *o: gg.swiglu_backward_fp8(*o, tiles))(aq, a_s, dh))):
    out[f"swiglu_backward_fp8 [{i}]"] = np.asarray(v)

  # K a multiple of 64: the fused kernel (the SwiGLU on the accumulators); K = 1000: the grouped GEMM writes a and
  # the element-wise kernel reads it (engines.swiglu_fused).
  for k in (K, 1000):
    xb, wb = jnp.asarray(x[:, :k], jnp.bfloat16), jnp.asarray(w[:, :k], jnp.bfloat16)
    for keep in (False, True):
      got = jax.jit(lambda *o, keep=keep: gg.grouped_matmul_swiglu(*o, keep_preactivation=keep))(xb, wb, sizes)
      for i, v in enumerate(jax.tree.leaves(got)):
        out[f"bf16 swiglu K={k} keep_a={keep} [{i}]"] = np.asarray(v)
  return out


def _as_uints(v):
  """The bytes of an array as unsigned integers of its width (float8 as uint8), and whether it is a float type."""
  width = v.dtype.itemsize
  return np.ascontiguousarray(v).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]), v.dtype.kind in "fV"


def _ordered(u, bits):
  """Sign-magnitude float bits to integers in the floats' order, so that a difference counts ulps."""
  u = u.astype(np.int64)
  sign = 1 << (bits - 1)
  return np.where(u & sign, -(u & (sign - 1)), u)


def dump(path):
  out = outputs()
  np.savez(path, **{k: _as_uints(v)[0] for k, v in out.items()},
           **{f"dtype:{k}": np.array(str(v.dtype)) for k, v in out.items()})
  print(f"{len(out)} outputs, {sum(v.nbytes for v in out.values())} bytes -> {path}")


def compare(path_a, path_b):
  a, b = np.load(path_a), np.load(path_b)
  names = [k for k in a.files if not k.startswith("dtype:")]
  if sorted(names) != sorted(k for k in b.files if not k.startswith("dtype:")):
    print(f"the dumps hold different outputs: {sorted(names)} against {sorted(b.files)}")
    return 1
  worst = 0
  for k in names:
    x, y = a[k], b[k]
    if x.shape != y.shape:
      print(f"{k:36s} shapes differ: {x.shape} against {y.shape}")
      worst = max(worst, 1)
      continue
    differ = np.count_nonzero(x != y)
    ulps = np.abs(_ordered(x, 8 * x.itemsize) - _ordered(y, 8 * y.itemsize)) if differ else np.zeros(1)
    print(f"{k:36s} {str(a['dtype:' + k]):14s} {differ:9d} of {x.size:9d} elements differ, at most "
          f"{int(ulps.max())} ulp")
    worst = max(worst, differ)
  return 0 if worst == 0 else 2


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "dump":
    dump(sys.argv[2])
  elif len(sys.argv) == 4 and sys.argv[1] == "compare":
    sys.exit(compare(sys.argv[2], sys.argv[3]))
  else:
    sys.exit(__doc__)
