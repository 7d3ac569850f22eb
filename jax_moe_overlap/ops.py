"""The custom calls one at a time, for code that composes them itself (the benchmarks, a model that builds its own
expert block). ``moe_experts`` and ``MoE`` are the layer; these are its parts.

Every call that moves rows between ranks runs inside ``jax.shard_map`` over the workspace's mesh axis and takes a
``RankInfo`` (the ``Workspace`` of that axis and a ``CallConfig``) and a ``plan.Plan`` (``plan.make_plan``):

  dispatch         token rows -> this rank's recv rows, grouped by (local expert, source rank).
  expert_combine   GEMM2 on the recv rows, each finished band pushed back to its source rank, weighted combine there.
  grouped_matmul   ``out[r] = lhs[r] @ rhs[g]`` per group of rows, on this device (no communication).
  grouped_outer    ``out[g] = lhs[rows of g].T @ rhs[rows of g]``: the weight gradient of ``grouped_matmul``.
  expert_mlp       GEMM1 + SwiGLU + GEMM2 on rows a rank already holds, differentiable (no communication).
  swiglu           ``silu(a[:, :F]) * a[:, F:]``, the activation between the two GEMMs.
  with_cuda        whether this build has the CUDA kernels (else the custom calls run on CPU devices only).
"""

from jax_moe_overlap._ffi import with_cuda
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.expert_gemms import expert_mlp, swiglu
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_outer
from jax_moe_overlap.plan import Plan
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.workspace_calls import dispatch, expert_combine

__all__ = ["dispatch", "expert_combine", "grouped_matmul", "grouped_outer", "expert_mlp", "swiglu", "CallConfig",
           "RankInfo", "Plan", "Workspace", "WorkspaceSizes", "with_cuda"]
