"""Tokens sharded over a data axis and the expert axis on 4 CPU devices (2 x 2); 8 devices in a child process."""

import jax
import numpy as np
import pytest

import jax_moe_overlap as jmo
from batch_axes_checks import check_matches_reference, mesh_of_shape
from cases import layer_inputs, moe_config
from child_process import run_script


@pytest.mark.parametrize("cf", [None, 0.5])
def test_data_by_expert_mesh_matches_reference(cf):
  dropped = check_matches_reference({"data": 2, "expert": 2}, ("data",), cf=cf, seed=3)
  assert (dropped > 0) == (cf is not None)


def test_expert_axis_first_in_the_mesh():
  check_matches_reference({"expert": 2, "data": 2}, ("data",), kind="balanced", seed=4)


def test_bad_batch_axes_are_named():
  mesh = mesh_of_shape({"data": 2, "expert": 2})
  x, ids, gates, w1, w2 = layer_inputs(64, 16, 24, 8, 2, "balanced", 0)
  with pytest.raises(ValueError, match="batch_axes"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, batch_axes=("expert",))
  with pytest.raises(ValueError, match="batch_axes"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, batch_axes=("model",))
  with pytest.raises(ValueError, match="cannot be split evenly over the 4 devices"):
    jmo.moe_experts(x[:62], ids[:62], gates[:62], w1, w2, mesh=mesh, batch_axes=("data",))


@pytest.mark.slow  # a child process with 8 devices, compiling every program again; the 2 x 2 mesh above stays
def test_eight_devices_data_fsdp_expert():
  out = run_script("batch_axes_main.py")
  assert out.count(": match") == 3, out


def test_module_with_batch_axes_matches_reference():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  mesh = mesh_of_shape({"data": 2, "expert": 2})
  x = jax.random.normal(jax.random.PRNGKey(2), (4, 16, 16))
  cfg = moe_config(emb_dim=16, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=2)
  m = jmo.MoE(cfg, mesh=mesh, batch_axes=("data",), rngs=nnx.Rngs(0))
  y, aux = nnx.jit(lambda m, x: m(x))(m, x)
  m.impl = "reference"
  y_ref, aux_ref = nnx.jit(lambda m, x: m(x))(m, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert float(aux.dropped_fraction) == float(aux_ref.dropped_fraction) == 0.0
