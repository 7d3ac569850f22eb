"""jax-moe-overlap: expert-parallel Mixture-of-Experts layers whose expert GEMMs overlap the return all-to-all.

Public API:
  MoEConfig           the static description of an MoE block (MaxText's option names).
  MoE, MoEAux         Flax NNX module (router + SwiGLU experts + shared experts) over an expert mesh axis (and
                      optionally a tensor axis), and its router statistics; MoEBlock: the same as a drop-in
                      feed-forward block returning y alone.
  route, update_routing_bias  the routers (softmax / sigmoid, routing bias, group-limited) as functions.
  moe_experts         the expert layer as a function on global arrays (impl="overlap" | "collective" | "xla" |
                      "reference"; batch_axes; tensor_axis: expert tensor parallelism; quantization=None | "fp8" |
                      "fp8_bf16_wgrad").
  quantize_weights, Fp8Weight  expert weights quantized once (FP8, 128 x 128 blocks) for moe_experts' inference.
  CallConfig          timeouts and testing aids of the custom calls.
  Workspace           the peer buffers and flags of one mesh axis (created on demand, cached, freed at exit).
  workspace_bytes     bytes per rank of the workspace a layer call of a given shape allocates (for planning memory).
  release_workspaces  frees every workspace now (after the programs in flight); later calls allocate again.
  recorded_failures   the failures recorded in the live workspaces: what a call inside a CUDA graph that stopped the
                      device (XLA raising a CUDA error) had found.
  build_info          what the installed extension was compiled with (CUDA kernels or not, CUDA version, GPU targets).
"""

from jax_moe_overlap._ffi import build_info
from jax_moe_overlap.api import moe_experts
from jax_moe_overlap.config import CallConfig, MoEConfig
from jax_moe_overlap.fp8 import Fp8Weight, quantize_weights
from jax_moe_overlap.layer import MoE, MoEAux, MoEBlock, total_aux_loss
from jax_moe_overlap.routing import Routing, route, update_routing_bias
from jax_moe_overlap.workspace import Workspace, recorded_failures, release_workspaces, workspace_bytes

__all__ = ["build_info", "moe_experts", "CallConfig", "Fp8Weight", "Workspace", "MoE", "MoEAux", "MoEBlock", "MoEConfig",
           "Routing", "quantize_weights", "recorded_failures", "route", "release_workspaces", "total_aux_loss",
           "update_routing_bias",
           "workspace_bytes"]
