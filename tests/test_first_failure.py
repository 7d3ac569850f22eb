"""The first failure's cause reaches every rank: a bad expert id in one rank's tokens, found inside a jitted call,
fails the other ranks of the group too (they give up at once instead of waiting out the timeout), and each rank's
error names the failing rank, the id and its token; the next call runs normally."""

import re

import jax
import numpy as np
import pytest

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of

E, D, F, T, K = 8, 16, 24, 32, 2


@pytest.mark.parametrize("bad_id", [11, -3])
def test_bad_expert_id_on_rank_1_is_named_by_every_rank(bad_id):
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 1)
  mesh = mesh_of(4)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=jmo.CallConfig(timeout_ms=5000)))
  jax.block_until_ready(f(x, ids, gates, w1, w2))
  # Tokens are split over the 4 ranks: global token 9 is rank 1's token 1; its slot 1 is slot 3 of that rank.
  with pytest.raises(jax.errors.JaxRuntimeError) as err:
    jax.block_until_ready(f(x, ids.at[9, 1].set(bad_id), gates, w1, w2))
  msg = str(err.value)
  cause = (rf"rank 1 \(group 0\) found an invalid input in epoch \d+: its token 1 \(slot 3\) names expert id "
           rf"{bad_id}, which is neither -1 \(no selection\) nor in \[0, num_experts\)")
  assert re.search(cause, msg), msg
  if "gave up" in msg:  # another rank's error (jax raises one of the four): it quotes rank 1's as the first failure
    assert re.search(r"rank [023] \(group 0\) gave up in epoch \d+ because another rank of its group failed first; "
                     r"first failure: " + cause, msg), msg
  y, _ = f(x, ids, gates, w1, w2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
