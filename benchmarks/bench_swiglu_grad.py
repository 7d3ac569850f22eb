"""The backward pass's dh = d_out W2^T and the SwiGLU's gradient on one GPU: the fused call vs the two steps.

fused      grouped_matmul_swiglu_grad: the SwiGLU's gradient in the GEMM's epilogue (dh never written), where
           engines.swiglu_grad_fused says the GPU has it (the wgmma engine: Hopper, bf16, D and F multiples of 64)
unfused    grouped_matmul's float32 dh, then XLA's jax.vjp of swiglu rounded to bf16 (the layer's path elsewhere)
gemm       grouped_matmul alone with a bf16 output: the GEMM without any epilogue work, for scale

Each with the preactivation a in float32 and in bf16 (column a; the layer keeps it in its compute dtype,
expert_gemms.kept_preactivation_dtype). Before it is timed, the fused call is compared with the unfused one on the
first input set: column ulps = the largest difference in bf16 ulps, column bitwise = the share of elements with the
same bits. The default shape is the GPU training preset's layer at EP = 1 (cap = 131072 routed rows, D = F = 1024,
16 experts).

  python3 -m benchmarks.bench_swiglu_grad --out /tmp/swiglu_grad.jsonl [--a-dtypes bfloat16]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from jax_moe_overlap import engines
from jax_moe_overlap import expert_gemms
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu_grad


def shapes(quick: bool):
  """(name, rows, D, F, experts)."""
  out = [("train preset EP=1", 131072, 1024, 1024, 16)]
  if not quick:
    out.append(("deepseek-like EP=8", 65536, 7168, 2048, 32))
  return out


def methods():
  def fused(d_out, w2, gs, a):
    return grouped_matmul_swiglu_grad(d_out, w2, gs, a, transpose_rhs=True)

  def unfused(d_out, w2, gs, a):
    dh = grouped_matmul(d_out, w2, gs, transpose_rhs=True, preferred_element_type=jnp.float32)
    return expert_gemms.swiglu_grad(a, dh, d_out.dtype)

  def gemm(d_out, w2, gs, a):
    del a
    return grouped_matmul(d_out, w2, gs, transpose_rhs=True)

  return {"unfused": unfused, "fused": fused, "gemm": gemm}  # unfused first: the fused call's reference


def _compare(got, want):
  """(largest difference in bf16 ulps, share of bitwise-equal elements) of two bf16 arrays."""
  got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
  scale = np.maximum(np.abs(got), np.abs(want)).astype(np.float64)
  ulp = np.where(scale > 0, 2.0 ** (np.floor(np.log2(np.where(scale > 0, scale, 1.0))) - 7), 1.0)
  return float(np.max(np.abs(got.astype(np.float64) - want) / ulp)), float(np.mean(got.view(np.uint32) ==
                                                                                   want.view(np.uint32)))


def main():
  ap = common.shape_parser("swiglu_grad.jsonl", skews="balanced,stress")
  ap.add_argument("--a-dtypes", default="float32,bfloat16", help="the preactivation's dtypes, comma-separated")
  args = ap.parse_args()
  table = common.Table(["shape", "skew", "a", "method", "ms", "vs_unfused", "ulps", "bitwise"])
  for name, rows, D, F, E in shapes(args.quick):
    if not common.shape_selected(args, name):
      continue
    for skew, a_dtype in ((s, d) for s in args.skews.split(",") for d in args.a_dtypes.split(",")):
      gs = jnp.asarray(common.group_sizes(rows, E, skew))
      keys = jax.random.split(jax.random.PRNGKey(rows + D + F + E), 3)
      arg_sets = []
      for kk in keys:
        k1, k2, k3 = jax.random.split(kk, 3)
        arg_sets.append((jax.random.normal(k1, (rows, D), jnp.bfloat16),
                         (jax.random.normal(k2, (E, F, D), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16), gs,
                         (jax.random.normal(k3, (rows, 2 * F), jnp.float32) * 2.0).astype(a_dtype)))
      unfused_ms, reference = None, None
      for mname, fn in methods().items():
        if mname == "fused" and not engines.swiglu_grad_fused(True, D, F, True):
          table.add(shape=name, skew=skew, a=a_dtype, method=mname, ms="no engine has the epilogue here")
          continue
        ulps = bitwise = ""
        try:
          out = jax.jit(fn)(*arg_sets[0])
          if mname == "unfused":
            reference = out
          elif mname == "fused" and reference is not None:
            worst, same = _compare(out, reference)
            ulps, bitwise = f"{worst:.2f}", f"{same:.4f}"
          sec = common.time_fn(jax.jit(fn), arg_sets)
        except Exception as e:  # pylint: disable=broad-except
          table.add(shape=name, skew=skew, a=a_dtype, method=mname, ms=f"error: {type(e).__name__}: {e}"[:200])
          continue
        ms = sec * 1e3
        if mname == "unfused":
          unfused_ms = ms
        table.add(shape=name, skew=skew, a=a_dtype, method=mname, ms=f"{ms:.3f}",
                  vs_unfused=f"{unfused_ms / ms:.2f}" if unfused_ms else "", ulps=ulps, bitwise=bitwise)
  table.finish(args.out)


if __name__ == "__main__":
  main()
