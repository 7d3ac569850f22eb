"""GEMM2 + GatherRS (``CallConfig(tensor_reduce="gather_rs")``): the tensor-parallel overlap layer summing its
shards' partials by a top-k gather-reduce on each rank and one reduce-scatter over the expert x tensor group, on the
CPU handlers, against the float32 oracle on an (expert=2, tensor=2) mesh of the 4 CPU devices (skew, empty
experts, skipped slots, drops; Auto and Explicit axes; bfloat16 into poisoned outputs); bitwise repeatable; equal
to its serialized form; the choice rule; the refusals. The 8-device meshes run in tensor_parallel_main.py. The
default CallConfig picks GatherRS for float32 layers of these shapes (call_site.tensor_reduce), so
test_tensor_parallel's float32 overlap cases run it in the default pass; the cases here pin it, and are slow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo
from cases import layer_inputs
from jax_moe_overlap import call_site
from tensor_parallel_checks import (D, E, F, K, check_bfloat16, check_matches_oracle, check_repeatable,
                                    mesh_of_shape)

EXPERT_TENSOR = {"expert": 2, "tensor": 2}
GATHER_RS = jmo.CallConfig(tensor_reduce="gather_rs")
PER_SLOT = jmo.CallConfig(tensor_reduce="per_slot")


def _lowered(config):
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "skewed", 3)
  fn = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, tensor_axis="tensor", config=config)[0])
  return fn.lower(x, ids, gates, w1, w2).as_text()


@pytest.mark.slow  # the default pass runs GatherRS through test_tensor_parallel's float32 cases (the default choice)
def test_skew_skipped_slots_and_drops_match_the_oracle():
  [dropped] = check_matches_oracle(EXPERT_TENSOR, "overlap", kinds=("skipped",), cf=0.5, seed=4, config=GATHER_RS)
  assert dropped > 0


@pytest.mark.slow
def test_empty_experts_and_dropless_match_the_oracle():
  assert check_matches_oracle(EXPERT_TENSOR, "overlap", config=GATHER_RS) == [0, 0, 0]


@pytest.mark.slow
def test_explicit_axes():
  check_matches_oracle(EXPERT_TENSOR, "overlap", kinds=("skipped",), explicit=True, view=False, seed=6,
                       config=GATHER_RS)


@pytest.mark.slow
def test_bfloat16_into_poisoned_outputs():
  # Partials cross in float32; every output element written.
  check_bfloat16(EXPERT_TENSOR, cf=0.5, config=GATHER_RS)


@pytest.mark.slow
def test_repeated_calls_are_bitwise_identical():
  check_repeatable(EXPERT_TENSOR, "overlap", calls=3, config=GATHER_RS)


@pytest.mark.slow
def test_serialized_equals_overlapped_bitwise():
  # serialize: the consumer starts once GEMM2 is done (the baseline); the sums run in the same fixed order.
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "skewed", 5)

  def run(config):
    loss = lambda x, g, w1, w2: jnp.sum(jnp.sin(jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, tensor_axis="tensor",
                                                                capacity_factor=0.5, config=config)[0]))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)

  a = run(GATHER_RS)
  b = run(jmo.CallConfig(tensor_reduce="gather_rs", serialize=True))
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_the_call_config_picks_the_operator():
  assert "jmo_gather_rs" in _lowered(GATHER_RS)
  per_slot = _lowered(PER_SLOT)
  assert "jmo_gather_rs" not in per_slot and "jmo_expert_combine" in per_slot


def test_the_choice_rule():
  rule = call_site.tensor_reduce
  auto = jmo.CallConfig()
  assert rule(auto, "cpu", 2, 1, 2, 4, 128) == "per_slot"            # no tensor axis
  assert rule(GATHER_RS, "cpu", 2, 1, 2, 4, 128) == "per_slot"
  # auto: GatherRS where 4 G <= k TP itemsize (its float32 partials move no more bytes than the per-slot rows)
  assert rule(auto, "cpu", 2, 2, 2, 4, 128) == "gather_rs"           # 16 <= 16
  assert rule(auto, "cpu", 2, 2, 2, 2, 128) == "per_slot"            # bfloat16: 16 > 8
  assert rule(auto, "gpu", 2, 2, 2, 4, 128) == "per_slot"            # no CUDA kernel yet
  assert rule(auto, "cpu", 2, 2, 2, 4, 2**24) == "per_slot"          # slot indices beyond float32's exact range
  assert rule(PER_SLOT, "cpu", 2, 2, 2, 4, 128) == "per_slot"
  assert rule(GATHER_RS, "cpu", 2, 2, 2, 2, 128) == "gather_rs"
  with pytest.raises(ValueError, match="no gpu kernel yet"):
    rule(GATHER_RS, "gpu", 2, 2, 2, 4, 128)
  with pytest.raises(ValueError, match="fewer than 2\\^24 slots"):
    rule(GATHER_RS, "cpu", 2, 2, 2, 4, 2**24)
  with pytest.raises(ValueError, match="tensor_reduce must be one of"):
    jmo.CallConfig(tensor_reduce="dense")


@pytest.mark.slow
def test_per_slot_pinned_still_matches_the_oracle():
  # The other reduction, which the default no longer picks for these float32 shapes.
  [dropped] = check_matches_oracle(EXPERT_TENSOR, "overlap", kinds=("skipped",), cf=0.5, seed=8, config=PER_SLOT)
  assert dropped > 0
