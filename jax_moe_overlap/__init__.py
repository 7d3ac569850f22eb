"""jax-moe-overlap: expert-parallel Mixture-of-Experts layers whose expert GEMMs overlap the return all-to-all.

Public API:
  MoE, MoEAux         Flax NNX module (router + SwiGLU experts) over an expert mesh axis, and its router statistics.
  moe_experts         the expert layer as a function on global arrays (impl="overlap" | "reference").
  CallConfig          timeouts and testing aids of the custom calls.
  Workspace           the peer buffers and flags of one mesh axis (created on demand, cached, freed at exit).
  workspace_bytes     bytes per rank of the workspace a layer call of a given shape allocates (for planning memory).
  release_workspaces  frees every workspace now (after the programs in flight); later calls allocate again.
"""

from jax_moe_overlap.api import moe_experts
from jax_moe_overlap.layer import MoE, MoEAux
from jax_moe_overlap.primitives import CallConfig
from jax_moe_overlap.workspace import Workspace, release_workspaces, workspace_bytes

__all__ = ["moe_experts", "CallConfig", "Workspace", "MoE", "MoEAux", "release_workspaces",
           "workspace_bytes"]
