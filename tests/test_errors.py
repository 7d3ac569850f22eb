"""Bad inputs raise clear errors before anything runs; a peer that never arrives raises within the timeout, and
the library works again on the next call."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of, moe_config

E, D, F = 8, 16, 24


@pytest.fixture
def inputs():
  return layer_inputs(32, D, F, E, 2, "skewed", 1)


def test_experts_not_divisible_by_axis(inputs):
  x, ids, gates, w1, w2 = inputs
  mesh = mesh_of(4)
  with pytest.raises(ValueError, match=r"6 experts cannot be split evenly over the 4 devices"):
    jmo.moe_experts(x, ids % 6, gates, w1[:6], w2[:6], mesh=mesh)


def test_tokens_not_divisible_by_axis(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(ValueError, match=r"30 tokens cannot be split evenly"):
    jmo.moe_experts(x[:30], ids[:30], gates[:30], w1, w2, mesh=mesh_of(4))


@pytest.mark.parametrize("impl", ["overlap", "collective", "xla", "reference"])
def test_no_tokens(inputs, impl):
  """Zero tokens: a ValueError naming it, not a crash in the custom calls nor a ZeroDivisionError inside JAX."""
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(ValueError, match=r"x has no tokens; the layer needs at least one token on each of the 4 devices"):
    jmo.moe_experts(x[:0], ids[:0], gates[:0], w1, w2, mesh=mesh_of(4), impl=impl)


def test_top_k_larger_than_experts(inputs):
  x, _, _, w1, w2 = inputs
  ids = jnp.zeros((32, 9), jnp.int32)
  with pytest.raises(ValueError, match=r"top-k must be in \[1, num_experts=8\], got 9"):
    jmo.moe_experts(x, ids, jnp.ones((32, 9)), w1, w2, mesh=mesh_of(2))


def test_unsupported_dtype(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(TypeError, match=r"x has dtype float16; supported: float32, bfloat16"):
    jmo.moe_experts(x.astype(jnp.float16), ids, gates, w1.astype(jnp.float16), w2.astype(jnp.float16),
                    mesh=mesh_of(2))


def test_mixed_dtypes(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(TypeError, match=r"must share a dtype"):
    jmo.moe_experts(x, ids, gates, w1.astype(jnp.bfloat16), w2, mesh=mesh_of(2))


def test_wrong_shapes(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(ValueError, match=r"weight shapes"):
    jmo.moe_experts(x, ids, gates, w1[:, :8], w2, mesh=mesh_of(2))
  with pytest.raises(ValueError, match=r"must both be \[tokens=32, k\]"):
    jmo.moe_experts(x, ids[:16], gates, w1, w2, mesh=mesh_of(2))
  with pytest.raises(ValueError, match=r"x must be \[tokens, d_model\]"):
    jmo.moe_experts(x[None], ids, gates, w1, w2, mesh=mesh_of(2))


def test_mesh_without_the_axis(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(ValueError, match=r"no axis named 'expert'"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(2, axis="data"))


def test_bad_impl(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(ValueError, match=r"impl must be one of 'overlap', 'collective', 'xla', 'reference'"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(2), impl="fast")


def test_arguments_of_the_wrong_kind(inputs):
  """Gates that are not real floats, a capacity factor that is no finite number, a config that is no CallConfig, a
  mesh that is no Mesh: refused by name before anything runs (not cast, not an AttributeError)."""
  x, ids, gates, w1, w2 = inputs
  call = functools.partial(jmo.moe_experts, mesh=mesh_of(2), impl="xla")
  for bad in (gates.astype(jnp.int32), gates.astype(jnp.complex64)):
    with pytest.raises(TypeError, match=r"gates must be real floating point, got"):
      call(x, ids, bad, w1, w2)
  for cf in (float("nan"), "1.25"):
    with pytest.raises(TypeError, match=r"capacity_factor must be None \(dropless\) or a finite number"):
      call(x, ids, gates, w1, w2, capacity_factor=cf)
  with pytest.raises(TypeError, match=r"config must be a CallConfig, got 'fast'"):
    call(x, ids, gates, w1, w2, config="fast")
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh="expert")
  cfg = jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=2)
  with pytest.raises(ValueError, match=r"router logits must be floating \[tokens, num_experts=8\], got float32\[4, 6\]"):
    jmo.route(jnp.ones((4, 6)), cfg)
  with pytest.raises(TypeError, match=r"token_mask must be bool"):
    jmo.route(jnp.ones((4, E)), cfg, token_mask=jnp.ones((4,)))
  with pytest.raises(TypeError, match=r"MoEConfig.capacity_factor must be None \(dropless\) or a finite number"):
    jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=2, capacity_factor="1")


def test_expert_ids_out_of_range_eager(inputs):
  x, ids, gates, w1, w2 = inputs
  with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\), got values in \[0, 11\]"):
    jmo.moe_experts(x, ids.at[3, 1].set(11), gates, w1, w2, mesh=mesh_of(2))


@pytest.mark.parametrize("impl", ["collective", "xla", "reference"])
def test_expert_ids_out_of_range_under_jit_are_skipped_slots_without_the_custom_calls(inputs, impl):
  """The impls that route in XLA give a traced id outside [0, E) no output and no capacity, as a skipped slot (the
  plan alone would count it as expert 0's: "xla" and "collective" computed it there)."""
  x, ids, gates, w1, w2 = inputs
  f = jax.jit(lambda ids: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl=impl, capacity_factor=1.0))
  bad = ids.at[5, 0].set(-3).at[9, 1].set(8).at[20, 0].set(100)
  skipped = ids.at[5, 0].set(-1).at[9, 1].set(-1).at[20, 0].set(-1)
  y, dropped = f(bad)
  y_skip, dropped_skip = f(skipped)
  np.testing.assert_array_equal(y, y_skip)
  assert int(dropped) == int(dropped_skip)


# collective and the reference in the default pass (each compiles three programs: int32, uint32 and int64 ids); xla in
# the slow pass (its narrow out-of-range ids run by default in the test above).
@pytest.mark.parametrize("impl", ["collective", pytest.param("xla", marks=pytest.mark.slow), "reference"])
def test_wide_expert_ids_out_of_range_under_jit_do_not_wrap_into_range(inputs, impl):
  """uint32 ids (int64 under x64 likewise) past int32's range are invalid ids, not wrapped by the cast to int32:
  2**32 - 1 wrapped to -1 (a skipped slot) and 2**32 + 3 (in uint64) to expert 3, computed there."""
  x, ids, gates, w1, w2 = inputs
  f = jax.jit(lambda ids: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl=impl))
  y_skip, _ = f(ids.at[5, 0].set(-1))
  wide = ids.astype(jnp.uint32).at[5, 0].set(2**32 - 1)
  y, _ = f(wide)
  np.testing.assert_array_equal(y, y_skip)
  with jax.enable_x64(True):
    g = jax.jit(lambda ids: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl=impl))
    big = np.array(ids, np.int64)
    big[5, 0] = 2**32 + 3
    y64, _ = g(big)
  np.testing.assert_array_equal(y64, y_skip)


def test_wide_expert_id_out_of_range_under_jit_is_the_custom_calls_error(inputs):
  x, ids, gates, w1, w2 = inputs
  f = jax.jit(lambda ids: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl="overlap"))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"token 5 \(slot 10\) names expert id 2147483647"):
    jax.block_until_ready(f(ids.astype(jnp.uint32).at[5, 0].set(2**32 - 1)))


def test_expert_ids_out_of_range_under_jit_then_recovery(inputs):
  x, ids, gates, w1, w2 = inputs
  mesh = mesh_of(4)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=jmo.CallConfig(timeout_ms=5000)))
  jax.block_until_ready(f(x, ids, gates, w1, w2))  # compiled and warm: time only the failing call
  t0 = time.monotonic()
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"token 5 \(slot 10\) names expert id -3, which is neither -1"):
    jax.block_until_ready(f(x, ids.at[5, 0].set(-3), gates, w1, w2))
  assert time.monotonic() - t0 < 5.0, "peers must give up at once, not wait out the timeout"
  y, _ = f(x, ids, gates, w1, w2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("late_rank", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_peer_that_never_arrives_times_out_then_recovers(inputs, late_rank):
  x, ids, gates, w1, w2 = inputs
  mesh = mesh_of(4)
  timeout_ms = 300
  # The late rank sleeps 3 s: its peers must report a timeout after ~0.3 s rather than wait.
  late = jmo.CallConfig(timeout_ms=timeout_ms, first_call_timeout_ms=0, delay_rank=late_rank, delay_us=3_000_000)
  f_late = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=late))
  f_late.lower(x, ids, gates, w1, w2).compile()
  with pytest.raises(jax.errors.JaxRuntimeError) as err:
    jax.block_until_ready(f_late(x, ids, gates, w1, w2))
  msg = str(err.value)
  assert "DEADLINE_EXCEEDED" in msg and f"timed out after {timeout_ms} ms" in msg, msg
  assert "stage" in msg and "rank" in msg and "observed" in msg and "expected" in msg, msg
  assert f"peer {late_rank}" in msg, msg
  # The next call (same workspace, no user action) is correct.
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh))
  y, _ = f(x, ids, gates, w1, w2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for _ in range(3):
    np.testing.assert_array_equal(f(x, ids, gates, w1, w2)[0], y)


def test_a_groups_first_call_waits_for_a_late_rank_up_to_its_own_bound(inputs):
  """A group's ranks begin their first call on a workspace as far apart as their processes' compilations end: its
  waits are bounded by first_call_timeout_ms, every later call's by timeout_ms; with first_call_timeout_ms = 0 the
  first call too fails within timeout_ms."""
  x, ids, gates, w1, w2 = inputs
  mesh = mesh_of(4)
  timeout_ms = 300
  for first_ms, failing_epoch in ((20_000, 2), (0, 1)):
    # A new workspace: the next call is the group's first (epoch 1). Releasing the one whose program just failed says
    # so in a warning.
    if failing_epoch == 1:
      with pytest.warns(RuntimeWarning, match=r"releasing Workspace\(.*\) after a program that failed"):
        jmo.release_workspaces()
    else:
      jmo.release_workspaces()
    late = jmo.CallConfig(timeout_ms=timeout_ms, first_call_timeout_ms=first_ms, delay_rank=2, delay_us=1_000_000)
    f_late = jax.jit(lambda *a, late=late: jmo.moe_experts(*a, mesh=mesh, config=late))
    f_late.lower(x, ids, gates, w1, w2).compile()
    with pytest.raises(jax.errors.JaxRuntimeError) as err:
      jax.block_until_ready(f_late(x, ids, gates, w1, w2))
    msg = str(err.value)
    # With the first call's bound, rank 2's 1 s in epoch 1 was waited for; epoch 2 (the next workspace call of the
    # same step) times out. (The rank whose clock runs out first may be waiting for a peer that waits for rank 2.)
    assert f"timed out after {timeout_ms} ms in epoch {failing_epoch} " in msg, msg
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh))
  y, _ = f(x, ids, gates, w1, w2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_module_rejects_bad_configuration():
  from flax import nnx
  mesh = mesh_of(4)
  cfg = functools.partial(jmo.MoEConfig, emb_dim=16, moe_mlp_dim=32, num_experts=8, num_experts_per_tok=2)
  with pytest.raises(ValueError, match=r"6 experts cannot be split evenly over the 4 devices"):
    jmo.MoE(cfg(num_experts=6), mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"top-k must be in \[1, num_experts=8\]"):
    jmo.MoE(cfg(num_experts_per_tok=9), mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"no axis named 'experts'"):
    jmo.MoE(cfg(), mesh=mesh, expert_axis="experts", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"dtype has dtype float16; supported: float32, bfloat16"):
    jmo.MoE(cfg(dtype=jnp.float16), mesh=mesh, rngs=nnx.Rngs(0))
  for bad in (jnp.int8, jnp.bool_):
    with pytest.raises(TypeError, match=r"MoEConfig.weight_dtype is the dtype of the parameters"):
      cfg(weight_dtype=bad)
  with pytest.raises(TypeError, match=r"MoE takes a MoEConfig as its first argument, got 16"):
    jmo.MoE(16, mesh=mesh, rngs=nnx.Rngs(0))
  for bad in (0, 16.0, "16", True):
    with pytest.raises(ValueError, match=r"MoEConfig.emb_dim must be a positive int"):
      cfg(emb_dim=bad)
  numpy_sizes = cfg(emb_dim=np.int64(16), num_experts=np.int32(8))  # (as read from a checkpoint's metadata)
  assert numpy_sizes == cfg() and type(numpy_sizes.emb_dim) is int and hash(numpy_sizes) == hash(cfg())
  m = jmo.MoE(cfg(), mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"expects inputs \[..., 16\]"):
    m(jnp.ones((4, 8, 12)))
  with pytest.raises(TypeError, match=r"MoE takes floating-point inputs, got int32"):
    m(jnp.ones((4, 16), jnp.int32))
  with pytest.raises(TypeError, match=r"token_mask must be bool"):
    m(jnp.ones((4, 16)), token_mask=jnp.ones((4,)))
  with pytest.raises(ValueError, match=r"x has no tokens"):
    m(jnp.ones((2, 0, 16)))


def test_call_config_refuses_bad_timeouts_and_delays():
  """A wait bound that is no positive int (0 failed every wait at once; -1 wrapped and failed likewise, reporting a
  bound of 2^64 - 1 ms; 1.5 and "5" were cast) and a hold-back that is no non-negative int: refused by name."""
  for bad in (0, -1, 1.5, "5", True, 2**41):
    with pytest.raises(ValueError, match=r"CallConfig.timeout_ms must be an int in \[1, 1099511627776\]"):
      jmo.CallConfig(timeout_ms=bad)
  for bad in (-1, 1.5, "5", True, 2**41):
    with pytest.raises(ValueError, match=r"CallConfig.first_call_timeout_ms must be an int in \[0, 1099511627776\]"):
      jmo.CallConfig(first_call_timeout_ms=bad)
  assert jmo.CallConfig(first_call_timeout_ms=0).first_call_timeout_ms == 0
  for kw in (dict(delay_rank=-2), dict(delay_rank=0.5), dict(delay_us=-1), dict(delay_us=1.0)):
    with pytest.raises(ValueError, match=r"CallConfig.delay_rank must be an int >= -1"):
      jmo.CallConfig(**kw)
  assert jmo.CallConfig(timeout_ms=np.int64(5), delay_rank=3, delay_us=7).timeout_ms == 5


def test_environment_defaults_refuse_values_they_do_not_know(monkeypatch):
  """$JMO_CONSUMER_COPY takes "plain" or nothing: a misspelt value is refused by name instead of leaving the bulk
  copies on unnoticed; a non-integer $JMO_TIMEOUT_MS likewise."""
  monkeypatch.setenv("JMO_CONSUMER_COPY", "plain")
  assert not jmo.CallConfig().consumer_tuning.bulk_copy
  monkeypatch.setenv("JMO_CONSUMER_COPY", "plan")
  with pytest.raises(ValueError, match=r"\$JMO_CONSUMER_COPY must be 'plain' .* or unset, got 'plan'"):
    jmo.CallConfig()
  monkeypatch.delenv("JMO_CONSUMER_COPY")
  assert jmo.CallConfig().consumer_tuning.bulk_copy
  monkeypatch.setenv("JMO_TIMEOUT_MS", "5s")
  with pytest.raises(ValueError, match=r"\$JMO_TIMEOUT_MS must be an integer, got '5s'"):
    jmo.CallConfig()
  monkeypatch.delenv("JMO_TIMEOUT_MS")
  monkeypatch.setenv("JMO_FIRST_CALL_TIMEOUT_MS", "1500")
  assert jmo.CallConfig().first_call_timeout_ms == 1500
  monkeypatch.setenv("JMO_FIRST_CALL_TIMEOUT_MS", "1m")
  with pytest.raises(ValueError, match=r"\$JMO_FIRST_CALL_TIMEOUT_MS must be an integer, got '1m'"):
    jmo.CallConfig()


def test_a_call_inside_a_shard_map_is_refused_by_name():
  """The layer runs its own shard_map over the mesh it is given; called inside the user's (some axes Manual), it says
  so instead of failing in a reshape of JAX's."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 2), ("data", "expert"))
  x, ids, gates, w1, w2 = layer_inputs(32, 16, 24, 8, 2, "balanced", 0)
  inner = jax.shard_map(lambda x, ids, g: jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh)[0], mesh=mesh,
                        in_specs=(P("data"),) * 3, out_specs=P("data"), axis_names={"data"})
  with pytest.raises(ValueError, match=r"moe_experts called inside a shard_map over the axes \['data'\]"):
    jax.jit(inner)(x, ids, gates)
  cfg = moe_config(emb_dim=16, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=2)
  graph, state = nnx.split(jmo.MoE(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
  module = jax.shard_map(lambda s, x: nnx.merge(graph, s)(x)[0], mesh=mesh, in_specs=(P(), P("data")),
                         out_specs=P("data"), axis_names={"data"})
  with pytest.raises(ValueError, match="MoE called inside a shard_map"):
    jax.jit(module)(state, x)
