"""GEMM2 + GatherRS (``CallConfig(tensor_reduce="gather_rs")``): the tensor-parallel overlap layer summing its
shards' partials by a top-k gather-reduce on each rank and one reduce-scatter over the expert x tensor group, on the
CPU handlers, against the float32 oracle on an (expert=2, tensor=2) mesh of the 4 CPU devices (skew, empty
experts, skipped slots, drops; Auto and Explicit axes; bfloat16 into poisoned outputs); bitwise repeatable; equal
to its serialized form; the choice rule; the refusals; its sums bit for bit those the loopback harness holds the CUDA
kernel to (tools/loopback/tensor.gather_sums). The 8-device meshes run in tensor_parallel_main.py. The
default CallConfig picks GatherRS for float32 layers of these shapes (call_site.tensor_reduce), so
test_tensor_parallel's float32 overlap cases run it in the default pass; the cases here pin it, and are slow."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of
from jax_moe_overlap import call_site
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.workspace_calls import gather_rs
from tools.loopback import cases as loopback_cases
from tools.loopback import tensor as loopback_tensor
from tensor_parallel_checks import (D, E, F, K, check_bfloat16, check_matches_oracle, check_repeatable,
                                    check_same_bits, mesh_of_shape)

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
  check_same_bits(EXPERT_TENSOR, (GATHER_RS, jmo.CallConfig(tensor_reduce="gather_rs", serialize=True)))


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
  assert rule(auto, "gpu", 2, 2, 2, 4, 128) == "gather_rs"           # the CUDA kernel: the same byte rule
  assert rule(auto, "gpu", 2, 2, 2, 2, 128) == "per_slot"
  assert rule(auto, "tpu", 2, 2, 2, 4, 128) == "per_slot"            # no kernel there
  assert rule(auto, "cpu", 2, 2, 2, 4, 2**24) == "per_slot"          # slot indices beyond float32's exact range
  assert rule(PER_SLOT, "cpu", 2, 2, 2, 4, 128) == "per_slot"
  assert rule(GATHER_RS, "cpu", 2, 2, 2, 2, 128) == "gather_rs"
  assert rule(GATHER_RS, "gpu", 2, 2, 2, 2, 128) == "gather_rs"
  with pytest.raises(ValueError, match="has no tpu kernel"):
    rule(GATHER_RS, "tpu", 2, 2, 2, 4, 128)
  with pytest.raises(ValueError, match="fewer than 2\\^24 slots"):
    rule(GATHER_RS, "cpu", 2, 2, 2, 4, 2**24)
  with pytest.raises(ValueError, match="tensor_reduce must be one of"):
    jmo.CallConfig(tensor_reduce="dense")


@pytest.mark.slow
def test_per_slot_pinned_still_matches_the_oracle():
  # The other reduction, which the default no longer picks for these float32 shapes.
  [dropped] = check_matches_oracle(EXPERT_TENSOR, "overlap", kinds=("skipped",), cf=0.5, seed=8, config=PER_SLOT)
  assert dropped > 0


@pytest.mark.slow
@pytest.mark.parametrize("f32", [True, False], ids=["float32", "bfloat16"])
def test_cpu_handler_sums_as_the_loopback_harness_restates(f32):
  # The CPU handler's y from its own GEMM rows (its rows output) is bit for bit tools/loopback/tensor.gather_sums of
  # those rows: the order the loopback harness holds the CUDA kernel to, so the two platforms' reductions agree bit
  # for bit on equal GEMM rows (docs/design.md, "GatherRS"). The operands are a loopback tensor case's (R = 4 as
  # 2 x 2): routing expanded to shard slots, plans from plan.py, row_gate and token_rows from the plans.
  case = loopback_cases.Case(ranks=4, tensor=2, tokens=24, experts=4, d_model=32, k_dim=48, n_dim=40, routing=1, f32=f32,
                 capacity_factor=1.0, gather_rs=True, datasets=1)
  data = loopback_tensor.make_data_set(case, np.random.default_rng(3))
  R, T, Q, N, cap, E_l = case.ranks, case.tokens, case.slot_top_k, case.n_dim, case.cap, case.experts_per_rank
  dtype = np.float32 if f32 else ml_dtypes.bfloat16

  def values(v, rows=None):  # a loopback Values in the call's dtype, padded to `rows` rows
    a = v.data if f32 else v.data.view(ml_dtypes.bfloat16)
    return a if rows is None else np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])

  lhs = np.concatenate([values(d.lhs, cap) for d in data])
  w = np.concatenate([values(d.w) for d in data])
  row_gate = np.concatenate([d.row_gate for d in data])
  token_rows = np.concatenate([d.token_rows for d in data])
  seg_rows = np.concatenate([d.plan["seg_rows"].reshape(E_l, R) for d in data])
  seg_ret_off = np.concatenate([d.plan["seg_ret_off"].reshape(E_l, R) for d in data])
  itemsize = np.dtype(dtype).itemsize
  sizes = WorkspaceSizes(row_bytes=N * itemsize, recv_rows=cap, ret_rows=-(-R * T * N * 4 // (N * itemsize)),
                         num_segments=E_l * R)
  mesh = mesh_of(R)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), jmo.CallConfig())
  zero = jnp.zeros((), jnp.int32)

  def local(lhs, w, row_gate, token_rows, seg_rows, seg_ret_off):
    # gather_rs reads the plan's segments alone.
    plan = plan_lib.Plan(**{f.name: zero for f in dataclasses.fields(plan_lib.Plan)
                            if f.name not in ("seg_rows", "seg_ret_off")}, seg_rows=seg_rows, seg_ret_off=seg_ret_off)
    return gather_rs(lhs, w, row_gate, token_rows, plan, info, want_rows=True)

  spec = P("expert")
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec), check_vma=False))
  y, rows = (np.asarray(a) for a in fn(lhs, w, row_gate, token_rows, seg_rows, seg_ret_off))
  rows = [rows[r * cap:(r + 1) * cap].astype(np.float32) for r in range(R)]
  for r, d in enumerate(data):
    assert not np.any(rows[r][int(d.plan["recv_rows"]):]), r  # zero past the kept rows
  for s, ys in enumerate(loopback_tensor.gather_sums(case, data, rows)):
    assert ys.astype(dtype).tobytes() == y[s * T:(s + 1) * T].tobytes(), s
