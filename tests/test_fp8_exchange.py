"""quantization="fp8" with FP8 rows on the wire (fp8_exchange.py), impl="xla" and impl="collective": the rows
quantized on the token owner and exchanged as e4m3 values with their scales give, bit for bit, the outputs and
gradients of the same recipe with the rows exchanged in the compute dtype and quantized on the expert's rank (the
order before FP8 rows crossed the wire, rebuilt here from the library's pieces), on meshes with Auto and Explicit
axes, with a tensor axis, batch axes, drops, k = 3 and the GPU's exchange (ragged_all_to_all, emulated); and the
bytes each exchange moves per row, counted on the program: D + D / 32 under fp8 for the rows dispatched to the
experts (forward) and for the output gradient dispatched to them (backward), 2D in bfloat16 otherwise."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from benchmarks.common import exchanged_rows
from cases import layer_inputs, rel_err
from jax_moe_overlap import api, fp8_experts, xla_path
from tensor_parallel_checks import mesh_of_shape
from test_collective import gpu_exchange

E, T, D, F = 8, 64, 128, 256      # F / 2 = 128: whole tiles on each shard of a tensor axis of 2


def _compute_dtype_exchange(x, gates, is_kept, w1, w2, route, gemms):
  """The recipe with the rows exchanged in x's dtype and quantized on the expert's rank (forward), the slots' output
  gradients written out by the combine's backward, exchanged likewise and quantized there (fp8_expert_mlp's
  backward): the reference order for the bitwise check."""
  return xla_path._unquantized_block(  # pylint: disable=protected-access
      lambda rows, w1, w2, sizes: fp8_experts.fp8_expert_mlp(rows, w1, w2, sizes, gemms), x, gates, is_kept, w1, w2,
      route)


@contextlib.contextmanager
def rows_exchanged_in_the_compute_dtype(monkeypatch):
  api._programs.clear()  # pylint: disable=protected-access
  with monkeypatch.context() as patch:
    patch.setattr(xla_path, "fp8_combined_exchange", _compute_dtype_exchange)
    try:
      yield
    finally:
      api._programs.clear()  # pylint: disable=protected-access


def layer_grads(mesh, ids, cot, impl, cf, tensor_axis, batch_axes, config=jmo.CallConfig(), quantization="fp8"):
  """The fp8 layer's loss sum(y * cot), returning ((loss, (y, dropped)), (dx, dgates, dw1, dw2)), unjitted."""
  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, capacity_factor=cf,
                                 tensor_axis=tensor_axis, batch_axes=batch_axes, config=config,
                                 quantization=quantization)
    return jnp.sum(y.astype(jnp.float32) * cot), (y, dropped)
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


def bits(a):
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


CASES = {
    "xla-auto-bf16-drops": dict(impl="xla", shape={"expert": 4}, dtype=jnp.bfloat16, cf=0.5),
    "collective-explicit-tensor": dict(impl="collective", shape={"expert": 2, "tensor": 2}, explicit=True,
                                       dtype=jnp.bfloat16, tensor_axis="tensor"),
    "xla-explicit-batch-k3": dict(impl="xla", shape={"data": 2, "expert": 2}, explicit=True, dtype=jnp.float32,
                                  cf=0.75, batch_axes=("data",), k=3),
    "collective-explicit-f32-drops": dict(impl="collective", shape={"expert": 4}, explicit=True, dtype=jnp.float32,
                                          cf=0.5),
    "xla-auto-tensor-f32": dict(impl="xla", shape={"expert": 2, "tensor": 2}, dtype=jnp.float32,
                                tensor_axis="tensor"),
    "collective-ragged-emulated": dict(impl="collective", shape={"expert": 4}, dtype=jnp.bfloat16, cf=0.75,
                                       ragged=True),
    # One rank: no exchange; the rows move within the device (values as 4-byte words) and the slots' gradients are
    # quantized straight into the experts' rows.
    "collective-one-rank-drops": dict(impl="collective", shape={"expert": 1}, dtype=jnp.bfloat16, cf=0.5),
}
DEFAULT_PASS = ("collective-one-rank-drops",)   # each case compiles two programs: the others in the slow pass


@pytest.mark.parametrize("name", [n if n in DEFAULT_PASS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_fp8_rows_on_the_wire_equal_the_compute_dtype_exchange_bit_for_bit(name, monkeypatch):
  c = CASES[name]
  k, tensor_axis, batch_axes = c.get("k", 2), c.get("tensor_axis"), c.get("batch_axes", ())
  explicit = c.get("explicit", False)
  mesh = mesh_of_shape(c["shape"], explicit)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, k, "skewed", 11, dtype=c["dtype"])
  w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)             # master weights
  cot = jnp.asarray(np.random.default_rng(12).standard_normal((T, D)).astype(np.float32))
  if explicit:
    tokens = tuple(a for a in (*batch_axes, "expert", tensor_axis) if a is not None)
    x = jax.device_put(x, NamedSharding(mesh, P(tokens)))
    w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))

  def run():
    """(rows exchanged, results), each of a fresh function (JAX keeps a traced program per function). The GPU's
    exchange runs emulated (XLA:CPU has no ragged_all_to_all); its rows are counted on the program as traced for
    the GPU."""
    fresh = functools.partial(layer_grads, mesh, ids, cot, c["impl"], c.get("cf"), tensor_axis, batch_axes)
    with gpu_exchange(monkeypatch, emulated=False) if c.get("ragged") else contextlib.nullcontext():
      wire = exchanged_rows(fresh(), x, gates, w1, w2)
    with gpu_exchange(monkeypatch, emulated=True) if c.get("ragged") else contextlib.nullcontext():
      return wire, jax.jit(fresh())(x, gates, w1, w2)

  wire, ((_, (y, dropped)), grads) = run()
  with rows_exchanged_in_the_compute_dtype(monkeypatch):
    wire_ref, ((_, (y_ref, dropped_ref)), grads_ref) = run()
  # The two programs differ where they should: the rows to the experts in FP8 or in the compute dtype.
  row = 2 if c["dtype"] == jnp.bfloat16 else 4
  exchange = "ragged_all_to_all" if c.get("ragged") else "all_to_all"
  if c["shape"] == {"expert": 1}:
    assert wire == wire_ref == []
  else:
    packed = "uint8" if c["impl"] == "overlap" else "uint32"   # XLA moves the packed bytes as words
    assert wire == [(exchange, packed, D + D // 32), (exchange, str(jnp.dtype(c["dtype"])), row * D)] * 2
    assert {(dt, b) for _, dt, b in wire_ref} == {(str(jnp.dtype(c["dtype"])), row * D)}
  if c.get("cf") is not None:
    assert int(dropped) > 0
  assert int(dropped) == int(dropped_ref)
  assert y.dtype == c["dtype"] and grads[0].dtype == c["dtype"] and grads[2].dtype == jnp.float32
  for what, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y, *grads), (y_ref, *grads_ref)):
    assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0, what
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)


def test_exchanged_bytes_per_row():
  """Counted on the programs (forward and backward): under fp8 the rows dispatched to the experts and the output
  gradient dispatched to them (the combine's transpose) move D + D / 32 bytes (e4m3 values and a float32 scale per
  128, packed in one row of 4-byte words), 0.516 of bfloat16's 2D; the combine and the input gradient stay in the compute
  dtype. With a tensor axis the tensor group's gather of the rows moves the FP8 rows too."""
  mesh = mesh_of_shape({"expert": 2, "tensor": 2})
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, 2, "skewed", 1, dtype=jnp.bfloat16)

  def grads(quantization, tensor_axis):
    def loss(x, w1):
      y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="xla", tensor_axis=tensor_axis,
                             quantization=quantization)
      return jnp.sum(y.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))

  fp8_rows = exchanged_rows(grads("fp8", None), x, w1)
  bf16_rows = exchanged_rows(grads(None, None), x, w1)
  assert [b for _, _, b in fp8_rows] == [132, 256, 132, 256] and fp8_rows[0][1] == "uint32"
  assert [b for _, _, b in bf16_rows] == [256] * 4
  assert fp8_rows[0][2] / bf16_rows[0][2] == pytest.approx(0.516, abs=1e-3)
  gathered = exchanged_rows(grads("fp8", "tensor"), x, w1, collectives=("all_gather",))
  assert ("all_gather", "uint32", 132) in gathered and ("all_gather", "bfloat16", 256) not in gathered


@pytest.mark.slow
def test_vmap_over_the_tokens():
  """The FP8 exchange under vmap over x alone (the routing held fixed), forward and input gradient: each batch
  element as the call on its own computes it, bit for bit."""
  mesh = mesh_of_shape({"expert": 4})
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, 2, "skewed", 3, dtype=jnp.bfloat16)
  xs = jnp.stack([x, (2 * x.astype(jnp.float32)).astype(jnp.bfloat16)])

  def f(x):
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="collective", quantization="fp8")
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

  (_, y), dx = jax.jit(jax.vmap(jax.value_and_grad(f, has_aux=True)))(xs)
  for b in range(2):
    (_, y_b), dx_b = jax.jit(jax.value_and_grad(f, has_aux=True))(xs[b])
    assert float(jnp.max(jnp.abs(y_b.astype(jnp.float32)))) > 0 and rel_err(dx_b, 0 * dx_b) > 0
    np.testing.assert_array_equal(bits(y[b]), bits(y_b))
    np.testing.assert_array_equal(bits(dx[b]), bits(dx_b))
