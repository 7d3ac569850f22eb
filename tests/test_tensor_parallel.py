"""Expert tensor parallelism (``tensor_axis``): every impl against the float32 oracle on an (expert=2, tensor=2) mesh
of the 4 CPU devices, on Auto and Explicit axes; bitwise repeatability; the slot expansion's rules; the refusals; the
MoE module training with a tensor axis. The 8-device meshes run in a child process (tensor_parallel_main.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from cases import layer_inputs, moe_config, rel_err
from child_process import run_script
from jax_moe_overlap import tensor_parallel
from jax_moe_overlap.plan import SKIP
from jax_moe_overlap.workspace_backend import rank_devices
from tensor_parallel_checks import (D, E, F, K, check_bfloat16, check_matches_oracle, check_repeatable,
                                    mesh_of_shape)

EXPERT_TENSOR = {"expert": 2, "tensor": 2}


@pytest.mark.parametrize("impl", ["overlap", "collective", "xla", "reference"])
def test_every_impl_matches_the_oracle(impl):
  # Skewed routing, every expert of expert rank 1 empty, skipped slots; dropless.
  assert check_matches_oracle(EXPERT_TENSOR, impl) == [0, 0, 0]


# impl="overlap" and the reference in the default pass (test_every_impl_matches_the_oracle runs every impl with the
# tensor axis there); "collective" and "xla" with drops in the slow pass.
@pytest.mark.parametrize("impl", ["overlap", pytest.param("collective", marks=pytest.mark.slow),
                                  pytest.param("xla", marks=pytest.mark.slow), "reference"])
def test_capacity_drops_the_slots_the_oracle_drops(impl):
  # Every tensor member of an expert gets the same rows and so drops the same slots; each is counted once.
  dropped = check_matches_oracle(EXPERT_TENSOR, impl, kinds=("skewed", "skipped"), cf=0.5, seed=4)
  assert all(d > 0 for d in dropped), dropped


# impl="overlap" in the default pass; "xla" in the slow pass (it runs with the tensor axis by default in
# test_every_impl_matches_the_oracle).
@pytest.mark.parametrize("impl", ["overlap", pytest.param("xla", marks=pytest.mark.slow)])
def test_explicit_axes_and_a_whole_w1(impl):
  # An Explicit mesh, w1 given as [E, D, 2F] (not its view): y laid out as x, gradients in the inputs' shapes.
  check_matches_oracle(EXPERT_TENSOR, impl, kinds=("skewed",), explicit=True, view=False, seed=6)


def test_tensor_axis_first_in_the_mesh():
  # The exchange group's ranks are numbered (expert, tensor) whatever the mesh's order of the axes.
  check_matches_oracle({"tensor": 2, "expert": 2}, "overlap", kinds=("skewed",), seed=7)


def test_bfloat16_into_poisoned_outputs():
  # The shards' partials cross in bfloat16 and are summed in float32: within 1e-2 of the float32 oracle, with
  # skipped slots, every output element written.
  check_bfloat16(EXPERT_TENSOR)


def test_repeated_calls_are_bitwise_identical():
  check_repeatable(EXPERT_TENSOR, "overlap")


def test_counts_through_the_workspace_count_each_dropped_slot_once(monkeypatch):
  # Where the group spans processes the layer counts the dropped slots from the exchanged counts (each dropped slot
  # counted once per tensor shard by the plans): forced here in one process, as layer_checks does without a tensor
  # axis. Outputs bitwise equal to the all_gather path's, the dropped count the oracle's.
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "skewed", 8)
  def f():
    layer = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, tensor_axis="tensor", capacity_factor=0.5))
    exchanged = "jmo_exchange_counts" in layer.lower(x, ids, gates, w1, w2).as_text()
    return (*layer(x, ids, gates, w1, w2), exchanged)

  _, want = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, tensor_axis="tensor", capacity_factor=0.5,
                            impl="reference")
  jmo.release_workspaces()
  try:
    y, dropped, exchanged = f()
    assert not exchanged
    jmo.release_workspaces()  # the programs compiled against the gather path go with their workspace
    monkeypatch.setattr(jmo.Workspace, "spans_processes", property(lambda self: True))
    y_ws, dropped_ws, exchanged = f()
    assert exchanged
  finally:
    jmo.release_workspaces()
  assert int(dropped) == int(dropped_ws) == int(want) > 0
  assert np.asarray(y).tobytes() == np.asarray(y_ws).tobytes()


def test_eager_call_and_its_workspace_size():
  # Outside jit: y in x's sharding; the workspace it allocates has the bytes workspace_bytes(tensor=2) announces.
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "skewed", 10)
  x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(("expert", "tensor"))))
  jmo.release_workspaces()
  y, dropped = jmo.moe_experts(x_sharded, ids, gates, w1, w2, mesh=mesh, tensor_axis="tensor", capacity_factor=0.5)
  y_ref, dropped_ref = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, tensor_axis="tensor", capacity_factor=0.5,
                                       impl="reference")
  assert y.sharding == x_sharded.sharding and int(dropped) == int(dropped_ref) > 0
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  [ws] = jmo.Workspace.cached()
  assert ws.axis_name == ("expert", "tensor") and ws.ranks == 4
  # The default CallConfig sums the shards by GatherRS here (call_site.tensor_reduce: 4 G = 16 <= k TP itemsize =
  # 16 in float32), whose partials the workspace holds too.
  assert ws.bytes_per_rank == jmo.workspace_bytes(64, D, K, E, ranks=2, tensor=2, capacity_factor=0.5,
                                                  gather_rs=True)
  assert ws.bytes_per_rank > jmo.workspace_bytes(64, D, K, E, ranks=2, tensor=2, capacity_factor=0.5)


def test_fused_dispatch_gemm_with_a_tensor_axis():
  # CallConfig(dispatch_pushers=2): dispatch_gemm's CPU handler on the shard slots, forward and gradients.
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "skewed", 12)

  def grads(impl, config=jmo.CallConfig()):
    loss = lambda x, g, w1, w2: jnp.sum(jnp.sin(jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, tensor_axis="tensor",
                                                                impl=impl, config=config)[0]))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)

  got, want = grads("overlap", jmo.CallConfig(dispatch_pushers=2)), grads("reference")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_workspace_group_over_two_axes():
  mesh = mesh_of_shape({"data": 1, "tensor": 2, "expert": 2})
  devs = rank_devices(mesh, ("expert", "tensor"))
  # rank = expert * TP + tensor, as jax.lax.axis_index(("expert", "tensor")) numbers them
  want = np.array([[mesh.devices[0, t, e] for e in range(2) for t in range(2)]])
  assert devs.shape == (1, 4) and (devs == want).all()
  ws = jmo.Workspace.get(mesh, ("expert", "tensor"), jmo.workspace.WorkspaceSizes(64, 32, 16, 8))
  assert ws.ranks == 4 and ws.groups == 1 and ws.other_axes == ("data",)
  assert jmo.Workspace.get(mesh, ("expert",), ws.sizes) is not ws  # a 1-tuple is the expert axis alone


def test_shard_expert_ids():
  # E = 8 over R = 2 expert ranks (E_l = 4), TP = 2: expert e's shard s lives on rank (e // 4) * 2 + s as its local
  # expert e % 4, i.e. shard expert ((e // 4) * 2 + s) * 4 + e % 4.
  ids = jnp.asarray([[0, 5], [SKIP, 7], [8, -3]], jnp.int32)
  got = np.asarray(tensor_parallel.shard_expert_ids(ids, 8, 2, 2))
  invalid = SKIP - 1
  np.testing.assert_array_equal(got, [[0, 4, 9, 13], [SKIP, SKIP, 11, 15], [invalid, invalid, invalid, invalid]])


def test_gate_gradient_sums_the_shards_in_tensor_order():
  # The cotangents of a choice's 4 shard slots summed left to right: ((1e8 + 1) - 1e8) + 1 = 1 in float32; a
  # pairwise sum (1e8 + 1) + (-1e8 + 1) would give 0.
  ct = jnp.asarray([[1e8, 1.0, -1e8, 1.0]], jnp.float32)
  _, vjp = jax.vjp(lambda g: tensor_parallel.repeat_gates(g, 4), jnp.ones((1, 1), jnp.float32))
  (d,) = vjp(ct)
  assert float(d[0, 0]) == 1.0


def test_repeat_gates_forward_rule_is_the_primal():
  # Under differentiation (the fwd rule) the values are the primal's: choice j's gate in slots 3j .. 3j + 2.
  gates = jax.random.uniform(jax.random.key(3), (5, 2), jnp.float32)
  y, _ = jax.vjp(lambda g: tensor_parallel.repeat_gates(g, 3), gates)
  np.testing.assert_array_equal(y, tensor_parallel.repeat_gates(gates, 3))
  np.testing.assert_array_equal(y, np.repeat(np.asarray(gates), 3, axis=1))


def test_refusals_name_the_rule():
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "balanced", 0)
  call = lambda **kw: jmo.moe_experts(*kw.pop("args", (x, ids, gates, w1, w2)), mesh=mesh, **kw)
  with pytest.raises(ValueError, match="tensor_axis 'model' is not an axis of the mesh"):
    call(tensor_axis="model")
  with pytest.raises(ValueError, match="tensor_axis 'expert' is the expert axis"):
    call(tensor_axis="expert")
  with pytest.raises(ValueError, match="other than the expert axis 'expert' and the tensor axis 'tensor'"):
    call(tensor_axis="tensor", batch_axes=("tensor",))
  with pytest.raises(ValueError, match=r"62 tokens cannot be split evenly over the 4 devices of mesh axes "
                                       r"\('expert', 'tensor'\)"):
    call(args=(x[:62], ids[:62], gates[:62], w1, w2), tensor_axis="tensor")
  odd = layer_inputs(64, D, 23, E, K, "balanced", 0)
  with pytest.raises(ValueError, match="hidden width F=23 cannot be split evenly over the 2 devices of tensor axis"):
    call(args=odd, tensor_axis="tensor")
  with pytest.raises(ValueError, match=r"w1 must be \[E, D, 2F\] \(or its view \[E, D, 2, F\]\)"):
    call(args=(x, ids, gates, w1.reshape(E, D, 4, F // 2), w2), tensor_axis="tensor")
  cfg = moe_config(emb_dim=D, moe_mlp_dim=23, num_experts=E, num_experts_per_tok=K)
  with pytest.raises(ValueError, match="hidden width F=23"):
    jmo.MoE(cfg, mesh=mesh, tensor_axis="tensor", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="is the expert axis"):
    jmo.MoE(cfg, mesh=mesh, tensor_axis="expert", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("explicit", [False, True])
def test_module_refuses_tokens_that_do_not_split_over_the_token_shards(explicit):
  # 2 x 31 = 62 tokens over the 4 devices of (expert, tensor): the module names the rule before it reshapes x into
  # the token layout (on Explicit axes that reshape would otherwise fail first, with JAX's sharding message).
  mesh = mesh_of_shape(EXPERT_TENSOR, explicit)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K)
  model = jmo.MoE(cfg, mesh=mesh, tensor_axis="tensor", impl="xla", rngs=nnx.Rngs(0))
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (2, 31, D)), jax.sharding.NamedSharding(mesh, jax.P()))
  rule = r"62 tokens cannot be split evenly over the 4 devices of mesh axes \('expert', 'tensor'\)"
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=rule):
      model(x)
    with pytest.raises(ValueError, match=rule):
      nnx.jit(lambda m, x: m(x)[0])(model, x)


def test_invalid_expert_id_under_jit_is_reported_with_its_own_value():
  # A traced id outside [0, E) reaches the custom calls; the error names the id given, not its shard slot's id.
  mesh = mesh_of_shape(EXPERT_TENSOR)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, K, "balanced", 0)
  bad = np.asarray(ids).copy()
  bad[5, 1] = 11
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, tensor_axis="tensor")[0])
  with pytest.raises(jax.errors.JaxRuntimeError, match="names expert id 11"):
    jax.block_until_ready(f(x, jnp.asarray(bad), gates, w1, w2))
  y = f(x, ids, gates, w1, w2)  # the next call works
  y_ref = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, tensor_axis="tensor", impl="reference")[0]
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


# In the slow pass: the default pass runs the module through test_moe_block_with_a_tensor_axis.
@pytest.mark.slow
@pytest.mark.parametrize("explicit", [False, True])
def test_module_trains_with_a_tensor_axis(explicit):
  mesh = mesh_of_shape(EXPERT_TENSOR, explicit)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, capacity_factor=1.0)
  model = jmo.MoE(cfg, mesh=mesh, tensor_axis="tensor", rngs=nnx.Rngs(0))
  # Created sharded: each device holds F / 2 columns of its experts' gate and up projections and F / 2 rows of w2.
  assert model.w1[...].shape == (E, D, 2, F)
  assert {s.data.shape for s in model.w1[...].addressable_shards} == {(E // 2, D, 2, F // 2)}
  assert {s.data.shape for s in model.w2[...].addressable_shards} == {(E // 2, F // 2, D)}
  specs = nnx.get_partition_spec(nnx.state(model))
  assert tuple(specs["w1"]) == ("expert", None, None, "tensor")
  assert tuple(specs["w2"]) == ("expert", "tensor", None)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, D))
  if explicit:
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("expert")))
  target = jax.random.normal(jax.random.PRNGKey(2), x.shape)

  def loss_fn(m):
    y, aux = m(x)
    return jnp.mean((y - target) ** 2) + 0.01 * aux.load_balance_loss, (y, aux)

  grad_step = nnx.jit(lambda m: nnx.value_and_grad(loss_fn, has_aux=True)(m))
  (loss, (y, aux)), grads = grad_step(model)
  model.impl = "reference"
  (loss_ref, (y_ref, aux_ref)), grads_ref = grad_step(model)
  model.impl = "overlap"
  assert float(aux.dropped_fraction) == float(aux_ref.dropped_fraction)
  assert y.shape == x.shape and rel_err(y, y_ref) < 1e-5
  if explicit:
    assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (y.sharding, x.sharding)
  for name in ("router", "w1", "w2"):
    g = np.asarray(getattr(grads, name)[...])
    assert np.abs(g).max() > 0, name
    np.testing.assert_allclose(g, getattr(grads_ref, name)[...], rtol=1e-4, atol=1e-6, err_msg=name)

  optimizer = nnx.Optimizer(model, __import__("optax").adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def train_step(m, opt):
    (l, _), g = nnx.value_and_grad(loss_fn, has_aux=True)(m)
    opt.update(m, g)
    return l

  losses = [float(train_step(model, optimizer)) for _ in range(3)]
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
  assert tuple(model.w1[...].sharding.spec) == ("expert", None, None, "tensor")


def test_moe_block_with_a_tensor_axis():
  mesh = mesh_of_shape(EXPERT_TENSOR)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K)
  block = jmo.MoEBlock(cfg, mesh=mesh, tensor_axis="tensor", impl="xla", rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 32, D))
  run = nnx.jit(lambda b, x: nnx.capture(b, nnx.Intermediate)(x))
  y, inter = run(block, x)
  block.impl = "reference"
  y_ref, _ = run(block, x)
  assert y.shape == x.shape and rel_err(y, y_ref) < 1e-5
  assert float(jmo.total_aux_loss(inter)) > 0


@pytest.mark.slow  # a child process with 8 devices compiling every program again
def test_eight_devices():
  out = run_script("tensor_parallel_main.py")
  assert out.count(": match") == 15 and out.count("as the oracle") == 9, out
  assert out.count("bitwise equal") == 2, out
