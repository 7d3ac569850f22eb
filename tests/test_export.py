"""jax.export of a program holding the layer (README, "JAX and Flax NNX transformations"): refused by default for
impl="overlap"'s custom calls, exported once they are listed in disabled_checks, and the Exported's call gives the
jitted program's result; impl="xla" exports as any JAX program."""

import re

import jax
import numpy as np
import pytest
from jax import export

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of

E, D, F = 8, 16, 24


def test_export_of_the_overlap_layer_needs_its_custom_calls_listed_and_then_runs():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(32, D, F, E, 2, "skewed", 2)
  # An exported program for 4 devices is called with arguments on those 4 devices (jax.export's rule).
  x, w1, w2 = (jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())) for a in (x, w1, w2))
  f = jax.jit(lambda x, w1, w2: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)[0])
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
    export.export(f)(x, w1, w2)
  names = sorted(set(re.findall(r"@(jmo_\w+)", f.lower(x, w1, w2).as_text())))
  assert {"jmo_dispatch", "jmo_expert_combine"} <= set(names), names
  exp = export.export(f, disabled_checks=[export.DisabledSafetyCheck.custom_call(n) for n in names])(x, w1, w2)
  np.testing.assert_array_equal(exp.call(x, w1, w2), f(x, w1, w2))
  g = jax.jit(lambda x, w1, w2: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="xla")[0])
  np.testing.assert_allclose(export.export(g)(x, w1, w2).call(x, w1, w2), f(x, w1, w2), rtol=1e-5, atol=1e-5)
