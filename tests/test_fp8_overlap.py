"""impl="overlap" under quantization="fp8" (fp8_overlap.py) on 4 CPU devices: outputs and gradients equal
impl="collective"'s under fp8 bit for bit (the same quantized rows reach the same FP8 GEMM emulation; only the
transport differs), on meshes with Auto and Explicit axes, with capacity drops and skipped slots (expert id -1), batch
axes and send once, and to the layer dtype's rounding with a tensor axis; x's rows cross the dispatch custom call as
packed e4m3 rows (uint8, D + D / 32 bytes) and the expert outputs come back in the compute dtype, read on the lowered
program; the calls that compute refuse packed rows with errors naming the rule; MoE and MoEBlock run FP8 on the
default impl; the workspace counts FP8 rows by the native RowBytes."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
import layer_checks
from cases import layer_inputs, mesh_of, moe_config, rel_err
from jax_moe_overlap import fp8
from jax_moe_overlap import call_site
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import workspace_calls
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.plan import SKIP
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes, layer_sizes, row_bytes
from tensor_parallel_checks import mesh_of_shape
from test_expert_combine import _raw_call
from test_fp8_exchange import bits, layer_grads

E, T, D, F, K = 8, 64, 128, 256, 2
ROW = D + D // 32                  # a packed e4m3 row: D values and D / 128 float32 scales


def fp8_inputs(dtype, seed):
  """x, ids (skewed, about a fifth of the slots SKIP and every seventh token skipping both), gates, float32 master
  weights, and the output cotangent."""
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", seed, dtype=dtype)
  rng = np.random.default_rng(seed + 1)
  ids = np.where(rng.random(ids.shape) < 0.2, SKIP, np.asarray(ids))
  ids[::7] = SKIP
  cot = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  return x, jnp.asarray(ids.astype(np.int32)), gates, w1.astype(jnp.float32), w2.astype(jnp.float32), cot


CASES = {
    "explicit-bf16-drops": dict(shape={"expert": 4}, explicit=True, dtype=jnp.bfloat16, cf=0.5),
    "auto-f32-drops": dict(shape={"expert": 4}, dtype=jnp.float32, cf=0.75),
    "auto-bf16-dropless-send-once": dict(shape={"expert": 4}, dtype=jnp.bfloat16,
                                         config=CallConfig(send_once=True)),
    "explicit-batch-f32": dict(shape={"data": 2, "expert": 2}, explicit=True, dtype=jnp.float32, cf=0.75,
                               batch_axes=("data",)),
    "auto-one-rank-bf16": dict(shape={"expert": 1}, dtype=jnp.bfloat16, cf=0.5),
    "auto-bf16-drops-bf16-wgrad": dict(shape={"expert": 4}, dtype=jnp.bfloat16, cf=0.75,
                                       quantization="fp8_bf16_wgrad"),
}
DEFAULT_PASS = ("explicit-bf16-drops",)   # each case compiles two layers' forward and backward


@pytest.fixture(params=["fused", "unfused"])
def returns(request, monkeypatch):
  """Runs a test on both FP8 overlap paths: the returns fused by expert_combine on e4m3 operands (every CPU's, the
  GPUs' with call_site.FP8_FUSED_COMBINE_ON_GPU, the default) and unfused (GEMM2, then a dispatch of its rows back).
  The call sites built after the patch carry the choice (RankInfo.fp8_fused_combine), so the programs cached per
  call site are the path's own."""
  if request.param == "unfused":
    monkeypatch.setattr(call_site, "fp8_fused_combine", lambda platform: False)
  return request.param


@pytest.mark.parametrize("name", [n if n in DEFAULT_PASS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_overlap_equals_collective_bit_for_bit(name, returns):
  del returns
  overlap_equals_collective(name, CASES[name].get("config", CallConfig()))


# impl="collective"'s outputs and gradients by (case name, CallConfig): its program is the same on both return paths
# (the `returns` fixture's patch reaches impl="overlap"'s call sites only), so each case and configuration compiles
# and runs it once in this module, whichever tests and return paths compare against it.
_COLLECTIVE = {}


def overlap_equals_collective(name, config):
  """Case `name`'s layer outputs and gradients under impl="overlap" with `config` against impl="collective", bit for
  bit; returns the overlap layer's lowered program."""
  c = CASES[name]
  batch_axes, explicit = c.get("batch_axes", ()), c.get("explicit", False)
  mesh = mesh_of_shape(c["shape"], explicit)
  x, ids, gates, w1, w2, cot = fp8_inputs(c["dtype"], 21)
  if explicit:
    x = jax.device_put(x, NamedSharding(mesh, P((*batch_axes, "expert"))))
    w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  run = lambda impl: jax.jit(layer_grads(mesh, ids, cot, impl, c.get("cf"), None, batch_axes, config,
                                         c.get("quantization", "fp8")))
  overlap = run("overlap")
  (_, (y, dropped)), grads = overlap(x, gates, w1, w2)
  if (name, config) not in _COLLECTIVE:
    _COLLECTIVE[name, config] = run("collective")(x, gates, w1, w2)
  (_, (y_ref, dropped_ref)), grads_ref = _COLLECTIVE[name, config]
  assert (int(dropped) > 0) == (c.get("cf") is not None) and int(dropped) == int(dropped_ref)
  assert y.dtype == c["dtype"] and grads[0].dtype == c["dtype"] and grads[2].dtype == jnp.float32
  if explicit:
    assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec
  for what, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y, *grads), (y_ref, *grads_ref)):
    assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0, what
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)
  # A token that skips both choices gets y = 0 and dx = 0 (no row moved for it).
  assert not np.any(np.asarray(y.astype(jnp.float32))[0]) and not np.any(np.asarray(grads[0].astype(jnp.float32))[0])
  return overlap.lower(x, gates, w1, w2).as_text()


def test_fused_returns_serialized_pinned_and_prequantized():
  """The fused FP8 returns (two expert_combine calls on e4m3 operands) give the default call's bits serialized
  (each consumer after its producer's last tile) and with a pinned consumer count; and with pre-quantized weights
  (fp8.quantize_weights: inference) y, dx and dgates equal impl="collective"'s on the same Fp8Weight bit for bit."""
  mesh = mesh_of(4)
  x, ids, gates, w1, w2, cot = fp8_inputs(jnp.bfloat16, 8)
  run = lambda cfg, impl="overlap": jax.jit(layer_grads(mesh, ids, cot, impl, 0.75, None, (), cfg))(x, gates, w1, w2)
  want = run(jmo.CallConfig())
  for cfg in (jmo.CallConfig(serialize=True), jmo.CallConfig(consumer_ctas=1)):
    for a, b in zip(jax.tree.leaves(run(cfg)), jax.tree.leaves(want)):
      np.testing.assert_array_equal(bits(a), bits(b), err_msg=str(cfg))
  w1q, w2q = fp8.quantize_weights(w1, w2)

  def xg_grads(impl):
    def loss(x, gates):
      y, _ = jmo.moe_experts(x, ids, gates, w1q, w2q, mesh=mesh, impl=impl, capacity_factor=0.75,
                             quantization="fp8")
      return jnp.sum(y.astype(jnp.float32) * cot), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, gates)

  (_, y), grads = xg_grads("overlap")
  (_, y_ref), grads_ref = xg_grads("collective")
  for what, a, b in zip(("y", "dx", "dgates"), (y, *grads), (y_ref, *grads_ref)):
    assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0, what
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)


def dispatch_operands(hlo: str, target: str) -> list[tuple[str, ...]]:
  """The operand types of each custom call to ``target`` in a lowered (StableHLO) program, in program order."""
  found = []
  for line in hlo.splitlines():
    if f"@{target}(" in line:
      operands = re.search(r":\s*\((.*)\)\s*->", line).group(1)
      found.append(tuple(re.findall(r"tensor<[^>]*>", operands)))
  return found


def test_rows_cross_the_dispatch_in_fp8(returns):
  """The lowered forward and backward: x's rows and the slots' output gradients dispatched as uint8 rows of
  D + D / 32 bytes (0.516 of bfloat16's 2D); fused, GEMM2 and the way back one expert_combine on e4m3 h and w2, and
  the input gradient's GEMM and its way back one on e4m3 da and W1^T (their results in bfloat16); unfused, the
  expert outputs and the input gradient back in bfloat16 by dispatches; no dispatch_gemm (it takes no packed
  rows)."""
  mesh = mesh_of(4)
  x, ids, gates, w1, w2, cot = fp8_inputs(jnp.bfloat16, 3)
  hlo = jax.jit(layer_grads(mesh, ids, cot, "overlap", 0.5, None, ())).lower(x, gates, w1, w2).as_text()
  assert "@jmo_dispatch_gemm(" not in hlo and "@jmo_grouped_matmul_fp8(" in hlo  # (the backward's dgrads)
  rows = [ops[0] for ops in dispatch_operands(hlo, "jmo_dispatch")]   # (the CPU calls' ordering token: no tensor)
  t, p, cap = T // 4, T // 4 * K, plan_lib.recv_capacity(T // 4, 4, K, E // 4, plan_lib.expert_capacity(
      T // 4, 4, K, E, 0.5))
  if returns == "unfused":  # the expert outputs and the input gradient back in bfloat16 by dispatches
    assert rows == [f"tensor<{t}x{ROW}xui8>", f"tensor<{cap}x{D}xbf16>", f"tensor<{p}x{ROW}xui8>",
                    f"tensor<{cap}x{D}xbf16>"], rows
    assert "@jmo_expert_combine(" not in hlo
    return
  assert rows == [f"tensor<{t}x{ROW}xui8>", f"tensor<{p}x{ROW}xui8>"], rows
  combines = [ops[:2] for ops in dispatch_operands(hlo, "jmo_expert_combine")]
  assert combines == [(f"tensor<{cap}x{F}xf8E4M3FN>", f"tensor<{E // 4}x{D}x{F}xf8E4M3FN>"),
                      (f"tensor<{cap}x{2 * F}xf8E4M3FN>", f"tensor<{E // 4}x{D}x{2 * F}xf8E4M3FN>")], combines
  results = [re.findall(r"tensor<[^>]*>", line.split("->")[1]) for line in hlo.splitlines()
             if "@jmo_expert_combine(" in line]
  assert [r[-2] for r in results] == [f"tensor<{T // 4}x{D}xbf16>"] * 2, results  # y, then dx
  assert ROW / (2 * D) == pytest.approx(0.516, abs=1e-3)
  # Without quantization the same layer dispatches bfloat16 rows of 2D bytes.
  plain = jax.jit(lambda x: jmo.moe_experts(x, ids, gates, w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16),
                                            mesh=mesh, capacity_factor=0.5)[0]).lower(x).as_text()
  assert [ops[0] for ops in dispatch_operands(plain, "jmo_dispatch")] == [f"tensor<{t}x{D}xbf16>"]


def test_one_rank_moves_rows_by_gathers():
  """On a one-rank expert axis no row crosses a link: impl="overlap" under FP8 takes impl="collective"'s block
  (xla_path.fp8_one_rank_block: XLA's gathers within the device), so the program has no dispatch call."""
  mesh = mesh_of(1)
  x, ids, gates, w1, w2, cot = fp8_inputs(jnp.bfloat16, 3)
  hlo = jax.jit(layer_grads(mesh, ids, cot, "overlap", 0.5, None, ())).lower(x, gates, w1, w2).as_text()
  assert "@jmo_dispatch(" not in hlo and "@jmo_grouped_matmul_fp8(" in hlo


def _workspace(mesh, row):
  return RankInfo(Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=row, recv_rows=64, ret_rows=64,
                                                               num_segments=E)), CallConfig(timeout_ms=5000))


def _plan_of(ids, R, cap_e):
  rank = jax.lax.axis_index("expert").astype(jnp.int32)
  counts_all = jax.lax.all_gather(plan_lib.local_counts(ids, E).reshape(R, E // R), "expert")
  return plan_lib.make_plan(ids, counts_all, rank, cap_e)


def test_packed_rows_move_unchanged_through_dispatch():
  """dispatch of packed e4m3 rows (uint8) at R = 4 with drops and skipped slots: every rank's recv rows are its
  slots' packed rows byte for byte (values and scales), the rows past them zero, as a NumPy model of the plan
  says."""
  mesh, R, tokens = mesh_of(4), 4, 16
  ids = np.asarray(fp8_inputs(jnp.bfloat16, 5)[1])
  cap_e = plan_lib.expert_capacity(tokens, R, K, E, 0.5)
  cap = plan_lib.recv_capacity(tokens, R, K, E // R, cap_e)
  info = _workspace(mesh, 2 * D)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((tokens * R, D)).astype(np.float32))
  packed = fp8.pack_rows(*fp8.quantize_rows(x, pow2=True))

  def local(ids, rows):
    plan = _plan_of(ids, R, cap_e)
    recv = workspace_calls.dispatch(rows, jnp.arange(tokens * K, dtype=jnp.int32) // K, plan, cap, info)
    return recv, plan.slot_dest_rank, plan.slot_dest_row

  spec = P("expert")
  recv, dest_rank, dest_row = (np.asarray(a) for a in jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 3, check_vma=False))(jnp.asarray(ids), packed))
  assert recv.dtype == np.uint8 and recv.shape == (R * cap, ROW)
  src = np.asarray(packed).reshape(R, tokens, ROW)
  want = np.zeros((R, cap, ROW), np.uint8)
  for s in range(R):
    for p in range(tokens * K):
      if dest_row[s * tokens * K + p] >= 0:
        want[dest_rank[s * tokens * K + p], dest_row[s * tokens * K + p]] = src[s, p // K]
  assert 0 < np.count_nonzero(want.any(axis=2)) < R * cap
  np.testing.assert_array_equal(recv.reshape(R, cap, ROW), want)


def test_calls_that_compute_refuse_packed_rows():
  """dispatch takes packed rows of whole 132-byte tiles only; dispatch_gemm and expert_combine (their handlers,
  past the Python wrappers, and the wrappers themselves) refuse packed rows naming what takes them."""
  mesh, R, tokens = mesh_of(4), 4, 8
  ids = jnp.asarray(np.random.default_rng(1).integers(0, E, (tokens * R, K)).astype(np.int32))
  cap_e = plan_lib.expert_capacity(tokens, R, K, E, None)
  cap = plan_lib.recv_capacity(tokens, R, K, E // R, cap_e)
  info = _workspace(mesh, 2 * D)
  slot_rows = jnp.arange(tokens * K, dtype=jnp.int32) // K
  spec = P("expert")

  def run(f, *args, outs=1):
    out_specs = spec if outs == 1 else (spec,) * outs
    return jax.block_until_ready(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * len(args),
                                                       out_specs=out_specs, check_vma=False))(*args))

  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch: uint8 rows are packed e4m3 rows of whole 1 x 128 tiles (132 bytes per tile: the values, then the "
      "tile's float32 scale), so their width must be a positive multiple of 132; got src [8, 130]")):
    run(lambda ids, x: workspace_calls.dispatch(x, slot_rows, _plan_of(ids, R, cap_e), cap, info), ids,
        jnp.zeros((tokens * R, 130), jnp.uint8))
  rows = jnp.zeros((tokens * R, ROW), jnp.uint8)
  w = jnp.zeros((E, ROW, 256), jnp.uint8)
  packed_rule = r"; got uint8 \(packed e4m3 rows\): only dispatch \(which moves them unchanged\) and dispatch_gemm"
  u8 = lambda *s: jax.ShapeDtypeStruct(s, jnp.uint8)
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch_gemm: packed e4m3 rows (uint8 src) need w float8_e4m3fn [E_local, N, D] with its block scales "
      "(dispatch_gemm_fp8)")):
    run(lambda ids, x, w: workspace_calls._dispatch_gemm_call(  # pylint: disable=protected-access
        x, slot_rows, w, _plan_of(ids, R, cap_e), info,
        (u8(cap, ROW), jax.ShapeDtypeStruct((cap, 256), jnp.float32), jax.ShapeDtypeStruct((0, 256), jnp.float32)),
        False, False), ids, rows, w, outs=3)
  one = RankInfo(Workspace.get(mesh_of(1), "expert", WorkspaceSizes(row_bytes=2 * D, recv_rows=16, ret_rows=8,
                                                                     num_segments=2)), CallConfig())
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"expert_combine: lhs, w and outputs must share one dtype, "
                                                       r"float32 or bfloat16 .*" + packed_rule):
    jax.block_until_ready(jax.jit(functools.partial(_raw_call, info=one), static_argnums=(2, 3))(
        jnp.zeros((16, ROW), jnp.uint8), jnp.zeros((2, ROW, 256), jnp.uint8), 256, False))
  plan = object()  # the wrappers refuse before they read it
  with pytest.raises(TypeError, match=r"dispatch_gemm: src is uint8 \(packed e4m3 rows, fp8.pack_rows\): "
                                      r"dispatch_gemm's GEMM takes float32 or bfloat16 rows"):
    workspace_calls.dispatch_gemm(rows, slot_rows, w, plan, cap, info)
  with pytest.raises(TypeError, match=r"expert_combine: lhs is uint8 \(packed e4m3 rows, fp8.pack_rows\)"):
    workspace_calls.expert_combine(rows, w, jnp.ones((tokens, K)), plan, info, want_slots=False)
  # The refused calls opened no epoch: the next call (packed rows of whole tiles) runs.
  ones = jnp.ones((tokens * R, ROW), jnp.uint8)
  recv = run(lambda ids, x: workspace_calls.dispatch(x, slot_rows, _plan_of(ids, R, cap_e), cap, info), ids, ones)
  assert recv.shape == (R * cap, ROW) and int(jnp.sum(recv.astype(jnp.int32))) == tokens * R * K * ROW


def test_expert_combine_fp8_refuses_what_it_cannot_take():
  """expert_combine on e4m3 operands: the handler (past the wrapper) and the wrapper refuse what the FP8 producer
  cannot take, naming the rule; then a call on well-formed e4m3 operands runs (no refused call left an epoch open)."""
  info = RankInfo(Workspace.get(mesh_of(1), "expert", WorkspaceSizes(row_bytes=2 * 256, recv_rows=16, ret_rows=8,
                                                                      num_segments=2)), CallConfig())
  e4m3 = lambda *s: jnp.ones(s, fp8.E4M3)
  f32 = lambda *s: jnp.ones(s, jnp.float32)

  def call(lhs, w, n_out, transpose_rhs, scales, out_dtype=jnp.bfloat16):
    f = jax.jit(functools.partial(_raw_call, info=info, scales=scales, out_dtype=out_dtype), static_argnums=(2, 3))
    return jax.block_until_ready(f(lhs, w, n_out, transpose_rhs))

  good = (f32(1, 16), f32(2, 2, 1))  # lhs_scales [K/128, ld], w_scales [E_local, N/128, K/128]
  cases = [
      ((e4m3(16, 128), jnp.ones((2, 256, 128), jnp.bfloat16), 256, True, good),
       "lhs float8_e4m3fn needs w float8_e4m3fn"),
      ((e4m3(16, 128), e4m3(2, 128, 256), 256, False, good),
       r"e4m3 w must be \[E_local, N, K\] \(K-major: transpose_rhs\)"),
      ((e4m3(16, 192), e4m3(2, 256, 192), 256, True, (f32(1, 16), f32(2, 2, 1))),
       "K and N must be positive multiples of 128"),
      ((e4m3(16, 128), e4m3(2, 256, 128), 256, True, (f32(1, 15), good[1])),
       r"lhs_scales must be \[K/128, ld\] with ld >= cap and a multiple of 4"),
      ((e4m3(16, 128), e4m3(2, 256, 128), 256, True, (good[0], f32(2, 1, 1))),
       r"w_scales must be \[E_local, N/128, K/128\] = \[2, 2, 1\]"),
      ((f32(16, 128), f32(2, 128, 256), 256, False, good),
       "lhs_scales and w_scales are the e4m3 operands' \\(empty for float32 lhs and w\\)"),
      ((e4m3(0, 128), e4m3(2, 256, 128), 256, True, (f32(1, 0), good[1])),
       r"e4m3 lhs needs cap \(its rows\) in \[1, 2\^31 - 128\), got 0"),
  ]
  for args, rule in cases:
    out_dtype = args[0].dtype if args[0].dtype == jnp.float32 else jnp.bfloat16
    with pytest.raises(jax.errors.JaxRuntimeError, match="expert_combine: " + rule):
      call(*args, out_dtype=out_dtype)
  plan = object()  # the wrapper refuses before it reads it
  weight = fp8.Fp8Weight(e4m3(2, 256, 192), f32(2, 2, 1))
  with pytest.raises(ValueError, match=r"expert_combine_fp8: K and N must be positive multiples of 128"):
    workspace_calls.expert_combine_fp8(e4m3(16, 192), f32(16, 1), weight, f32(4, 2), plan, info, False,
                                       jnp.bfloat16)
  with pytest.raises(TypeError, match=r"expert_combine_fp8: preferred_element_type must be float32 or bfloat16"):
    workspace_calls.expert_combine_fp8(e4m3(16, 128), f32(16, 1), fp8.Fp8Weight(e4m3(2, 256, 128), good[1]),
                                       f32(4, 2), plan, info, False, jnp.float16)
  y, _ = call(e4m3(16, 128), e4m3(2, 256, 128), 256, True, good)
  assert y.shape == (4, 256) and y.dtype == jnp.bfloat16


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_moe_and_moe_block_fp8_on_the_default_impl():
  """MoE and MoEBlock with quantization="fp8" and no impl given (impl="overlap") equal impl="collective" bit for
  bit: MoE's output and parameter gradients, MoEBlock's output."""
  mesh = mesh_of(4)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=128, num_experts=E, num_experts_per_tok=K, quantization="fp8",
                   dtype=jnp.bfloat16, capacity_factor=1.0)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 32, D)).astype(np.float32)).astype(jnp.bfloat16)

  def run(module, impl):
    kw = {} if impl is None else dict(impl=impl)
    m = module(cfg, mesh=mesh, rngs=nnx.Rngs(0), **kw)
    assert m.impl == (impl or "overlap")
    if module is jmo.MoEBlock:
      return nnx.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x)[0])(m, x)
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)[0].astype(jnp.float32)))
    return nnx.jit(nnx.value_and_grad(loss))(m, x)

  for module in (jmo.MoE, jmo.MoEBlock):
    got, want = run(module, None), run(module, "collective")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0
      np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.slow  # two layers' forward and backward
@pytest.mark.parametrize("config", [CallConfig(), CallConfig(dispatch_pushers=2)], ids=["two-calls", "fused-dispatch"])
def test_tensor_axis_within_rounding_of_collective(returns, config):
  """A tensor axis (expert=2, tensor=2, Explicit): the shards' partial outputs and input gradients come back per slot
  in bfloat16 (impl="overlap"'s shard slots) where impl="collective" sums them in float32 by its reduce-scatter;
  the results agree to bfloat16's rounding and the weight gradients (each shard's own) bit for bit; with the
  dispatches fused (dispatch_gemm_fp8 on the shard slots' packed rows) alike."""
  del returns
  mesh = mesh_of_shape({"expert": 2, "tensor": 2}, explicit=True)
  x, ids, gates, w1, w2, cot = fp8_inputs(jnp.bfloat16, 21)
  x = jax.device_put(x, NamedSharding(mesh, P(("expert", "tensor"))))
  w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  run = lambda impl, cfg=config: jax.jit(layer_grads(mesh, ids, cot, impl, 0.5, "tensor", (), cfg))(x, gates, w1, w2)
  (_, (y, dropped)), grads = run("overlap")
  if config.dispatch_pushers:  # the fused calls on the shard slots' packed rows: bitwise the two calls
    hlo = jax.jit(layer_grads(mesh, ids, cot, "overlap", 0.5, "tensor", (), config)).lower(x, gates, w1, w2).as_text()
    assert hlo.count("@jmo_dispatch_gemm(") == 2, hlo.count("@jmo_dispatch_gemm(")
    (_, (y2, _)), grads2 = run("overlap", CallConfig())
    for a, b in zip(jax.tree.leaves((y, grads)), jax.tree.leaves((y2, grads2))):
      np.testing.assert_array_equal(bits(a), bits(b))
  (_, (y_ref, dropped_ref)), grads_ref = run("collective")
  assert int(dropped) == int(dropped_ref) > 0
  for what, a, b in zip(("y", "dx", "dgates"), (y, *grads[:2]), (y_ref, *grads_ref[:2])):
    assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0 and rel_err(a, b) < 1e-2, (what, rel_err(a, b))
  for what, a, b in zip(("dw1", "dw2"), grads[2:], grads_ref[2:]):
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)


def test_pinned_gather_rs_refused_under_fp8():
  mesh = mesh_of_shape({"expert": 2, "tensor": 2})
  x, ids, gates, w1, w2, _ = fp8_inputs(jnp.bfloat16, 2)
  with pytest.raises(ValueError, match=r"CallConfig\(tensor_reduce='gather_rs'\) does not run under "
                                       r"quantization='fp8': .*GatherRS's GEMM2 producer takes no e4m3 operands"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, tensor_axis="tensor", quantization="fp8",
                    config=CallConfig(tensor_reduce="gather_rs"))


def test_workspace_counts_fp8_rows_by_row_bytes():
  """The native RowBytes: D + D / 32 bytes for a packed row (7,392 at D = 7168, DeepEP's), 2D and 4D for the
  compute dtypes; an FP8 layer's workspace holds the widest row it moves (the compute dtype's: the return) and as
  many recv rows as the slots (the return lands in recv rows)."""
  assert row_bytes("uint8", 7168) == 7392 and row_bytes(jnp.bfloat16, 7168) == 14336
  assert row_bytes(jnp.float32, 128) == 512 and row_bytes("uint8", 128) == ROW
  with pytest.raises(ValueError, match=r"row dtype 'int8' is none of float32, bfloat16 or uint8 \(packed e4m3"):
    row_bytes("int8", 128)
  plain = layer_sizes(16, 4, K, E, D, 2, 0.5)
  q = layer_sizes(16, 4, K, E, D, 2, 0.5, quantization="fp8")
  assert plain.recv_rows < 16 * K and q.recv_rows == 16 * K and q.row_bytes == plain.row_bytes == 2 * D
  assert jmo.workspace_bytes(64, D, K, E, ranks=4, dtype=jnp.bfloat16, capacity_factor=0.5,
                             quantization="fp8") > jmo.workspace_bytes(64, D, K, E, ranks=4, dtype=jnp.bfloat16,
                                                                       capacity_factor=0.5)


# The plan functions jitted for the test below (the ranks run them traced, inside their shard_map): a program each,
# where the eager calls compile each of their operations.
_local_counts = jax.jit(plan_lib.local_counts, static_argnums=1)
_make_plan = jax.jit(plan_lib.make_plan, static_argnums=3)
_packed_rows = jax.jit(plan_lib.packed_rows, static_argnums=3)
_packed_return = jax.jit(plan_lib.packed_return, static_argnums=(2, 3))


def test_packed_return_inverts_packed_rows():
  """plan.packed_return sends each recv row to the row packed_rows gives its slot on the source, on a 4-rank
  routing with drops and skipped slots (computed for every rank from the same counts, as the ranks do)."""
  R, tokens = 4, 16
  ids = np.asarray(fp8_inputs(jnp.bfloat16, 9)[1]).reshape(R, tokens, K)
  cap_e = plan_lib.expert_capacity(tokens, R, K, E, 0.5)
  cap = plan_lib.recv_capacity(tokens, R, K, E // R, cap_e)
  counts = jnp.stack([_local_counts(jnp.asarray(i), E).reshape(R, E // R) for i in ids])
  plans = [_make_plan(jnp.asarray(ids[r]), counts, jnp.int32(r), cap_e) for r in range(R)]
  packed = [np.asarray(_packed_rows(jnp.asarray(ids[r]), counts, jnp.int32(r), cap_e, plans[r])[0])
            for r in range(R)]
  for r in range(R):   # packed_rows' second result is the inverse map
    slot = np.asarray(_packed_rows(jnp.asarray(ids[r]), counts, jnp.int32(r), cap_e, plans[r])[1])
    kept = int(plans[r].ret_rows)
    assert np.all(packed[r][slot[:kept]] == np.arange(kept)) and np.all(slot[kept:] == tokens * K)
  back = [tuple(np.asarray(a) for a in _packed_return(counts, jnp.int32(r), cap_e, cap)) for r in range(R)]
  seen = 0
  for s in range(R):
    kept = np.asarray(plans[s].slot_ret_row) >= 0
    assert sorted(packed[s][kept]) == list(range(int(plans[s].ret_rows)))   # packed: 0 .. kept - 1, each once
    assert np.all(packed[s][~kept] == tokens * K)
    for p in np.flatnonzero(kept):
      d, row = int(plans[s].slot_dest_rank[p]), int(plans[s].slot_dest_row[p])
      assert (back[d][0][row], back[d][1][row]) == (s, packed[s][p])
      seen += 1
  for d in range(R):
    assert np.all(back[d][1][int(plans[d].recv_rows):] == -1)
  assert 0 < seen < R * tokens * K



FUSED_DISPATCH_CASES = ("explicit-bf16-drops", "auto-bf16-dropless-send-once", "explicit-batch-f32",
                        "auto-bf16-drops-bf16-wgrad")


# The default pass: each return path once, one on each axis type (explicit-bf16-drops fused, the send-once case on
# Auto axes unfused); the other two of those and the other cases on both paths in the slow pass.
DEFAULT_FUSED_DISPATCH = (("fused", "explicit-bf16-drops"), ("unfused", "auto-bf16-dropless-send-once"))


@pytest.mark.parametrize("returns,name", [
    pytest.param(r, n, id=f"{r}-{n}", marks=() if (r, n) in DEFAULT_FUSED_DISPATCH else pytest.mark.slow)
    for r in ("fused", "unfused") for n in FUSED_DISPATCH_CASES], indirect=["returns"])
def test_fused_dispatch_equals_collective_bit_for_bit(name, returns):
  """With the dispatches fused (CallConfig(dispatch_pushers=2): x's packed rows dispatched and multiplied by GEMM1 in
  one dispatch_gemm_fp8 call, the slots' packed output gradients dispatched with dh = dy W2^T in another, the
  backward unpacking the recv rows the calls kept) outputs and gradients stay impl="collective"'s bit for bit, on
  both return paths; the lowered program has those two calls on uint8 rows (w1's e4m3 values [E_local, 2F, D],
  W2^T's [E_local, F, D]) and no dispatch of packed rows left."""
  del returns
  hlo = overlap_equals_collective(name, dataclasses.replace(CASES[name].get("config", CallConfig()),
                                                            dispatch_pushers=2))
  calls = dispatch_operands(hlo, "jmo_dispatch_gemm")
  assert len(calls) == 2, calls
  for ops, n in zip(calls, (2 * F, F)):
    assert re.fullmatch(rf"tensor<\d+x{ROW}xui8>", ops[0]) and re.fullmatch(rf"tensor<\d+x{n}x{D}xf8E4M3FN>", ops[11]), \
        ops
  assert not [ops for ops in dispatch_operands(hlo, "jmo_dispatch") if ops[0].endswith("xui8>")]


# Both return paths; the unfused one in the slow pass (the default pass's time).
@pytest.mark.parametrize("returns", ["fused", pytest.param("unfused", marks=pytest.mark.slow)], indirect=True)
def test_fused_dispatch_padding_rows_are_read_by_no_consumer(monkeypatch, returns):
  """dispatch_gemm_fp8 leaves its results' rows past the rank's kept rows unwritten: with those rows NaN (0xff bytes
  in the packed recv rows, NaN in h, a, dh and the scales) in both calls of a training step, the FP8 layer's loss,
  y and every gradient are bitwise those of the calls as they are (the consumers: expert_combine_fp8 on the segment
  rows, the SwiGLU backward row by row, the weight gradients' 128 x 1 tiles of each expert's rows). A control that
  poisons one kept row too must differ. On both return paths (unfused, GEMM2's rows past the groups are zeros
  whatever h holds there)."""
  del returns
  from jax_moe_overlap import fp8_overlap
  mesh = mesh_of(4)
  x, ids, gates, w1, w2, cot = fp8_inputs(jnp.bfloat16, 5)
  R, t = 4, T // 4
  cap = plan_lib.recv_capacity(t, R, K, E // R, plan_lib.expert_capacity(t, R, K, E, None))
  routed = np.asarray(ids).reshape(-1)
  kept = np.bincount(routed[routed >= 0] // (E // R), minlength=R)
  assert kept.max() < cap, (kept, cap)  # every rank has padding rows
  layer = jax.jit(layer_grads(mesh, ids, cot, "overlap", None, None, (), CallConfig(dispatch_pushers=2)))
  as_is, padded, control, poisoned = layer_checks.padding_poisoned_runs(
      monkeypatch, fp8_overlap, "dispatch_gemm_fp8", lambda: layer(x, gates, w1, w2))
  # Traced last: the forward rule (x_recv, h_q, h_s, a_q, a_s) and the backward's call (dy's recv rows, dh).
  assert poisoned[-2:] == [5, 2], poisoned
  for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(as_is)):
    np.testing.assert_array_equal(bits(a), bits(b))
  assert any(bits(a).tobytes() != bits(b).tobytes()
             for a, b in zip(jax.tree.leaves(control), jax.tree.leaves(as_is))), "the poison did not reach a consumer"
