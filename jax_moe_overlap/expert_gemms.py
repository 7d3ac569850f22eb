"""The expert MLP on rows a rank already holds, with no communication: the SwiGLU, the platform's grouped GEMMs, GEMM1
with its SwiGLU, the backward GEMMs, and ``expert_mlp``, their differentiable composition.

``expert_block`` builds on these pieces around its custom calls; ``expert_mlp`` is the same GEMM sequence without
them (``impl="collective"``'s local experts, and the benchmarks' "compute alone", exported by ``ops``). On GPU the GEMMs are this library's grouped-GEMM custom
calls (``grouped_gemm.py``); on CPU XLA's ``ragged_dot``, faster there than the custom calls' reference loops
(which ``tests/test_grouped_gemm.py`` checks on their own). The order of the workspace calls does not depend on
this choice: ``ordering.py`` chains them on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import engines
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu, grouped_matmul_swiglu_grad
from jax_moe_overlap.grouped_gemm import grouped_outer


def swiglu(a: jax.Array) -> jax.Array:
  """[rows, 2F] -> [rows, F]: silu(a[:, :F]) * a[:, F:]."""
  gate, up = jnp.split(a, 2, axis=-1)
  return jax.nn.silu(gate) * up


# XLA's ragged_dot with float32 results, as the CPU branch of the grouped GEMMs below and the GEMMs of the FP8 recipe's
# impl="xla" (fp8_experts.RAGGED). JAX has no batching rule for it (vmap raises), so it runs one call per batch element
# under vmap, as the GPU branch's custom calls do (vmap_method="sequential"). A sequential_vmap function has no
# reverse-mode rule: these run only inside custom_vjp rules (expert_mlp, expert_block, fp8_expert_mlp), never
# differentiated themselves.
ragged_matmul_f32 = jax.custom_batching.sequential_vmap(
    lambda lhs, rhs, group_sizes: jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32))
_OUTER_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
ragged_outer_f32 = jax.custom_batching.sequential_vmap(
    lambda lhs, rhs, group_sizes: jax.lax.ragged_dot_general(lhs, rhs, group_sizes, _OUTER_DIMS,
                                                             preferred_element_type=jnp.float32))


def matmul(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=jnp.float32):
  """Grouped matmul of the expert GEMMs outside expert_combine: our custom call on GPU; XLA's ragged_dot on CPU."""
  def xla():
    rhs_ = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return ragged_matmul_f32(lhs, rhs_, group_sizes).astype(out_dtype)

  def ours():
    return grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)

  return jax.lax.platform_dependent(cpu=xla, default=ours)


def outer(lhs, rhs, group_sizes, out_dtype):
  """[rows, K], [rows, N] grouped by consecutive row blocks -> [G, K, N] per-group lhs^T @ rhs (as matmul: ours on
  GPU, XLA's ragged_dot_general on CPU)."""
  def xla():
    return ragged_outer_f32(lhs, rhs, group_sizes).astype(out_dtype)

  def ours():
    return grouped_outer(lhs, rhs, group_sizes, preferred_element_type=out_dtype)

  return jax.lax.platform_dependent(cpu=xla, default=ours)


# The dtype the layer keeps GEMM1's preactivation a in for its backward pass: the compute dtype (x's), GEMM1's float32
# accumulators rounded once, so that a bfloat16 layer holds its largest residual, [cap, 2F], in 2 bytes a value rather
# than 4 and the SwiGLU's backward reads half the bytes of it (docs/design.md, "The preactivation kept in the compute
# dtype"); h is computed from the float32 values either way. False: float32 (for A/B measurements).
PREACTIVATION_IN_COMPUTE_DTYPE = True


def kept_preactivation_dtype(compute_dtype):
  """The dtype of the preactivation a layer in ``compute_dtype`` keeps for its backward pass."""
  return jnp.dtype(compute_dtype) if PREACTIVATION_IN_COMPUTE_DTYPE else jnp.dtype(jnp.float32)


def gemm1_swiglu(x_recv, w1, group_sizes, keep_a: bool):
  """GEMM1 and its SwiGLU in float32: (h [cap, F] in x_recv's dtype, a [cap, 2F] GEMM1's output in
  ``kept_preactivation_dtype``, or None unless keep_a). On GPU one custom call, which on Hopper applies the SwiGLU in
  the GEMM's epilogue (no pass over a, and a is written only when kept); on CPU XLA's ragged_dot, then the SwiGLU."""
  a_dtype = kept_preactivation_dtype(x_recv.dtype)

  def xla():
    a = matmul(x_recv, w1, group_sizes)
    return (swiglu(a).astype(x_recv.dtype), a.astype(a_dtype)) if keep_a else swiglu(a).astype(x_recv.dtype)

  def ours():
    h, a = grouped_matmul_swiglu(x_recv, w1, group_sizes, keep_preactivation=keep_a, preactivation_dtype=a_dtype)
    return (h, a) if keep_a else h

  out = jax.lax.platform_dependent(cpu=xla, default=ours)
  return out if keep_a else (out, None)


def swiglu_grad(a, dh, out_dtype):
  """da [rows, 2F] in out_dtype: the input gradient of ``swiglu`` at a [rows, 2F] (float32, or the kept preactivation
  in the compute dtype, taken to float32) for dh [rows, F] (float32, or in ``dgrad_dtype``, taken to float32),
  computed in float32 (``jax.vjp``), rounded once."""
  _, swiglu_vjp = jax.vjp(swiglu, a.astype(jnp.float32))
  (da,) = swiglu_vjp(dh.astype(jnp.float32))
  return da.astype(out_dtype)


# The dtype of dh = d_out W2^T, the gradient at GEMM2's input, between the dgrad GEMM that writes it and the SwiGLU's
# backward that reads it, where they are two steps (the unfused path of gemm2_grad_swiglu_grad): the compute dtype
# (d_out's), the GEMM's float32 accumulators rounded once, so that a bfloat16 layer moves [cap, F] in 2 bytes a value
# rather than 4 each way; the SwiGLU's gradient is computed in float32 from it either way, and da is rounded to the
# compute dtype after it as before (docs/design.md, "The dgrad in the compute dtype"). False: float32 (for A/B
# measurements).
DGRAD_IN_COMPUTE_DTYPE = True


def dgrad_dtype(compute_dtype):
  """The dtype of the dh a layer in ``compute_dtype`` hands from its dgrad GEMM to the SwiGLU's backward."""
  return jnp.dtype(compute_dtype) if DGRAD_IN_COMPUTE_DTYPE else jnp.dtype(jnp.float32)


# Whether the layer's backward takes the SwiGLU-gradient epilogue (grouped_matmul_swiglu_grad) where an engine has
# it. Off while the fused call is slower than grouped_matmul then XLA's fusion (docs/performance.md, "SwiGLU gradient
# in the dgrad GEMM's epilogue"): its epilogue reads a while the tensor cores wait. The op stays public and tested.
LAYER_FUSES_SWIGLU_GRAD = False


def gemm2_grad_swiglu_grad(d_out, w2, group_sizes, a, out_dtype):
  """dh = d_out W2^T and the SwiGLU's gradient at a from it: da [cap, 2F] in out_dtype. On GPU, where the
  layer takes the fused epilogue (``LAYER_FUSES_SWIGLU_GRAD``) and an engine has it for the operands
  (``engines.swiglu_grad_fused``), one custom call that never writes dh
  (``grouped_matmul_swiglu_grad``); elsewhere on GPU ``grouped_matmul`` writes dh in ``dgrad_dtype`` and XLA computes
  the gradient; on CPU XLA's ragged_dot, rounded the same way, then the gradient."""
  F, D = w2.shape[1], w2.shape[2]
  fused = (LAYER_FUSES_SWIGLU_GRAD and jnp.dtype(out_dtype) == d_out.dtype and
           engines.swiglu_grad_fused(d_out.dtype == jnp.bfloat16 and w2.dtype == jnp.bfloat16, D, F, True))

  def unfused():
    dh = matmul(d_out, w2, group_sizes, transpose_rhs=True, out_dtype=dgrad_dtype(d_out.dtype))
    return swiglu_grad(a, dh, out_dtype)

  def ours():
    return grouped_matmul_swiglu_grad(d_out, w2, group_sizes, a, transpose_rhs=True)

  return jax.lax.platform_dependent(cpu=unfused, default=ours if fused else unfused)


def expert_grads(x_recv, a, h, d_out, w1, w2, group_sizes, dh=None):
  """The local backward GEMMs of GEMM1 + SwiGLU + GEMM2 on a rank's recv rows, all but the input gradient.

  x_recv [cap, D], a [cap, 2F] (GEMM1's output, in ``kept_preactivation_dtype``), h [cap, F] in x_recv's dtype (its
  SwiGLU, GEMM2's input, as the forward pass wrote it), d_out [cap, D] (GEMM2's output gradient), w1 [E_local, D,
  2F], w2 [E_local, F, D], group_sizes [E_local] -> (da [cap, 2F] in x_recv's dtype, dw1, dw2 in the weights'
  dtypes). dh [cap, F] = d_out W2^T (in ``dgrad_dtype``) when the caller has it (dispatch_gemm), else computed here,
  with the SwiGLU's gradient in the GEMM's epilogue where the engine has it (``gemm2_grad_swiglu_grad``).

  h is the forward's, kept, not recomputed from a: a recomputation is one more pass over a (the largest residual,
  [cap, 2F]) and a write of h, for a value the forward had already written (and, from a kept in bfloat16, not the
  forward's h).
  """
  if dh is None:
    da = gemm2_grad_swiglu_grad(d_out, w2, group_sizes, a, x_recv.dtype)
  else:
    da = swiglu_grad(a, dh, x_recv.dtype)
  dw2 = outer(h.astype(w2.dtype), d_out, group_sizes, w2.dtype)
  dw1 = outer(x_recv, da, group_sizes, w1.dtype)
  return da, dw1, dw2


@jax.custom_vjp
def expert_mlp(x_recv, w1, w2, group_sizes):
  """One rank's expert work on rows it already holds, with no communication: expert_block minus its custom calls.

  GEMM1 + SwiGLU + GEMM2 through the grouped GEMMs of expert_block (GEMM2 as ``grouped_matmul``, the tile engine of
  expert_combine's producer, on every SM), and under ``jax.grad`` expert_block's backward GEMMs, the input gradient
  ``da @ W1^T`` as ``grouped_matmul``. The local experts of ``impl="collective"`` (``xla_path.py``) and the
  benchmarks' "compute alone" (benchmarks/ideal_probes.py).

  Args:
    x_recv: [cap, D] rows grouped by local expert (float32 or bfloat16). w1: [E_local, D, 2F]; w2: [E_local, F, D].
    group_sizes: [E_local] int32 rows per local expert (their sum <= cap).
  Returns:
    [cap, D] in x_recv's dtype; rows past the last group are zero.
  """
  h, _ = gemm1_swiglu(x_recv, w1, group_sizes, keep_a=False)
  return matmul(h, w2, group_sizes, out_dtype=x_recv.dtype)


def _expert_mlp_fwd(x_recv, w1, w2, group_sizes):
  h, a = gemm1_swiglu(x_recv, w1, group_sizes, keep_a=True)
  out = matmul(h, w2, group_sizes, out_dtype=x_recv.dtype)
  return out, (x_recv, a, h, w1, w2, group_sizes)


def _expert_mlp_bwd(res, d_out):
  x_recv, a, h, w1, w2, group_sizes = res
  da, dw1, dw2 = expert_grads(x_recv, a, h, d_out, w1, w2, group_sizes)
  dx = matmul(da, w1, group_sizes, transpose_rhs=True, out_dtype=x_recv.dtype)
  return dx, dw1, dw2, np.zeros(group_sizes.shape, jax.dtypes.float0)


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
