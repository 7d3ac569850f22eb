"""impl="collective" (XLA collectives for the exchange, this library's grouped GEMMs for the experts) against the
float32 reference on 4 CPU devices: outputs, dropped counts and gradients on Explicit and Auto meshes, with skew,
empty experts, drops, skipped slots, batch axes and a token mask; under vmap; with the grouped-GEMM custom calls
(the GPU's GEMMs) and with the GPU's exchange (ragged_all_to_all, emulated); and the automatic choice of it for an
expert axis that spans hosts (with a stand-in for the hosts; tests/test_multiprocess.py runs it across processes)."""

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_overlap as jmo
from batch_axes_checks import mesh_of_shape
from benchmarks.baselines import emulated_ragged_all_to_all
from cases import layer_inputs, mesh_of, rel_err
from jax_moe_overlap import api, hosts, xla_path
from jax_moe_overlap.workspace import Workspace
from layer_checks import grouped_matmul_gemms
from test_xla_path import with_skips

E, D, F, K, T = 8, 16, 24, 2, 32
TOL = 1e-5


def value_and_grads(impl, mesh, ids, cf, batch_axes=()):
  """jit of (loss, (y, dropped)), d loss / d(x, gates, w1, w2) of the layer: loss weights every output differently,
  so that a gradient sent to the wrong token or expert shows."""
  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl,
                                 batch_axes=batch_axes)
    scale = 1.0 + jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * scale), (y, dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def check_matches_reference(mesh, args, cf, batch_axes=(), min_dropped=0):
  """impl="collective" against impl="reference" (float32): dropped counts equal, outputs and gradients within TOL;
  returns the collective's (y, dropped, grads)."""
  x, ids, gates, w1, w2 = args
  (_, (y, dropped)), grads = value_and_grads("collective", mesh, ids, cf, batch_axes)(x, gates, w1, w2)
  (_, (y_ref, dropped_ref)), grads_ref = value_and_grads("reference", mesh, ids, cf, batch_axes)(x, gates, w1, w2)
  assert int(dropped) == int(dropped_ref) >= min_dropped
  assert float(jnp.max(jnp.abs(y_ref))) > 0.1
  assert rel_err(y, y_ref) < TOL
  for name, a, b in zip(("x", "gates", "w1", "w2"), grads, grads_ref):
    assert rel_err(a, b) < TOL, name
  return y, dropped, grads


def explicit_mesh_inputs(seed):
  """A 4-device Explicit mesh and layer inputs placed on it (skewed routing, some slots and whole tokens 0..3
  skipped)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("expert",),
                           axis_types=(jax.sharding.AxisType.Explicit,))
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", seed)
  ids = with_skips(ids, seed)
  on_axis = NamedSharding(mesh, P("expert"))
  return mesh, [jax.device_put(a, on_axis) for a in (x, ids, gates, w1, w2)]


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("gemms", ["custom calls", "platform's"])
def test_explicit_mesh_skew_drops_and_skipped_slots(gemms):
  """On an Explicit mesh, skewed routing with drops and skipped slots. "custom calls": the grouped-GEMM custom calls
  as the experts' GEMMs, the GPU's (grouped_matmul_swiglu for GEMM1 and its SwiGLU, grouped_matmul for GEMM2 and
  the backward's input gradients; on CPU their reference loops), differentiated through expert_mlp's custom_vjp;
  "platform's": what the layer runs on CPU (XLA's ragged_dot). A second call gives bitwise the same results."""
  mesh, args = explicit_mesh_inputs(5)
  x, ids, gates, w1, w2 = args
  with grouped_matmul_gemms() if gemms == "custom calls" else contextlib.nullcontext():
    first = check_matches_reference(mesh, args, cf=0.75, min_dropped=1)
    (_, again), grads = value_and_grads("collective", mesh, ids, 0.75)(x, gates, w1, w2)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves((*again, grads))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  y, _, grads = first
  assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec
  # The experts are the grouped-GEMM custom calls (on CPU outside the context: their GPU branch).
  program = str(jax.make_jaxpr(lambda *a: jmo.moe_experts(*a, mesh=mesh, capacity_factor=0.75, impl="collective"))(
      *args))
  assert "jmo_grouped_matmul_swiglu" in program and "ragged_all_to_all" not in program
  # Skipped slots move nothing and get no gradient: whole padding tokens (0..3) give y = 0 and dx = 0.
  np.testing.assert_array_equal(np.asarray(y)[:4], 0)
  np.testing.assert_array_equal(np.asarray(grads[0])[:4], 0)
  np.testing.assert_array_equal(np.asarray(grads[1])[np.asarray(ids) < 0], 0)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("kind,cf", [("empty_experts", None), ("all_to_one", 1.0), ("skewed", None)])
def test_auto_mesh_with_batch_axes(kind, cf):
  """(data 2, expert 2), tokens over both: every data position an expert-parallel group of its own."""
  mesh = mesh_of_shape({"data": 2, "expert": 2})
  args = layer_inputs(2 * T, D, F, E, K, kind, 7)
  check_matches_reference(mesh, args, cf, batch_axes=("data",))


@pytest.mark.slow
@pytest.mark.parametrize("kind,cf", [("skewed", 0.5), ("all_to_one", 1.0), ("empty_experts", 0.5)])
def test_auto_mesh_expert_axis_only(kind, cf):
  check_matches_reference(mesh_of(4), layer_inputs(T, D, F, E, K, kind, 3), cf, min_dropped=1)


@pytest.mark.slow
def test_module_with_token_mask():
  """MoE(impl="collective") against MoE(impl="reference"): outputs and parameter gradients, padding tokens masked."""
  cfg = jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, capacity_factor=1.0,
                      dtype=jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 16, D))
  mask = jnp.arange(32).reshape(2, 16) % 5 != 0
  out = {}
  for impl in ("collective", "reference"):
    m = jmo.MoE(cfg, mesh=mesh_of(4), impl=impl, rngs=nnx.Rngs(0))

    def loss(m, x):
      y, _ = m(x, token_mask=mask)
      return jnp.sum(jnp.sin(y)), y

    (_, y), g = nnx.jit(lambda m, x: nnx.value_and_grad(loss, has_aux=True)(m, x))(m, x)
    out[impl] = (y, g)
  (y, g), (y_ref, g_ref) = out["collective"], out["reference"]
  np.testing.assert_array_equal(np.asarray(y)[~np.asarray(mask)], 0)
  assert rel_err(y, y_ref) < TOL
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert rel_err(a, b) < TOL


def _stacked_inputs(batch, seed):
  """`batch` input sets with different routings (skew, all to one, empty experts), shared weights."""
  kinds = ("skewed", "all_to_one", "empty_experts")
  sets = [layer_inputs(T, D, F, E, K, kinds[b % 3], seed + b) for b in range(batch)]
  x, ids, gates = (jnp.stack([s[i] for s in sets]) for i in range(3))
  return x, ids, gates, sets[0][3], sets[0][4]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["collective", "overlap"])
def test_vmap_equals_the_reference_per_batch_element(impl):
  """vmap over x, expert ids and gates (forward and gradients, with drops), and over x alone with the routing held
  fixed: each batch element as the reference computes it on its own. (On CPU both impls' GEMMs are XLA's ragged_dot,
  which expert_gemms runs once per batch element.)"""
  mesh, cf = mesh_of(4), 0.75
  x, ids, gates, w1, w2 = _stacked_inputs(3, 20)

  def per_element(impl):
    def f(x, ids, gates, w1, w2):
      scale = 1.0 + jnp.arange(T * D, dtype=jnp.float32).reshape(T, D) / (T * D)
      y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl)
      return jnp.sum(jnp.sin(y) * scale), (y, dropped)
    grads = jax.value_and_grad(f, argnums=(0, 2, 3, 4), has_aux=True)
    return jax.jit(jax.vmap(grads, in_axes=(0, 0, 0, None, None)))

  (_, (y, dropped)), grads = per_element(impl)(x, ids, gates, w1, w2)
  (_, (y_ref, dropped_ref)), grads_ref = per_element("reference")(x, ids, gates, w1, w2)
  np.testing.assert_array_equal(dropped, dropped_ref)
  assert int(jnp.sum(dropped)) > 0
  for b in range(3):
    assert rel_err(y[b], y_ref[b]) < TOL
    for a, r in zip(grads, grads_ref):
      assert rel_err(a[b], r[b]) < TOL
  fixed = jax.jit(jax.vmap(lambda x: jmo.moe_experts(x, ids[0], gates[0], w1, w2, mesh=mesh, impl=impl)[0]))
  y_fixed = fixed(x)
  for b in range(3):
    y_b, _ = jmo.moe_experts(x[b], ids[0], gates[0], w1, w2, mesh=mesh, impl="reference")
    assert rel_err(y_fixed[b], y_b) < TOL


@contextlib.contextmanager
def gpu_exchange(monkeypatch, emulated: bool):
  """The layer traced with the exchange it has on GPUs (ragged_all_to_all; ``emulated``: written from its documented
  semantics, which XLA:CPU can run). The layer's programs are dropped on entry and exit, so that no program traced
  on one side runs on the other."""
  api._programs.clear()  # pylint: disable=protected-access
  with monkeypatch.context() as patch:
    patch.setattr(xla_path, "_uses_ragged_all_to_all", lambda mesh: True)
    if emulated:
      patch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    try:
      yield
    finally:
      api._programs.clear()  # pylint: disable=protected-access


@pytest.mark.slow
def test_gpu_exchange_emulated_on_cpu(monkeypatch):
  """The exchange as it runs on GPUs, ragged_all_to_all (which XLA:CPU lacks), emulated from its documented
  semantics: outputs and gradients against the reference, also under vmap over x alone (the routing fixed:
  ragged_all_to_all's batching takes offsets and sizes all batched, which the layer makes them)."""
  with gpu_exchange(monkeypatch, emulated=True):
    args = layer_inputs(T, D, F, E, K, "skewed", 9)
    check_matches_reference(mesh_of(4), args, cf=0.5, min_dropped=1)
    x, ids, gates, w1, w2 = args
    xs = jnp.stack([x, 2 * x])
    y = jax.jit(jax.vmap(lambda x: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl="collective")[0]))(xs)
    for b in range(2):
      y_b, _ = jmo.moe_experts(xs[b], ids, gates, w1, w2, mesh=mesh_of(4), impl="reference")
      assert rel_err(y[b], y_b) < TOL


def test_ragged_exchange_batches_with_the_routing_held_fixed(monkeypatch):
  """The GPU's exchange (ragged_all_to_all) under vmap over x alone: JAX's batching rule of ragged_all_to_all
  asserts unless its offsets and sizes are all batched or none, so the layer batches them with the rows. (Traced,
  not run: XLA:CPU has no ragged_all_to_all; test_gpu_exchange_emulated_on_cpu runs it emulated.)"""
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 1)
  mesh = mesh_of(4)

  def layer(x):
    return jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="collective")[0]

  with gpu_exchange(monkeypatch, emulated=False):
    jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(lambda x: jnp.sum(layer(x)))))(jnp.stack([x, x]))
  assert str(jaxpr).count("ragged_all_to_all") >= 4  # forward and backward, there and back


def _devices(processes):
  """A [groups, ranks] table of stand-in devices in these processes (``process_index`` is all hosts.py reads)."""
  return np.array([[types.SimpleNamespace(process_index=p) for p in row] for row in processes], dtype=object)


def test_groups_across_hosts():
  names = {0: "a", 1: "a", 2: "b", 3: "b"}
  assert hosts.groups_across_hosts(_devices([[0, 1], [2, 3]]), names) == []
  assert hosts.groups_across_hosts(_devices([[0, 2], [1, 3]]), names) == [[(0, "a"), (2, "b")],
                                                                          [(1, "a"), (3, "b")]]
  assert hosts.groups_across_hosts(_devices([[0, 0, 1, 1], [2, 2, 3, 3]]), names) == []
  assert hosts.groups_across_hosts(_devices([[1, 1, 2, 2]]), names) == [[(1, "a"), (2, "b")]]


def test_axis_spans_hosts_asks_for_hosts_only_across_processes(monkeypatch):
  asked = []

  def stand_in(processes):
    asked.append(list(processes))
    return {0: "a", 1: "a", 2: "b", 3: "b"}

  monkeypatch.setattr(hosts, "process_hosts", stand_in)
  assert not hosts.axis_spans_hosts(_devices([[0, 0], [2, 2]]))
  assert not asked
  assert not hosts.axis_spans_hosts(_devices([[0, 1], [2, 3]]))
  assert hosts.axis_spans_hosts(_devices([[0, 2], [1, 3]]))
  assert asked == [[0, 1, 2, 3], [0, 1, 2, 3]]
  assert not hosts.axis_spans_hosts(np.array(jax.devices("cpu")[:4]).reshape(1, 4))  # one process: nothing asked
  assert len(asked) == 2


def test_hosts_need_jax_distributed():
  with pytest.raises(RuntimeError, match=r"needs jax.distributed.initialize\(\)"):
    hosts.process_hosts([0, 1])


def test_overlap_over_an_axis_across_hosts_runs_the_collective_impl(monkeypatch):
  """With a stand-in saying the expert axis spans hosts, an impl="overlap" call (the default) runs as
  impl="collective": no workspace is created, the results are the collective's bit for bit; "xla" and
  "reference" are left as they are."""
  mesh = mesh_of(4)
  assert api.chosen_impl("overlap", mesh, "expert") == "overlap"  # one process: one host
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 4)
  y_collective, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="collective")
  api._axis_spans_hosts.cache_clear()  # pylint: disable=protected-access
  monkeypatch.setattr(hosts, "axis_spans_hosts", lambda devs: True)
  try:
    assert [api.chosen_impl(i, mesh, "expert") for i in ("overlap", "collective", "xla", "reference")] == [
        "collective", "collective", "xla", "reference"]
    before = set(map(id, Workspace.cached()))
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)
    assert set(map(id, Workspace.cached())) == before
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_collective))
  finally:
    api._axis_spans_hosts.cache_clear()  # pylint: disable=protected-access
