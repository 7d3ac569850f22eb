"""The expert layer's checks of the GPU suite, written against a mesh (1-D, axis "expert") so that any devices run them.

tests/gpu/test_gpu_layer.py runs them on the GPUs (R = every visible GPU, and 1); tests/test_moe.py runs
``check_layer`` on 4 CPU devices, so that CI exercises these bodies on every change. Each check compares the
overlap layer in bfloat16 with the pure-JAX reference in float32 on the same (bf16-rounded) fresh random inputs:
relative error below ``TOL``. The overlap programs write their outputs into poisoned buffers
(``Poisoned``), so that an output element the custom calls leave unwritten shows as NaN instead of stale memory.
"""

from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_overlap as jmo
from jax_moe_overlap import api, expert_gemms
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu
from cases import layer_inputs, rel_err

TOL = 1e-2
# Tokens and experts divisible by R = 1, 2, 4, 8, with k = 2 experts on every rank at R = 8 (for the "one_rank"
# routing); D and F multiples of 64, so that on Hopper every expert GEMM takes the wgmma engine.
TOKENS, D, F, E, K = 256, 256, 384, 16, 2
AXIS = "expert"


def _poison_value(dtype):
  return np.nan if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).min


def _pointers(tree):
  return [s.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards]


class Poisoned:
  """``jax.jit(fn)`` whose outputs are computed into donated buffers of NaN (integer outputs: their minimum).

  The layer's outputs are fresh XLA buffers, which may still hold an earlier call's values, the right ones when the
  same call is repeated: XLA writes each output into the poisoned buffer it was given, so an element the custom calls
  do not write stays NaN. Output shardings: a leading dimension divisible by R is split over the expert axis (as the
  layer's outputs and gradients are), the rest replicated, unless ``spec_of`` says otherwise. After each call, ``aliased`` counts the output buffers
  (over all devices) that were the poisoned ones, of ``buffers``: XLA may decline a donation.
  """

  def __init__(self, fn, mesh, spec_of=None):
    """spec_of: output ShapeDtypeStruct -> its PartitionSpec, for other layouts than the one above."""
    self._fn, self._mesh, self._compiled = fn, mesh, None
    self._spec_of = spec_of or self._split_over_axis
    self.aliased = self.buffers = 0

  def _split_over_axis(self, s):
    return P(AXIS) if s.ndim and s.shape[0] % self._mesh.shape[AXIS] == 0 else P()

  def _build(self, args):
    shapes = jax.eval_shape(self._fn, *args)
    shardings = jax.tree.map(lambda s: NamedSharding(self._mesh, self._spec_of(s)), shapes)
    fill = jax.jit(lambda: jax.tree.map(lambda s: jnp.full(s.shape, _poison_value(s.dtype), s.dtype), shapes),
                   out_shardings=shardings)
    # keep_unused: jit would prune the unused donated argument, and no output would be aliased to it.
    call = jax.jit(lambda poison, *a: self._fn(*a), donate_argnums=0, keep_unused=True, out_shardings=shardings)
    return fill, call

  def __call__(self, *args):
    if self._compiled is None:
      self._compiled = self._build(args)
    fill, call = self._compiled
    poison = fill()
    before = _pointers(poison)
    out = call(poison, *args)
    after = _pointers(out)
    self.buffers, self.aliased = len(after), sum(a == b for a, b in zip(before, after))
    return out


def bits(tree):
  """The outputs' bytes, for bitwise comparisons (NaN-safe)."""
  return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def layer_fn(mesh, ids, target, impl, capacity_factor=None, config=jmo.CallConfig()):
  """(x, gates, w1, w2) -> ((loss, (y, dropped)), (dx, dgates, dw1, dw2)): moe_experts with a linear read-out
  loss = sum(y * target), so that every output element gets its own cotangent."""
  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=capacity_factor, impl=impl,
                                 config=config)
    return jnp.sum(y.astype(jnp.float32) * target), (y, dropped)
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


class Layer:
  """One routing's inputs (bf16) on `mesh`, the overlap layer's forward + gradients through ``Poisoned``, and the
  float32 reference's."""

  def __init__(self, mesh, kind, seed, tokens=TOKENS, d=D, f=F, capacity_factor=None):
    self.mesh, self.R, self.kind, self.capacity_factor = mesh, mesh.shape[AXIS], kind, capacity_factor
    self.x, self.ids, self.gates, self.w1, self.w2 = layer_inputs(tokens, d, f, E, K, kind, seed, jnp.bfloat16,
                                                                  ranks=self.R)
    self.target = jax.random.normal(jax.random.PRNGKey(seed + 1), self.x.shape, jnp.float32)

  def args(self, dtype):
    return tuple(a.astype(dtype) for a in (self.x, self.gates, self.w1, self.w2))

  def overlap(self, config=jmo.CallConfig()) -> Poisoned:
    return Poisoned(layer_fn(self.mesh, self.ids, self.target, "overlap", self.capacity_factor, config), self.mesh)

  def reference(self):
    fn = layer_fn(self.mesh, self.ids, self.target, "reference", self.capacity_factor)
    return jax.jit(fn)(*self.args(jnp.float32))


def errors(out, ref) -> dict[str, float]:
  """Relative errors of y and the four gradients of ``layer_fn`` outputs; asserts that they are finite."""
  (_, (y, _)), grads = out
  (_, (y_ref, _)), grads_ref = ref
  errs = {}
  for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y, *grads), (y_ref, *grads_ref)):
    assert np.isfinite(np.asarray(a, np.float32)).all(), f"{name} has NaN/inf (poison left: unwritten elements?)"
    errs[name] = rel_err(a, b)
  return errs


def _fmt(errs):
  return " ".join(f"{k}={v:.2e}" for k, v in errs.items())


def check_layer(mesh, kind, capacity_factor=None, seed=0):
  """moe_experts forward and gradients, bf16 overlap vs the float32 reference, for one routing (cases.routing, at
  R = the mesh's size) and capacity factor (None: dropless; else as many dropped slots as the reference drops)."""
  layer = Layer(mesh, kind, seed, capacity_factor=capacity_factor)
  if kind == "one_rank":
    assert set(np.unique(np.asarray(layer.ids) // (E // layer.R))) == {layer.R - 1}
  run = layer.overlap()
  out = run(*layer.args(jnp.bfloat16))
  ref = layer.reference()
  (_, (y, dropped)), _ = out
  (_, (y_ref, dropped_ref)), _ = ref
  errs = errors(out, ref)
  print(f"R={layer.R} {kind} cf={capacity_factor} dropped={int(dropped)} (reference {int(dropped_ref)}) {_fmt(errs)} "
        f"poisoned outputs {run.aliased}/{run.buffers}")
  assert y.dtype == jnp.bfloat16
  assert int(dropped) == int(dropped_ref)
  assert (int(dropped) > 0) == (capacity_factor is not None), "the capacity case must drop, the dropless one not"
  assert float(jnp.linalg.norm(y_ref)) > 0
  assert all(v < TOL for v in errs.values()), errs
  assert run.aliased == run.buffers, f"only {run.aliased} of {run.buffers} outputs were computed into the poison"


def check_held_back(mesh, delay_rank, delay_us=2000, calls=3, seed=11):
  """Rank ``delay_rank`` held back ``delay_us`` at the start of every custom call (CallConfig's testing aid), for
  ``calls`` forward + backward calls: each bitwise equal to the call without the delay, and within TOL of the
  reference. Each call makes 4 workspace calls (2 dispatches, 2 expert_combines), one after another on the held
  rank: so the calls take at least calls * 4 * delay_us (which shows that the delay reached the custom calls)."""
  layer = Layer(mesh, "skewed", seed)
  args = layer.args(jnp.bfloat16)
  plain_run = layer.overlap()
  plain = bits(plain_run(*args))
  held_run = layer.overlap(jmo.CallConfig(delay_rank=delay_rank, delay_us=delay_us))
  jax.block_until_ready(held_run(*args))  # compiles
  start = time.perf_counter()
  for i in range(calls):
    held = held_run(*args)
    same = [a == b for a, b in zip(bits(held), plain)]
    assert all(same), f"call {i} with rank {delay_rank} held back differs from the undelayed call: {same}"
    assert held_run.aliased == held_run.buffers, f"call {i}: {held_run.aliased} of {held_run.buffers} poisoned"
  took_us = (time.perf_counter() - start) * 1e6
  errs = errors(held, layer.reference())
  print(f"R={layer.R} rank {delay_rank} held back {delay_us} us: {calls} calls in {took_us / 1e3:.1f} ms, bitwise "
        f"equal to the undelayed one; {_fmt(errs)}")
  assert took_us >= calls * 4 * delay_us, f"{calls} calls took {took_us:.0f} us: was rank {delay_rank} held back?"
  assert all(v < TOL for v in errs.values()), errs
  assert plain_run.aliased == plain_run.buffers


@contextlib.contextmanager
def grouped_matmul_gemms():
  """The layer with the bare grouped GEMM custom calls on every platform: ``jmo_grouped_matmul_swiglu`` as GEMM1 (its
  preactivation kept as the layer asks: in the forward of a training step) and ``jmo_grouped_matmul`` for the other
  grouped matmuls (the backward's d_out W2^T in expert_gemms.dgrad_dtype, its SwiGLU gradient by XLA: not the fused
  grouped_matmul_swiglu_grad, which the layer runs on Hopper). These are the two calls that dispatch_gemm equals bit for
  bit: the dispatch + grouped_matmul_swiglu of the forward, the dispatch + grouped_matmul of the backward. On CPU the
  default runs XLA's ragged_dot and SwiGLU there (faster), whose float32 sums go in another order than the CPU handlers'
  row loop, which dispatch_gemm's CPU handler shares with the bare ones (and their SwiGLU). Traced programs are dropped
  on entry and exit, so that no program traced on one side runs on the other."""
  def ours(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=jnp.float32):
    return grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)

  def gemm1_swiglu(x_recv, w1, group_sizes, keep_a):
    return grouped_matmul_swiglu(x_recv, w1, group_sizes, keep_preactivation=keep_a,
                                 preactivation_dtype=expert_gemms.kept_preactivation_dtype(x_recv.dtype))

  def gemm2_grad_swiglu_grad(d_out, w2, group_sizes, a, out_dtype):
    dh = ours(d_out, w2, group_sizes, transpose_rhs=True, out_dtype=expert_gemms.dgrad_dtype(d_out.dtype))
    return expert_gemms.swiglu_grad(a, dh, out_dtype)

  def forget():
    api._programs.clear()  # pylint: disable=protected-access
    jax.clear_caches()

  plain = expert_gemms.matmul, expert_gemms.gemm1_swiglu, expert_gemms.gemm2_grad_swiglu_grad
  forget()
  expert_gemms.matmul, expert_gemms.gemm1_swiglu, expert_gemms.gemm2_grad_swiglu_grad = (ours, gemm1_swiglu,
                                                                                         gemm2_grad_swiglu_grad)
  try:
    yield
  finally:
    expert_gemms.matmul, expert_gemms.gemm1_swiglu, expert_gemms.gemm2_grad_swiglu_grad = plain
    forget()


def check_dispatch_gemm(mesh, pushers=2, seed=13, x_recv_from_tiles=True):
  """CallConfig(dispatch_pushers=...) (the dispatch and GEMM1 with its SwiGLU in one dispatch_gemm call, and the
  backward's dispatch with d_out W2^T in another: on a Hopper GPU the fused kernel, on CPU its handler): forward and
  gradients bitwise equal to the two calls with jmo_grouped_matmul_swiglu as GEMM1 and jmo_grouped_matmul for the
  backward's d_out W2^T (``grouped_matmul_gemms``), and within TOL of the reference, every output computed into the
  poison. x_recv_from_tiles: CallConfig's (the fused kernels' x_recv, which the weight gradients' GEMMs read, stored
  by their GEMM tiles, the default, or copied by the side units)."""
  layer = Layer(mesh, "skewed", seed)
  args = layer.args(jnp.bfloat16)
  with grouped_matmul_gemms():
    plain = bits(layer.overlap()(*args))
  fused_run = layer.overlap(jmo.CallConfig(dispatch_pushers=pushers, x_recv_from_tiles=x_recv_from_tiles))
  fused = fused_run(*args)
  same = [a == b for a, b in zip(bits(fused), plain)]
  errs = errors(fused, layer.reference())
  print(f"R={layer.R} dispatch_pushers={pushers} x_recv_from_tiles={x_recv_from_tiles}: bitwise equal to two calls "
        f"{same}; {_fmt(errs)}")
  assert all(same), f"dispatch_pushers={pushers} differs from two calls: {same} (loss, y, dropped, dx, dg, dw1, dw2)"
  assert all(v < TOL for v in errs.values()), errs
  assert fused_run.aliased == fused_run.buffers


def check_repeats(mesh, calls, seed=5):
  """``calls`` consecutive jitted forward calls, each into a freshly poisoned output: all bitwise identical to the
  first, which is within TOL of the reference."""
  layer = Layer(mesh, "skewed", seed, tokens=128, d=128, f=192)
  fwd = Poisoned(lambda x, g, a, b: jmo.moe_experts(x, layer.ids, g, a, b, mesh=mesh)[0], mesh)
  args = layer.args(jnp.bfloat16)
  first = fwd(*args)
  x, gates, w1, w2 = layer.args(jnp.float32)
  y_ref, _ = jmo.moe_experts(x, layer.ids, gates, w1, w2, mesh=mesh, impl="reference")
  assert np.isfinite(np.asarray(first, np.float32)).all()
  err = rel_err(first, y_ref)
  assert err < TOL, err
  outs, aliased = [], [fwd.aliased]
  for _ in range(calls - 1):
    outs.append(fwd(*args))
    aliased.append(fwd.aliased)
  first_bits = bits(first)[0]
  diffs = sum(int(bits(o)[0] != first_bits) for o in outs)
  print(f"R={layer.R}: {calls} consecutive calls, {diffs} differ from the first; y err {err:.2e}; poisoned outputs "
        f"{min(aliased)}/{fwd.buffers} (fewest over the calls)")
  assert diffs == 0, f"{diffs} of {calls - 1} repeated calls differ from the first"
  assert min(aliased) == fwd.buffers


def check_module(mesh, seed=3):
  """The Flax NNX MoE module (router + experts) in bf16 vs the float32 reference module with the same parameters:
  loss, output and the gradients of every parameter, through nnx.jit + nnx.value_and_grad. (Its outputs are XLA's
  casts of the layer's, so there is no custom-call output to poison here.)"""
  R = mesh.shape[AXIS]
  models = [jmo.MoE(jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, dtype=dtype),
                    mesh=mesh, impl=impl, rngs=nnx.Rngs(seed))
            for impl, dtype in (("overlap", jnp.bfloat16), ("reference", jnp.float32))]
  x = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, TOKENS // 2, D)).astype(jnp.bfloat16).astype(jnp.float32)
  target = jax.random.normal(jax.random.PRNGKey(seed + 2), x.shape, jnp.float32)

  def loss_fn(m):
    y, aux = m(x)
    return jnp.mean((y - target) ** 2) + 0.01 * aux.load_balance_loss, y

  step = nnx.jit(lambda m: nnx.value_and_grad(loss_fn, has_aux=True)(m))
  ((l, y), g), ((l_ref, y_ref), g_ref) = [step(m) for m in models]
  errs = {"loss": abs(float(l) - float(l_ref)) / abs(float(l_ref)), "y": rel_err(y, y_ref)}
  for name in ("router", "w1", "w2"):
    a = np.asarray(getattr(g, name)[...], np.float32)
    assert np.isfinite(a).all(), name
    assert np.abs(a).max() > 0, name
    errs["d" + name] = rel_err(a, getattr(g_ref, name)[...])
  print(f"R={R} module: {_fmt(errs)}")
  assert all(v < TOL for v in errs.values()), errs


def check_counts_through_the_workspace(mesh, monkeypatch, num_experts=8, seed=3):
  """The layer with its routing counts through the workspace (exchange_counts, and the dropped slots from the
  exchanged counts: the path of groups spanning processes, forced in one process by patching
  ``Workspace.spans_processes`` with ``monkeypatch``) equals the layer through all_gather bit for bit, outputs and
  gradients, and counts the same dropped slots (capacity factor 0.5); only its program holds the custom call."""
  from jax_moe_overlap.workspace import Workspace, release_workspaces  # pylint: disable=g-import-not-at-top
  x, ids, gates, w1, w2 = layer_inputs(64, 16, 24, num_experts, 2, "skewed", seed)

  def run():
    f = jax.jit(jax.value_and_grad(lambda x, g, w1, w2: jnp.sum(jnp.sin(jmo.moe_experts(x, ids, g, w1, w2,
                                                                                         mesh=mesh)[0])),
                                   argnums=(0, 1, 2, 3)))
    hlo = f.lower(x, gates, w1, w2).compile().as_text()
    dropped = jax.jit(lambda x, g, w1, w2: jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, capacity_factor=0.5)[1])
    return "jmo_exchange_counts" in hlo, jax.tree.map(np.asarray, (f(x, gates, w1, w2), dropped(x, gates, w1, w2)))

  release_workspaces()
  try:
    exchanged, plain = run()
    assert int(plain[1]) > 0, "the capacity factor drops slots"
    assert not exchanged
    release_workspaces()  # the programs compiled against the gather path go with their workspace
    monkeypatch.setattr(Workspace, "spans_processes", property(lambda self: True))
    exchanged, through_workspace = run()
    assert exchanged
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(through_workspace)):
      assert a.tobytes() == b.tobytes()
  finally:
    release_workspaces()


def padding_poisoned_runs(monkeypatch, module, name: str, run_layer):
  """Runs run_layer() three times with `module.name` (a fused dispatch call whose results' rows past the rank's kept
  rows, plan.recv_rows, are left unwritten) wrapped: as is; with every result's rows past the kept ones poisoned (NaN,
  0xff bytes in uint8 results); and with one kept row poisoned too (a control that must reach a consumer). Returns
  (as_is, padded, control, the results poisoned per traced call). Each run starts from no cached program."""
  real = getattr(module, name)
  counts = []

  def poisoning(extra_rows):
    def call(src, slot_src_row, w, plan, cap, info, **kw):
      got = real(src, slot_src_row, w, plan, cap, info, **kw)
      pad = jnp.arange(cap)[:, None] >= plan.recv_rows - extra_rows

      def poison(v):
        return jnp.where(pad, jnp.uint8(0xff) if v.dtype == jnp.uint8 else jnp.asarray(jnp.nan, v.dtype), v)
      counts.append(len(jax.tree.leaves(got)))
      return jax.tree.map(poison, got)
    return call

  def run(extra_rows=None):
    api._programs.clear()  # pylint: disable=protected-access
    jax.clear_caches()
    if extra_rows is not None:
      monkeypatch.setattr(module, name, poisoning(extra_rows))
    try:
      return run_layer()
    finally:
      monkeypatch.setattr(module, name, real)
      api._programs.clear()  # pylint: disable=protected-access
      jax.clear_caches()

  return run(), run(extra_rows=0), run(extra_rows=1), counts
