"""The loopback harness's CPU side (tools/loopback): every suite case's plans from jax_moe_overlap.plan against an
independent per-slot construction of the same layout, the plans' invariants, and check.py's verdicts on simulated
runs (exact outputs pass; a wrong row, a poisoned row, a differing repeat, a missing call fail)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from tools.loopback import cases as cases_lib
from tools.loopback import check as check_lib
from tools.loopback import tensor as tensor_lib


def _all_cases():
  base = cases_lib.Case()
  out = []
  suites_seen, layouts_seen = set(), set()
  for name in cases_lib.SUITES:
    for i, c in enumerate(cases_lib.suite(name, base, producer_path=lambda c: "mma.sync bf16")):
      # combine-time and backward-time: each shape at R = 8 in the default pass (the most segments), R = 2 and 4 in
      # the slow pass; tensor-time, the tensor suite's GatherRS cases (plans like its per-slot cases') and the
      # regret suite's parts run alone (regret-gather, regret-push: the regret suite's own cases),
      # dispatch-gemm-variants, regret-push-shapes (dispatch-gemm-shapes' plans) and regret-backward (backward-time's)
      # in the slow pass
      slow = ((name in ("combine-time", "combine-time-fp8", "backward-time") and c.ranks != 8) or
              name in ("tensor-time", "tensor-backward-time", "tensor-time-deepseek") or c.gather_rs or
              name in ("regret-gather", "regret-push", "dispatch-gemm-variants", "regret-push-shapes",
                       "regret-backward", "dispatch-gemm-order", "dispatch-gemm-order-fp8"))
      # Of the rest, the default pass keeps each suite's first case and the first case of each plan layout (ranks,
      # a tensor axis or not, capacity drops or not, routing); the other cases of a suite repeat a layout the
      # default pass checks at other sizes, and run in the slow pass.
      layout = (c.ranks, c.tensor > 1, c.capacity_factor > 0, c.routing)
      if not slow and name in suites_seen and layout in layouts_seen:
        slow = True
      if not slow:
        suites_seen.add(name)
        layouts_seen.add(layout)
      out.append(pytest.param(c, id=f"{name}-{i}", marks=pytest.mark.slow if slow else ()))
  return out


def _slot_by_slot_plans(ids, R, T, k, E, cap_e):
  """The plan's layout built slot by slot (send order = stable sort by expert; first come first served over source
  ranks per expert; recv segments packed in (expert, source) order), independently of plan.py's vector form."""
  E_l, P = E // R, T * k
  counts = np.zeros((R, R, E_l), np.int64)  # [s, d, e]
  for s in range(R):
    for g in ids[s].reshape(-1):
      counts[s, g // E_l, g % E_l] += 1
  kept = np.zeros_like(counts)
  for d in range(R):
    for e in range(E_l):
      before = 0
      for s in range(R):
        kept[s, d, e] = min(max(cap_e - before, 0), counts[s, d, e])
        before += counts[s, d, e]
  recv_off = np.zeros((R, E_l, R), np.int64)
  for d in range(R):
    off = 0
    for e in range(E_l):
      for s in range(R):
        recv_off[d, e, s] = off
        off += kept[s, d, e]
  send_start = np.zeros((R, E), np.int64)
  for s in range(R):
    acc = 0
    for g in range(E):
      send_start[s, g] = acc
      acc += counts[s, g // E_l, g % E_l]
  plans = []
  for s in range(R):
    flat = ids[s].reshape(-1)
    order = sorted(range(P), key=lambda p: (flat[p], p))
    pos = np.empty(P, np.int64)
    pos[order] = np.arange(P)
    dest_row, ret_row, dest_rank = np.full(P, -1), np.full(P, -1), np.zeros(P, np.int64)
    for p in range(P):
      g = flat[p]
      d, e = g // E_l, g % E_l
      pig = pos[p] - send_start[s, g]
      dest_rank[p] = d
      if pig < kept[s, d, e]:
        dest_row[p] = recv_off[d, e, s] + pig
        ret_row[p] = pos[p]
    plans.append({"slot_dest_rank": dest_rank, "slot_dest_row": dest_row, "slot_ret_row": ret_row,
                  "ret_rows": int((ret_row >= 0).sum())})
  for d in range(R):
    seg_rows = np.array([[kept[s, d, e] for s in range(R)] for e in range(E_l)]).reshape(-1)
    seg_ret_off = np.array([[send_start[s, d * E_l + e] for s in range(R)] for e in range(E_l)]).reshape(-1)
    plans[d].update(seg_rows=seg_rows, seg_ret_off=seg_ret_off, recv_rows=int(seg_rows.sum()))
  return plans


@pytest.mark.parametrize("case", _all_cases())
def test_suite_case_plans(case):
  assert case.invalid() is None, case.invalid()
  R, T, k, E, E_l, P = case.ranks, case.tokens, case.top_k, case.experts, case.experts_per_rank, case.slots
  rng = np.random.default_rng(case.seed)
  ids = [cases_lib.route(rng, case, r) for r in range(R)]
  for r in range(R):
    assert ids[r].shape == (T, k) and ids[r].min() >= 0 and ids[r].max() < E
    assert all(len(set(row)) == k for row in ids[r].tolist()), "k distinct experts per token"
  if case.tensor > 1:  # the kernels see the shard slots: k TP choices of E TP shard experts (tools/loopback/tensor.py)
    ids = [tensor_lib.shard_slots(case, i, np.ones(i.shape, np.float32))[0] for i in ids]
    k, E = case.slot_top_k, E * case.tensor
  plans = cases_lib.make_plans(case, ids)
  want = _slot_by_slot_plans(ids, R, T, k, E, case.expert_cap)
  for r in range(R):
    for key, value in want[r].items():
      np.testing.assert_array_equal(np.asarray(plans[r][key]).reshape(-1), np.asarray(value).reshape(-1),
                                    err_msg=f"rank {r} {key}")
  # Invariants the kernels rely on.
  assert sum(int(p["recv_rows"]) for p in plans) == sum(int(p["ret_rows"]) for p in plans)
  for d, pl in enumerate(plans):
    assert int(pl["recv_rows"]) == int(pl["seg_rows"].sum()) <= case.cap
    np.testing.assert_array_equal(pl["expert_rows"], pl["seg_rows"].reshape(E_l, R).sum(1))
    assert int(pl["dropped"]) == P - int(pl["ret_rows"])
    np.testing.assert_array_equal(pl["slot_src_row"], np.arange(P) // k)
    rows = np.concatenate([p["slot_dest_row"][(p["slot_dest_rank"] == d) & (p["slot_dest_row"] >= 0)]
                           for p in plans])
    np.testing.assert_array_equal(np.sort(rows), np.arange(int(pl["recv_rows"])))  # every recv row exactly once
    for e in range(E_l):
      for s in range(R):
        n, off = int(pl["seg_rows"][e * R + s]), int(pl["seg_ret_off"][e * R + s])
        src = plans[s]
        mine = (src["slot_dest_rank"] == d) & (src["slot_expert"] == e) & (src["slot_ret_row"] >= 0)
        np.testing.assert_array_equal(np.sort(src["slot_ret_row"][mine]), off + np.arange(n))
  if case.capacity_factor > 0:
    assert sum(int(p["dropped"]) for p in plans) > 0, "the capacity case drops slots"
  if case.routing == 4:
    assert all(int(plans[r]["seg_rows"].reshape(E_l, R)[:, r].sum()) == 0 for r in range(R)), "nothing stays"


def _small_case(**kw):
  return dataclasses.replace(cases_lib.Case(), **{**dict(ranks=2, tokens=16, experts=4, d_model=64, k_dim=64, n_dim=24,
                                                         iters=4, datasets=2, routing=1), **kw})


def _unwritten_padding(raw: bytes, cap: int, kept: int, parts=(1,)) -> bytes:
  """A result whose rows past the kept ones are left as the runner poisoned them (all bits set); `parts`: the byte
  widths of its [cap, ...] parts relative to one another (FP8 h and a: values, then scales, in one buffer)."""
  if not raw:
    return raw
  out, at, unit = b"", 0, len(raw) // (cap * sum(parts))
  for w in parts:
    row = w * unit
    out += raw[at: at + kept * row] + b"\xff" * ((cap - kept) * row)
    at += cap * row
  return out


def _fp8_bytes(v: np.ndarray) -> bytes:
  """[rows, C] float -> fp8.quantize_rows' e4m3 values' bytes, then its scales' (a result buffer of dispatch_gemm's
  FP8 SwiGLU: tools/loopback/runner.cc)."""
  from jax_moe_overlap import fp8  # pylint: disable=g-import-not-at-top
  q, s = fp8.quantize_rows(np.asarray(v, np.float32))
  return np.asarray(q).view(np.uint8).tobytes() + np.asarray(s, np.float32).tobytes()


def _gather_outputs(case, ranks, ex):
  """gather_rs's outputs from the references: every rank's GEMM rows (each slot's product at its recv row, rounded to
  the dtype, zero past the kept rows) and y as its float32 sums of those rows (tensor.gather_sums)."""
  dt = np.float32 if case.f32 else ml_dtypes.bfloat16
  rows = [np.zeros((case.cap, case.n_dim), np.float32) for _ in ranks]
  for s, src in enumerate(ranks):
    pl = src.plan
    for d in range(case.ranks):
      p = np.nonzero((pl["slot_dest_rank"] == d) & (pl["slot_dest_row"] >= 0))[0]
      rows[d][pl["slot_dest_row"][p]] = ex[s].slot[p].astype(dt).astype(np.float32)
  ys = tensor_lib.gather_sums(case, ranks, rows)
  return [r.astype(dt).tobytes() for r in rows], [y.astype(dt).tobytes() for y in ys]


def _exact_run(case, sets):
  """A run whose outputs are the references, as the runner would return it (dispatch_gemm's results with their
  padding rows unwritten, its two-call twin's zeroed; gather_rs's rows and y: _gather_outputs)."""
  first, digests = [], []
  for ds, ranks in enumerate(sets):
    ex = check_lib.references(case, ranks)
    gather = _gather_outputs(case, ranks, ex) if case.gather_rs else None
    row = []
    for r, e in enumerate(ex):
      dt = np.float32 if case.f32 else ml_dtypes.bfloat16
      a = pre = b""  # dispatch_gemm's GEMM1 output (float32, or the SwiGLU's h in bf16) and kept preactivation
      if e.a is not None and case.fp8 and case.swiglu:  # h and a quantized, each with its scales after it
        a = _fp8_bytes(check_lib.swiglu(e.a))
        pre = _fp8_bytes(e.a) if case.dispatch_gemm_mode == "train" else b""
      elif e.a is not None and case.dg_out_bf16:  # the plain product rounded once to bf16
        a = e.a.astype(ml_dtypes.bfloat16).tobytes()
      elif e.a is not None:
        a = check_lib.swiglu(e.a).astype(ml_dtypes.bfloat16).tobytes() if case.swiglu else e.a.tobytes()
        pre = e.a.tobytes() if case.dispatch_gemm_mode == "train" else b""
      recv = e.recv.tobytes() if case.keeps_recv else b"\xff" * e.recv.nbytes  # not kept: left poisoned
      fused = {"recv": recv, "a": a, "pre": pre}
      if case.dg:
        kept = int(ranks[r].plan["recv_rows"])
        parts = (32, 1) if case.fp8 and case.swiglu else (1,)  # (e4m3 values: 32 bytes per scale's 4)
        fused = {key: _unwritten_padding(v, case.cap, kept, parts if key != "recv" else (1,))
                 for key, v in fused.items()}
      y, slot = (gather[1][r], gather[0][r]) if gather else (e.y.astype(dt).tobytes(), e.slot.astype(dt).tobytes())
      row.append({**fused, "y": y, "slot": slot, "recv2": e.recv.tobytes() if a else b"", "a2": a, "pre2": pre})
    first.append(row)
  for it in range(case.iters):
    ds = it % case.datasets
    for r in range(case.ranks):
      f = first[ds][r]
      digests.append([it, r, ds, hash(f["recv"]), hash(f["y"]), hash(f["slot"]), hash(f["a"]), hash(f["pre"])])
  return {"errors": [], "calls": 2 * case.ranks * case.iters, "digests": digests, "first": first,
          "timeout": [{"reported": False, "code": 0, "msg": ""}] * case.ranks, "timed": [], "dg_us": [[], [], []],
          "gemm_us": [], "pushers": max(case.dispatch_gemm_pushers, 0), "budget": 66, "producer": "test",
          "seconds": 0.0}


# FP8 dispatch_gemm (packed e4m3 rows, e4m3 w1): its three result modes.
# "train" (the most results: x_recv, pre and h) in the default pass, "plain" and "infer" in the slow pass.
FP8_DG_SMALL = [pytest.param({"fp8": True, "d_model": 512, "k_dim": 256, "n_dim": 128, "dispatch_gemm_pushers": 2,
                              "dispatch_gemm_mode": m}, marks=() if m == "train" else pytest.mark.slow)
                for m in cases_lib.DG_MODES]


# Small expert x tensor cases: 2 x 2 (bf16, float32, drops, dispatch_gemm's training forward, a strided check), 1 x 2.
TENSOR_SMALL = [{"ranks": 4, "tensor": 2, **kw} for kw in (
    {}, {"f32": True}, {"capacity_factor": 1.0},
    {"dispatch_gemm_pushers": 2, "dispatch_gemm_mode": "train", "k_dim": 128},  # each rank's GEMM1 N = 64: wgmma's
    {"check_tokens": 4}, {"ranks": 2, "routing": 2}, {"gather_rs": True}, {"gather_rs": True, "f32": True},
    {"gather_rs": True, "capacity_factor": 1.0, "routing": 2}, {"gather_rs": True, "transpose_rhs": True})]


@pytest.mark.parametrize("kw", [{}, {"f32": True}, {"capacity_factor": 1.0}, {"dispatch_gemm_pushers": 2},
                                {"dispatch_gemm_pushers": cases_lib.AUTO, "dispatch_gemm_mode": "train"},
                                {"dispatch_gemm_pushers": 2, "dispatch_gemm_mode": "infer"},
                                {"dispatch_gemm_pushers": 2, "dg_out_bf16": True}, {"check_tokens": 4},
                                {"row_scale": True}, {"row_scale": True, "f32": True, "capacity_factor": 1.0},
                                {"dispatch_gemm_pushers": 2, "dg_out_bf16": True, "row_scale": True},
                                {"fp8": True, "k_dim": 256, "n_dim": 128}, *FP8_DG_SMALL, *TENSOR_SMALL])
def test_check_verdicts(kw, monkeypatch):
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  case = _small_case(**kw)
  sets = cases_lib.make_data(case)
  res = _exact_run(case, sets)
  v = check_lib.check(case, sets, res)
  assert v.passed, v.failures
  assert v.bit_checks == case.ranks * (case.iters - case.datasets)

  bad = _exact_run(case, sets)  # one received row wrong (where the call returns them)
  recv = bytearray(bad["first"][0][1]["recv"])
  recv[0] ^= 1
  bad["first"][0][1]["recv"] = bytes(recv)
  v = check_lib.check(case, sets, bad)
  assert v.passed != case.keeps_recv and (v.passed or "dispatch output differs" in v.failures[0])

  bad = _exact_run(case, sets)  # a slot output row left poisoned (all bits set: NaN)
  slot = bytearray(bad["first"][1][0]["slot"])
  row_bytes = case.n_dim * (4 if case.f32 else 2)
  slot[:row_bytes] = b"\xff" * row_bytes
  bad["first"][1][0]["slot"] = bytes(slot)
  v = check_lib.check(case, sets, bad)
  assert not v.passed and "non-finite" in v.failures[0]

  bad = _exact_run(case, sets)  # a later call differs from the first on the same data
  bad["digests"][-1][4] ^= 1
  v = check_lib.check(case, sets, bad)
  assert not v.passed and "differ from the first call" in v.failures[0]

  bad = _exact_run(case, sets)  # a call did not run
  bad["calls"] -= 1
  assert not check_lib.check(case, sets, bad).passed

  if case.gather_rs:
    bad = _exact_run(case, sets)  # y one bit off its float32 sums (within any tolerance of the whole experts)
    y = bytearray(bad["first"][0][2]["y"])
    y[0] ^= 1
    bad["first"][0][2]["y"] = bytes(y)
    v = check_lib.check(case, sets, bad)
    assert not v.passed and any("differs from its float32 sums restated" in f for f in v.failures), v.failures
    bad = _exact_run(case, sets)  # a GEMM row past the kept ones written (on the rank with the fewest rows)
    r = min(range(case.ranks), key=lambda r: int(sets[0][r].plan["recv_rows"]))
    assert int(sets[0][r].plan["recv_rows"]) < case.cap
    rows = bytearray(bad["first"][0][r]["slot"])
    rows[-1] = 1
    bad["first"][0][r]["slot"] = bytes(rows)
    v = check_lib.check(case, sets, bad)
    assert not v.passed and any("past the" in f and "not zero" in f for f in v.failures), v.failures

  if case.dg:
    bad = _exact_run(case, sets)  # GEMM1's output (its float32 product or h) wrong in one element
    if case.fp8 and case.swiglu:  # (an e4m3 value moved to the other end of its tile's range)
      a = np.frombuffer(bad["first"][0][0]["a"], np.uint8).copy()
      a[0] = 0xFE if a[0] < 0x80 else 0x7E  # -448, or 448
    else:
      dt = ml_dtypes.bfloat16 if case.swiglu else np.float32
      a = np.frombuffer(bad["first"][0][0]["a"], dt).copy()
      a[0] += 1.0
    bad["first"][0][0]["a"] = a.tobytes()
    v = check_lib.check(case, sets, bad)
    assert not v.passed and any(("h rel err" if case.swiglu else "GEMM1 rel err") in f for f in v.failures)
    for key in ("a", "recv") if case.keeps_recv else ("a",):  # a padding row of a result written (zeros)
      bad = _exact_run(case, sets)  # (FP8 h: the last row of its scales)
      cap, row = case.cap, (case.rank_k // 256 * 4 if case.fp8 and case.swiglu and key == "a"
                            else len(bad["first"][0][0][key]) // case.cap)
      assert int(sets[0][0].plan["recv_rows"]) < cap
      raw = bytearray(bad["first"][0][0][key])
      raw[len(raw) - row:] = b"\x00" * row  # (the last row of its last part)
      bad["first"][0][0][key] = bytes(raw)
      v = check_lib.check(case, sets, bad)
      assert not v.passed and any(f"{key}: 1 rows past the kept ones were written" in f for f in v.failures), key
    bad = _exact_run(case, sets)  # the fused call differs from its two-call twin in one bit
    a2 = bytearray(bad["first"][1][1]["a2"])
    a2[0] ^= 1
    bad["first"][1][1]["a2"] = bytes(a2)
    v = check_lib.check(case, sets, bad)
    assert not v.passed and any("differs from dispatch + GEMM1 as two calls" in f for f in v.failures)


@pytest.mark.parametrize("f32", [False, True])
def test_row_scale_references_are_the_scaled_rows(f32, monkeypatch):
  # With row_scale every dispatched row is gates[p] * x[token] rounded once, and GEMM1 is linear in its row: the
  # scaled case's GEMM1 references are the unscaled ones times the gates (within the rows' rounding), and a run that
  # ignores the scale (the unscaled references as outputs) fails the scaled case's check.
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  # (float32: the dispatch alone; dispatch_gemm's engine takes bf16 rows where the extension has CUDA kernels)
  plain = _small_case(dispatch_gemm_pushers=0 if f32 else 2, dg_out_bf16=not f32, f32=f32, capacity_factor=1.0)
  scaled = dataclasses.replace(plain, row_scale=True)
  assert scaled.invalid() is None and "row_scale=gates" in scaled.name()
  sets = cases_lib.make_data(scaled)
  for ranks in sets:
    ex, ex_scaled = check_lib.references(plain, ranks), check_lib.references(scaled, ranks)
    for d in range(scaled.ranks):
      g = np.zeros(scaled.cap, np.float32)  # the gate of the slot each recv row of rank d holds
      for src in ranks:
        pl = src.plan
        to_d = (pl["slot_dest_rank"] == d) & (pl["slot_dest_row"] >= 0)
        g[pl["slot_dest_row"][to_d]] = src.gates[to_d]
        x = cases_lib.Values(src.x.data[pl["slot_src_row"][to_d]]).f
        got = cases_lib.Values(ex_scaled[d].recv[pl["slot_dest_row"][to_d]]).f
        np.testing.assert_allclose(got, x * src.gates[to_d][:, None], rtol=1e-7 if f32 else 4e-3)
      if scaled.dg:
        rows = ex[d].a_checked
        assert rows.sum() > 0 and np.array_equal(rows, ex_scaled[d].a_checked)
        np.testing.assert_allclose(ex_scaled[d].a[rows], g[rows][:, None] * ex[d].a[rows], rtol=2e-2, atol=2e-2)
  assert check_lib.check(scaled, sets, _exact_run(scaled, sets)).passed
  v = check_lib.check(scaled, sets, _exact_run(plain, sets))
  assert not v.passed and any("dispatch output differs" in f for f in v.failures), v.failures
  assert dataclasses.replace(scaled, send_once=1).invalid() and dataclasses.replace(scaled, fp8=True).invalid()


def test_fp8_operands_are_the_quantized_references():
  """--fp8: the runner gets e4m3 lhs and w (uint8) with their float32 scales (lhs's MN-major over ld >= cap columns,
  NaN past the received rows), and the references' lhs and w are exactly their dequantized values; the cases refuse
  what the FP8 producer does not take."""
  from jax_moe_overlap import fp8  # pylint: disable=g-import-not-at-top
  case = _small_case(fp8=True, k_dim=256, n_dim=128, datasets=1)
  assert case.invalid() is None and "lhs,w=e4m3" in case.name()
  (ranks,) = cases_lib.make_data(case)
  for d in ranks:
    got = d.inputs(case)
    n, K, N, E_l = int(d.plan["recv_rows"]), case.k_dim, case.n_dim, case.experts_per_rank
    assert got["lhs"].dtype == np.uint8 and got["lhs"].shape == (n, K)
    assert got["w"].dtype == np.uint8 and got["w"].shape == (E_l, N, K)
    assert got["w_scales"].shape == (E_l, N // 128, K // 128)
    sc = got["lhs_scales"]
    assert sc.shape[0] == K // 128 and sc.shape[1] >= case.cap and sc.shape[1] % 4 == 0
    assert np.isnan(sc[:, n:]).all() and np.isfinite(sc[:, :n]).all() and (sc[:, :n] > 0).all()
    q = got["lhs"].view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize_rows(q, sc[:, :n].T)), d.lhs.f)
    weight = fp8.Fp8Weight(got["w"].view(ml_dtypes.float8_e4m3fn), got["w_scales"])
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), d.w.f)
  for bad in (dict(k_dim=200), dict(n_dim=136), dict(transpose_rhs=True), dict(ranks=4, tensor=2)):
    assert "fp8 takes" in (dataclasses.replace(case, **bad).invalid() or ""), bad
  for bad in (dict(d_model=256), dict(d_model=512, k_dim=384, dispatch_gemm_mode="train")):
    assert "fp8 with dispatch_gemm takes d_model a multiple of 512" in (
        dataclasses.replace(case, dispatch_gemm_pushers=2, **bad).invalid() or ""), bad


def test_fp8_dispatch_gemm_operands_are_the_quantized_references():
  """--fp8 with dispatch_gemm: x is packed e4m3 rows (fp8.pack_rows of fp8.quantize_rows(x, pow2=True)) and w1 the
  e4m3 values and block scales of fp8.quantize_weight, the references' x and w1 exactly their dequantized values;
  each rank's unpacked recv rows (the two calls' GEMM1 operands) are the packed rows its plan lands, values and
  MN-major scales (NaN past the received rows); the wire bytes count packed rows."""
  from jax_moe_overlap import fp8  # pylint: disable=g-import-not-at-top
  case = _small_case(fp8=True, d_model=512, k_dim=256, n_dim=128, dispatch_gemm_pushers=2,
                     dispatch_gemm_mode="train", datasets=1)
  assert case.invalid() is None and case.dispatch_row_bytes == 512 + 16
  (ranks,) = cases_lib.make_data(case)
  ex = check_lib.references(case, ranks)
  for r, d in enumerate(ranks):
    got = d.inputs(case)
    n, D, K, E_l = int(d.plan["recv_rows"]), case.d_model, case.k_dim, case.experts_per_rank
    assert got["x"].dtype == np.uint8 and got["x"].shape == (case.tokens, D + D // 32)
    q, s = fp8.unpack_rows(got["x"])
    np.testing.assert_array_equal(np.asarray(fp8.dequantize_rows(q, s)), d.x.f)
    assert got["w1"].shape == (E_l, K, D) and got["w1_scales"].shape == (E_l, K // 128, D // 128)
    weight = fp8.Fp8Weight(got["w1"].view(ml_dtypes.float8_e4m3fn), got["w1_scales"])
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), d.w1.f)
    assert got["x_recv_q"].shape == (n, D) and np.isnan(got["x_recv_s"][:, n:]).all()
    recv = ex[r].recv[:n]
    np.testing.assert_array_equal(got["x_recv_q"], recv[:, :D])
    np.testing.assert_array_equal(got["x_recv_s"][:, :n].T, np.ascontiguousarray(recv[:, D:]).view(np.float32))
    assert cases_lib.wire_bytes(case, d.plan, r, case.dispatch_row_bytes)[1] % (D + D // 32) == 0


def test_forced_timeout_report(monkeypatch):
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  case = _small_case(timeout_at=1)
  sets = cases_lib.make_data(case)
  res = _exact_run(case, sets)
  res["timeout"] = [{"reported": True, "code": 2, "msg": "dispatch timed out waiting for rank 1"}] * case.ranks
  assert check_lib.check(case, sets, res).passed
  res["timeout"] = [{"reported": True, "code": 3, "msg": "internal"}] * case.ranks
  v = check_lib.check(case, sets, res)
  assert not v.passed and "unexpected error after the forced timeout" in v.failures[0]


def test_run_case_lines(monkeypatch, capsys):
  """run.py's lines on a simulated run: the PASS line tests/gpu greps, TIMED / RESULT lines of a timed case."""
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  from tools.loopback import run  # pylint: disable=g-import-not-at-top
  case = _small_case(time=True, sweep=(1, 2), per_call_stats=True, reps=3)
  sets = cases_lib.make_data(case)
  res = _exact_run(case, sets)
  rec = {"consumers": 1, "begin_t": 1000, "prod_t0": 2000, "prod_t1": 9000, "prod_t0_last": 2100, "cons_t0": 3000,
         "cons_t1": 9500, "comb_t0": 9600, "comb_t1": 9900, "pushed_bytes": 0, "entry_t": 1500}
  y0 = [d for d in res["digests"] if d[2] == 0]
  res["timed"] = [[{"call_us": [10.0, 12.0, 11.0], "device": [rec] * 3, "y_after": y0[r][4]}
                   for r in range(case.ranks)] for _ in case.variants()]
  runner = types.SimpleNamespace(run_ranks=lambda spec, data: res)
  assert run.run_case(runner, case)
  out = capsys.readouterr().out
  assert out.startswith(f"PASS R=2 T=16 k=2 E=4 D=64 K=64 N=24 dtype=bf16 routing=moderate dropless iters=4 "
                        f"consumers=2 | calls 16 |"), out
  timed = [json.loads(l[7:]) for l in out.splitlines() if l.startswith("RESULT ") and '"timed"' in l]
  assert [(t["consumers"], t["serialize"]) for t in timed] == [(1, 0), (2, 0), (0, 0), (0, 1)]
  assert all(t["identical"] and t["median_us"] == 11.0 for t in timed)
  assert all(t["producer_start_us"] == 0.5 for t in timed)  # the first tile 500 ns after the kernel's start
  assert out.count("TIMELINE r0 C=1 begin 0.0 prod 1.0..8.0") == 4
  assert all(t["rank_consumer_span_us"] == [6.5] * case.ranks for t in timed)  # cons 3000..9500 ns on every call
  assert sum(1 for l in out.splitlines() if l.startswith("RESULT ") and '"plan"' in l) == case.ranks


def test_row_blocks_follow_the_producer_order():
  """The overlap rows' row_blocks pair counts the producer's tiles as it tiles them: each segment apart in the table's
  order, each expert's rows as one range where it goes expert-major (the rule: the table's order counts at least
  twice the weight passes, a pass per band of 8 row blocks; or producer_order's pin; never gather_rs or float32)."""
  from tools.loopback import timing  # pylint: disable=g-import-not-at-top
  small = {"seg_rows": [129, 129, 129, 129]}  # 2 experts x 2 sources: passes 4 apart, 2 whole -> expert-major
  large = {"seg_rows": [1030, 1030, 1030, 1030]}  # 9 blocks a segment: passes 8 apart, 6 whole -> the table's
  case = _small_case()
  assert timing.row_blocks(case, small) == (6, 6)
  assert timing.row_blocks(case, large) == (36, 34)
  assert timing.row_blocks(dataclasses.replace(case, producer_order=1), small) == (8, 6)
  assert timing.row_blocks(dataclasses.replace(case, producer_order=2), large) == (34, 34)
  assert timing.row_blocks(dataclasses.replace(case, f32=True), small) == (8, 6)
  assert timing.row_blocks(dataclasses.replace(case, gather_rs=True), small) == (8, 6)
  # A band of 16 row blocks: the large segments' passes 4 apart against 4 whole -> the table's; the small ones'
  # 4 against 2 -> expert-major.
  assert timing.row_blocks(dataclasses.replace(case, producer_band_m=16), large) == (36, 34)
  assert timing.row_blocks(dataclasses.replace(case, producer_band_m=16), small) == (6, 6)


def test_overlap_table_rows(monkeypatch, capsys):
  """The overlap table of the timed suites on simulated runs: expert_combine (ours and serialized variants, the
  transfer alone from the serialized call's consumer span) and dispatch_gemm (its two calls, the dispatch alone and
  the GEMM alone), the columns' arithmetic, and the table run.py prints at the end."""
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  from tools.loopback import run, timing  # pylint: disable=g-import-not-at-top

  # expert_combine: ours 110 us (rank 1; rank 0 100), serialized 150 us, consumer span 40 us in the serialized call,
  # GEMM alone 90 us: hidden = 1 - (110 - 90) / 40 = 50%.
  case = _small_case(time=True, table=True, consumers=0, link_gbps=10.0, reps=3)
  assert case.variants() == [(0, False), (0, True)]
  sets = cases_lib.make_data(case)
  res = _exact_run(case, sets)
  y0 = [d for d in res["digests"] if d[2] == 0]

  def variant(us, cons_us, consumers):
    rec = {"consumers": consumers, "begin_t": 0, "prod_t0": 1000, "prod_t1": 5000, "prod_t0_last": 1000,
           "cons_t0": 6000, "cons_t1": 6000 + int(cons_us * 1000), "comb_t0": 9000, "comb_t1": 12000,
           "pushed_bytes": 0}
    return [{"call_us": [u] * 3, "device": [rec], "y_after": y0[r][4]} for r, u in enumerate(us)]

  res["timed"] = [variant((100.0, 110.0), 5.0, 3), variant((150.0, 140.0), 40.0, 3)]
  res["gemm_us"] = [[80.0] * 3, [90.0] * 3]
  table = []
  assert run.run_case(types.SimpleNamespace(run_ranks=lambda spec, data: res), case, table)
  (row,) = table
  remote = max(int(sum(n for i, n in enumerate(d.plan["seg_rows"]) if i % 2 != r)) for r, d in enumerate(sets[0]))
  assert row["gemm_us"] == 90.0 and row["ours_us"] == 110.0 and row["baseline_us"] == 150.0
  assert row["transfer_us"] == 40.0 and row["transfer_bytes"] == remote * case.n_dim * 2 and row["sms"] == 3
  assert row["hidden"] == pytest.approx(0.5) and row["ours_over_gemm"] == pytest.approx(110 / 90)
  assert row["link_share"] == pytest.approx(row["transfer_bytes"] / 40.0 * 1e-3 / 10.0)
  assert row["combine_us"] == 3.0
  blocks = []  # per rank: the producer's 128-row blocks (test_row_blocks_follow_the_producer_order), the bare GEMM's
  for d in sets[0]:
    seg = [[max(int(n), 0) for n in d.plan["seg_rows"][e * 2:e * 2 + 2]] for e in range(len(d.plan["seg_rows"]) // 2)]
    apart, whole = sum(-(-n // 128) for ns in seg for n in ns), sum(-(-sum(ns) // 128) for ns in seg)
    expert_major = sum(-(-(-(-n // 128)) // 8) for ns in seg for n in ns) >= 2 * sum(
        -(-(-(-sum(ns) // 128)) // 8) for ns in seg)
    blocks.append((whole if expert_major else apart, whole))
  assert row["row_blocks"] == max(blocks) and row["row_blocks"][0] >= row["row_blocks"][1] > 0
  out = capsys.readouterr().out
  assert "OVERLAP | expert_combine R=2 " in out and "| 50% | 3 |" in out, out

  # dispatch_gemm with the library's pushers: two calls 300, fused 250, the dispatch alone 100, GEMM alone 200 us:
  # hidden = 1 - (250 - 200) / 100 = 50%; SMs = the pushers the runner resolved.
  case = _small_case(time=True, table=True, dispatch_gemm_pushers=cases_lib.AUTO, link_gbps=10.0, reps=3,
                     send_once=1)
  sets = cases_lib.make_data(case)
  res = _exact_run(case, sets)
  res["dg_us"] = [[[300.0] * 3] * 2, [[250.0] * 3, [240.0] * 3], [[100.0] * 3] * 2]
  res["gemm_us"], res["pushers"] = [[200.0] * 3] * 2, 4
  table = []
  assert run.run_case(types.SimpleNamespace(run_ranks=lambda spec, data: res), case, table)
  (row,) = table
  # Bytes sent once per (token, destination rank) (send once pinned), plus 8 per remote slot's entry.
  wire = []
  for r, d in enumerate(sets[0]):
    remote = np.flatnonzero((d.plan["slot_dest_rank"] != r) & (d.plan["slot_dest_row"] >= 0))
    pairs = {(p // case.top_k, int(d.plan["slot_dest_rank"][p])) for p in remote}
    wire.append(len(pairs) * case.d_model * 2 + 8 * len(remote))
  assert (row["gemm_us"], row["transfer_us"], row["baseline_us"], row["ours_us"], row["sms"]) == (200, 100, 300, 250, 4)
  assert row["transfer_bytes"] == max(wire) and row["hidden"] == pytest.approx(0.5)
  out = capsys.readouterr().out
  assert "dispatch_gemm pushers=auto mode=plain" in out and "| pushers 4 |" in out, out
  assert timing.overlap_cells(row).startswith("| dispatch_gemm plain R=2 T=16 k=2 E=4 D=64 K=64 N=24 | 10 | 200.0 |")
  assert timing.TABLE_HEADER.count("|---") == timing.overlap_cells(row).count(" |")


def test_consumer_rate_lines(monkeypatch, capsys):
  """The consumer-rate suite's CONSUMER lines on a simulated run: per rank, the rate alone from the serialized call's
  consumer span, and beside the GEMM what the alone rate leaves unaccounted after the producer's last tile over the
  consumer's time before it."""
  import re  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  from tools.loopback import run, timing  # pylint: disable=g-import-not-at-top
  suite = cases_lib.suite("consumer-rate", cases_lib.Case())
  assert [(c.ranks, c.consumers, c.experts, c.per_call_stats, c.variants()[1]) for c in suite] == [
      (2, c, sh["experts"], True, (c, True)) for sh in cases_lib.COMBINE_SHAPES.values() for c in (1, 2)]

  # (N = 2048: a few GB/s per CTA over these microseconds, so the printed tenths pin the arithmetic)
  case = _small_case(time=True, table=True, consumers=2, link_gbps=10.0, reps=3, per_call_stats=True, n_dim=2048)
  sets = cases_lib.make_data(case)
  res = _exact_run(case, sets)
  y0 = [d for d in res["digests"] if d[2] == 0]

  def variant(c0, c1, p1):
    rec = {"consumers": 2, "begin_t": 0, "prod_t0": 1000, "prod_t1": p1, "prod_t0_last": 1000, "cons_t0": c0,
           "cons_t1": c1, "comb_t0": c1, "comb_t1": c1 + 1000, "pushed_bytes": 0}
    return [{"call_us": [20.0] * 3, "device": [rec] * 3, "y_after": y0[r][4]} for r in range(case.ranks)]

  # Overlapped: consumer 2..10 us, last tile at 8 us; serialized: consumer 8..12 us (4 us alone).
  res["timed"] = [variant(2000, 10000, 8000), variant(8000, 12000, 8000)]
  res["gemm_us"] = [[10.0] * 3] * 2
  assert run.run_case(types.SimpleNamespace(run_ranks=lambda spec, data: res), case, [])
  out = [l for l in capsys.readouterr().out.splitlines() if l.startswith("CONSUMER")]
  assert len(out) == case.ranks
  for r, (line, d) in enumerate(zip(out, sets[0])):
    moved = int(sum(n for i, n in enumerate(d.plan["seg_rows"]) if i % 2 != r)) * case.n_dim * 2
    alone = moved / 4.0 * 1e-3 / 2  # GB/s per CTA over 4 us
    beside = (moved - moved / 4.0 * 2.0) / 6.0 * 1e-3 / 2  # 2 us after the last tile at the alone rate, 6 before
    got = [float(x) for x in re.findall(r"([\d.]+) GB/s", line)]
    assert line.startswith(f"CONSUMER r{r} C=2 "), line
    assert min(alone, beside) > 1.0 and got == pytest.approx([alone, beside], abs=0.051), line
    assert "6.0 us before the last tile, 2.0 us after it" in line
  # Without per-call timelines (or for dispatch_gemm) there is nothing to estimate.
  assert timing.consumer_rate_lines(dataclasses.replace(case, per_call_stats=False), res, sets[0]) == []


def test_tensor_time_table(monkeypatch, capsys):
  """The tensor-time suite's rows on simulated runs: GatherRS's bytes are its float32 partials for the other ranks,
  and timing.tensor_table pairs it with the per-slot path of the same shape."""
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  from tools.loopback import run, timing  # pylint: disable=g-import-not-at-top
  assert [(c.tokens, c.gather_rs, c.ranks, c.tensor, c.rank_k, c.n_dim)
          for c in cases_lib.suite("tensor-time", cases_lib.Case())] == [
              (t, g, 4, 2, 7168, 4096) for t in cases_lib.TENSOR_TIME_TOKENS for g in (False, True)]
  table = []
  for gather, ours in ((False, 100.0), (True, 80.0)):
    case = _small_case(ranks=4, tensor=2, time=True, table=True, consumers=0, link_gbps=10.0, reps=3,
                       gather_rs=gather)
    sets = cases_lib.make_data(case)
    res = _exact_run(case, sets)
    y0 = [d for d in res["digests"] if d[2] == 0]
    rec = {"consumers": 2, "begin_t": 0, "prod_t0": 1000, "prod_t1": 5000, "prod_t0_last": 1000, "cons_t0": 6000,
           "cons_t1": 46000, "comb_t0": 47000, "comb_t1": 48000, "pushed_bytes": 0}
    res["timed"] = [[{"call_us": [us] * 3, "device": [rec], "y_after": y0[r][4]} for r in range(4)]
                    for us in (ours, 120.0)]
    res["gemm_us"] = [[60.0] * 3] * 4
    assert run.run_case(types.SimpleNamespace(run_ranks=lambda spec, data: res), case, table)
  per_slot, gather = table
  assert gather["op"] == "gather_rs" and per_slot["op"] == "expert_combine"
  assert gather["transfer_bytes"] == 3 * 16 * 24 * 4 and gather["group_tokens"] == 64
  assert gather["hidden"] == pytest.approx(1 - (80 - 60) / 40)
  lines = timing.tensor_table(table)
  assert lines[0] == timing.TENSOR_HEADER and lines[1] == "| 64 | 60.0 | 100.0 | 120.0 | 80.0 | 0.800 | 50% |"
  assert "TIMED C=manager serialized" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------------
# Expert tensor parallelism (tools/loopback/tensor.py): what the kernels see against the design's rules, stated here
# independently of tensor_parallel.py and plan.py, and the references as the whole experts'.


def _tensor_cases():
  # (The GatherRS cases route and split like the per-slot ones: in the slow pass.)
  out = [pytest.param(c, id=f"tensor-{i}", marks=pytest.mark.slow if c.gather_rs else ())
         for i, c in enumerate(cases_lib.suite("tensor", cases_lib.Case()))]
  return out + [pytest.param(_small_case(**kw), id=f"small-{i}") for i, kw in enumerate(TENSOR_SMALL)]


@pytest.mark.parametrize("case", _tensor_cases())
def test_tensor_slots_plans_and_capacity(case):
  """Each choice j of expert e is TP shard slots j TP + s with its gate, on tensor rank s of e's expert rank (as the
  shard expert of e there); a choice's shards are kept or dropped together, as the whole experts' first come first
  served rule keeps them; the plans count each dropped choice TP times; the capacities are the layer's."""
  from jax_moe_overlap import plan, workspace  # pylint: disable=g-import-not-at-top
  R, T, k, TP, E, E_l = case.ranks, case.tokens, case.top_k, case.tensor, case.experts, case.experts_per_rank
  assert case.invalid() is None, case.invalid()
  assert case.expert_cap == plan.expert_capacity(T, R, k, E, case.capacity_factor or None)  # api.moe_experts'
  assert case.cap == workspace.layer_sizes(T, R // TP, k, E, case.d_model, 2, case.capacity_factor or None,
                                           TP).recv_rows
  data = cases_lib.make_data(dataclasses.replace(case, datasets=1))[0]
  keep = tensor_lib.kept(case, [d.whole.ids for d in data])
  whole_dropped = 0
  for g, d in enumerate(data):
    ids, gates = d.whole.ids, d.whole.gates
    assert d.ids.shape == (T, k * TP)
    s = np.arange(TP)[None, None, :]
    shard_rank = (ids[:, :, None] // E_l) * TP + s                         # tensor rank s of e's expert rank
    np.testing.assert_array_equal(d.ids.reshape(T, k, TP), shard_rank * E_l + ids[:, :, None] % E_l)
    np.testing.assert_array_equal(d.gates.reshape(T, k, TP), np.repeat(gates[:, :, None], TP, axis=2))
    pl = d.plan
    np.testing.assert_array_equal(pl["slot_dest_rank"].reshape(T, k, TP), shard_rank)
    kept_shards = (pl["slot_dest_row"] >= 0).reshape(T, k, TP)
    np.testing.assert_array_equal(kept_shards, np.repeat(keep[g][:, :, None], TP, axis=2), err_msg=f"rank {g}")
    whole_dropped += int((~keep[g]).sum())
  assert sum(int(d.plan["dropped"]) for d in data) == TP * whole_dropped
  if case.capacity_factor > 0:
    assert whole_dropped > 0, "the capacity case drops choices"


@pytest.mark.parametrize("case", _tensor_cases())
def test_tensor_rank_operands(case):
  """Rank g = r TP + t holds rows t K / TP ... of its expert rank's experts' w, and of w1 [E, D, 2F] the gate columns
  t F / TP ... and the up columns F + t F / TP ... (gate first); each received shard slot's lhs row is its choice's
  whole row, columns t K / TP ...; the data are those of the whole experts exactly."""
  R, T, k, TP, K, E_l = case.ranks, case.tokens, case.top_k, case.tensor, case.k_dim, case.experts_per_rank
  Ks, F = K // TP, K // 2
  data = cases_lib.make_data(dataclasses.replace(case, datasets=1))[0]
  whole_w, whole_w1 = data[0].whole.w, data[0].whole.w1
  for g, d in enumerate(data):
    r, t = divmod(g, TP)
    experts = slice(r * E_l, (r + 1) * E_l)
    for part in ("data", "f"):
      np.testing.assert_array_equal(getattr(d.w, part), getattr(whole_w, part)[experts, t * Ks:(t + 1) * Ks])
      if whole_w1 is not None:
        w1 = getattr(whole_w1, part)[experts]
        f = F // TP
        np.testing.assert_array_equal(getattr(d.w1, part), np.concatenate(
            [w1[:, :, t * f:(t + 1) * f], w1[:, :, F + t * f:F + (t + 1) * f]], axis=2))
    for s, src in enumerate(data):
      pl = src.plan
      sel = np.nonzero((pl["slot_dest_rank"] == g) & (pl["slot_dest_row"] >= 0))[0]
      assert np.all(sel % TP == t), "shard slot s goes to tensor rank s"
      h = src.whole.h.data.reshape(T * k, K)[sel // TP, t * Ks:(t + 1) * Ks]
      np.testing.assert_array_equal(d.lhs.data[pl["slot_dest_row"][sel]], h)
    assert d.lhs.data.shape == (int(d.plan["recv_rows"]), Ks), "the received rows (the runner pads them with NaN)"


def test_tensor_references_are_the_whole_experts(monkeypatch):
  """y's reference is the whole experts' output (equal, up to float32 rounding, to the sum of the shards' partials
  over each token's k TP slots); a run that leaves one shard out of y, or that computes with the tensor ranks' w
  swapped, fails the check (the slot references, from each rank's own operands, alone would not see the swap);
  GEMM1's reference is the whole expert's, of which the layer's split gives each rank its gate and up columns."""
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  case = _small_case(ranks=4, tensor=2, dispatch_gemm_pushers=2, capacity_factor=1.0)
  T, kp, N, TP = case.tokens, case.slot_top_k, case.n_dim, case.tensor
  sets = cases_lib.make_data(case)
  assert sum(int(d.plan["dropped"]) for d in sets[0]) > 0
  ex = check_lib.references(case, sets[0])
  for e, d in zip(ex, sets[0]):
    partial_sum = (e.slot.reshape(T, kp, N) * d.gates.reshape(T, kp, 1)).sum(axis=1)
    assert check_lib.rel_err(partial_sum, e.y, np.arange(T))[0] < 1e-6
    assert np.abs(e.y).max() > 0.1  # not trivially zero
    # GEMM1: the whole expert's columns of this rank against the rank's own operands.
    rows = np.nonzero(e.a_checked[: int(d.plan["recv_rows"])])[0]
    assert rows.size
  for g, (e, d) in enumerate(zip(ex, sets[0])):
    own = np.zeros_like(e.a)
    for s, src in enumerate(sets[0]):
      pl = src.plan
      sel = np.nonzero((pl["slot_dest_rank"] == g) & (pl["slot_dest_row"] >= 0))[0]
      own[pl["slot_dest_row"][sel]] = np.einsum("rd,rdk->rk", src.x.f[pl["slot_src_row"][sel]],
                                                d.w1.f[pl["slot_expert"][sel]])
    np.testing.assert_allclose(own, e.a, rtol=1e-5, atol=1e-5)

  # One shard's partial left out of y on rank 0: the check fails.
  case_nodg = _small_case(ranks=4, tensor=2)
  sets = cases_lib.make_data(case_nodg)
  res = _exact_run(case_nodg, sets)
  e0 = check_lib.references(case_nodg, sets[0])[0]
  parts = e0.slot.reshape(T, case_nodg.top_k, TP, N) * sets[0][0].gates.reshape(T, case_nodg.top_k, TP, 1)
  res["first"][0][0]["y"] = parts[:, :, 0].sum(axis=1).astype(ml_dtypes.bfloat16).tobytes()
  v = check_lib.check(case_nodg, sets, res)
  assert not v.passed and "expert_combine rel err y" in v.failures[0]

  # The tensor ranks 0 and 1 computing with each other's w: each rank's partials from its own operands look right,
  # their sum does not.
  swapped = [dataclasses.replace(d) for d in sets[0]]
  swapped[0].w, swapped[1].w = sets[0][1].w, sets[0][0].w
  wrong = check_lib.references(case_nodg, swapped)
  for r in (0, 1):
    y_wrong = (wrong[r].slot.reshape(T, kp, N) * swapped[r].gates.reshape(T, kp, 1)).sum(axis=1)
    assert check_lib.rel_err(y_wrong, wrong[r].y, np.arange(T))[0] > 0.1


def test_run_case_tensor_spec(monkeypatch, capsys):
  """run.py hands the runner the kernels' shapes: k TP slots per token, each rank's K / TP, its shard experts."""
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  from tools.loopback import run  # pylint: disable=g-import-not-at-top
  case = _small_case(ranks=4, tensor=2, dispatch_gemm_pushers=2, dispatch_gemm_mode="train", k_dim=128)
  seen = {}

  def run_ranks(spec, data):
    seen.update(spec=spec, data=data)
    return _exact_run(case, cases_lib.make_data(case))

  assert run.run_case(types.SimpleNamespace(run_ranks=run_ranks), case)
  spec, data = seen["spec"], seen["data"]
  assert (spec["ranks"], spec["top_k"], spec["k_dim"], spec["experts_per_rank"]) == (4, 4, 64, 2)
  assert "tensor" not in spec
  rank = data[0][0]
  assert rank["w"].shape == (2, 64, case.n_dim) and rank["w1"].shape == (2, case.d_model, 64)
  assert rank["gates"].shape == rank["slot_dest_rank"].shape == (case.tokens * 4,)
  assert capsys.readouterr().out.startswith("PASS R=4 TP=2 T=16 k=2 E=4 D=64 K=128 ")


def test_wire_bytes_count_each_row_once_per_destination():
  # Routing 2 at R = 2 with two experts per rank: every token's two choices are rank 0's experts, so rank 1 sends each
  # token's row once with send once (plus an 8-byte entry per slot), twice without; rank 0 sends nothing remote.
  case = dataclasses.replace(cases_lib.Case(), ranks=2, experts=4, tokens=32, routing=2, send_once=1)
  assert not dataclasses.replace(case, send_once=cases_lib.AUTO).sends_once  # the library's default: one per slot
  rng = np.random.default_rng(0)
  ids = [cases_lib.route(rng, case, r) for r in range(case.ranks)]
  plans = cases_lib.make_plans(case, ids)
  row = case.d_model * 2
  assert case.sends_once
  assert cases_lib.wire_bytes(case, plans[1], 1, row) == (32, 32 * row + 64 * 8)
  assert cases_lib.wire_bytes(case, plans[0], 0, row) == (0, 0)
  per_slot = dataclasses.replace(case, send_once=0)
  assert not per_slot.sends_once
  assert cases_lib.wire_bytes(per_slot, plans[1], 1, row) == (64, 64 * row)


def test_regret_rows_and_summary(capsys, monkeypatch):
  # tools/loopback/regret.py on a fake run: dispatch_gemm with a pusher sweep (P = 1, 2, 4 pinned, 0 the model's) and
  # the device's recorded P equal to the host mirror's; the regret is the model's time over the best pinned one.
  import sys  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tools.loopback._jmo_loopback", types.SimpleNamespace(DEADLINE_EXCEEDED=2))
  from jax_moe_overlap import _jmo  # pylint: disable=g-import-not-at-top
  from tools.loopback import regret, run  # pylint: disable=g-import-not-at-top
  model = cases_lib.calibrated_model(2, 50.0)
  case = _small_case(time=True, dispatch_gemm_pushers=cases_lib.AUTO, link_gbps=50.0, reps=3, model=model,
                     dg_sweep=(1, 2, 4, 0))
  sets = cases_lib.make_data(case)
  p = _jmo.model_with_link(_jmo.ModelParams(**dict(zip(
      ("sms", "ctas_per_sm", "tile_m", "tile_n", "tile_us_base", "tile_us_per_k", "cta_gbps", "link_gbps", "seg_us",
       "pusher_gbps", "gather_gbps"), [int(v) for v in model[:4]] + list(model[4:])))), 50.0)
  p.sms = 66
  mirror = []
  for r, d in enumerate(sets[0]):
    mirror.append(_jmo.model_choose_dispatch_pushers_for_plan(p, [int(v) for v in d.plan["send_start"]], r,
                                                              int(d.plan["recv_rows"]), case.d_model * 2,
                                                              case.d_model, case.k_dim, 32))
  res = {"budget": 66, "dg_sweep_us": [[[110.0] * 3] * 2, [[100.0] * 3] * 2, [[104.0] * 3] * 2, [[102.0] * 3] * 2],
         "dg_sweep_pushers": [[1, 1], [2, 2], [4, 4], mirror]}
  row = regret.pusher_row(case, res, sets[0])
  assert row["what"] == "P" and row["best"] == 2 and row["regret"] == pytest.approx(0.02) and row["mirror_agrees"]
  assert regret.consumer_row(case, {"timed": []}, sets[0]) is None  # no consumer sweep in this case
  res["dg_sweep_pushers"][3] = [m + 1 for m in mirror]
  assert not regret.pusher_row(case, res, sets[0])["mirror_agrees"]
  worse = dict(row, regret=0.2)
  lines = regret.summary([row, worse])
  assert lines[0].startswith("regret P: mean 11.0%, worst 20.0% over 2 cases (OUTSIDE the target")
  assert regret.summary([row])[0].startswith("regret P: mean 2.0%, worst 2.0% over 1 cases (within the target")
  # Three interleaved passes (Case.sweep_passes): each P's time is the median of its three runs, so one slow run of
  # the model's P (the ranks' drift in that run) does not make it look worse than the pinned P it equals.
  three = dataclasses.replace(case, sweep_passes=3)
  one_pass = [[110.0], [100.0], [104.0], [100.0]]  # P = 1, 2, 4 and the model's (the same as P = 2) per pass
  slow = [[110.0], [100.0], [104.0], [140.0]]      # a pass where the model's run drifted
  us = [[[t] * 3] * 2 for t in sum(one_pass + slow + one_pass, [])]
  res3 = {"budget": 66, "dg_sweep_us": us, "dg_sweep_pushers": [[1, 1], [2, 2], [4, 4], mirror] * 3}
  row3 = regret.pusher_row(three, res3, sets[0])
  assert row3["best"] == 2 and row3["regret"] == pytest.approx(0.0) and row3["model_us"] == pytest.approx(100.0)
  assert regret.pusher_row(three, dict(res3, dg_sweep_us=us[:4]), sets[0]) is None  # one pass's runs: not this case
  spec = run.runner_spec(three)  # the runner times the sweep three times over, in order
  assert spec["dg_sweep"] == [1, 2, 4, 0] * 3 and "sweep_passes" not in spec
  # FP8 dispatch_gemm: the mirror takes the packed rows' bytes and GEMM1's K as the kernel hands it to the model
  # (Fp8ModelK: the calibration is the bf16 engine's).
  f8 = dataclasses.replace(case, fp8=True, d_model=512, k_dim=256, n_dim=128)
  sets8 = cases_lib.make_data(f8)
  mirror8 = [_jmo.model_choose_dispatch_pushers_for_plan(p, [int(v) for v in d.plan["send_start"]], r,
                                                         int(d.plan["recv_rows"]), 512 + 16, _jmo.model_fp8_k(512),
                                                         f8.k_dim, 32) for r, d in enumerate(sets8[0])]
  assert _jmo.model_fp8_k(3072) == 2048
  assert regret.pusher_row(f8, dict(res, dg_sweep_pushers=[[1, 1], [2, 2], [4, 4], mirror8]), sets8[0])["mirror_agrees"]


def test_timing_suites_align_the_ranks_where_they_say():
  # dispatch-gemm-time ends with its linked R = 2, 4, 8 cases again with every call started together (named apart);
  # regret-push times every P that way, in three interleaved passes.
  dg = cases_lib.suite("dispatch-gemm-time", cases_lib.Case())
  aligned = [c for c in dg if c.per_call_stats]
  assert [c.ranks for c in aligned] == [2, 4, 8] and all(c.link_gbps > 0 and c.name().endswith(" aligned")
                                                         for c in aligned)
  assert len({c.name() for c in dg}) == len(dg)  # every case's line its own (the send-once copies end in send_once)
  for c in cases_lib.suite("regret-push", cases_lib.Case()) + cases_lib.suite("regret-push-shapes", cases_lib.Case()):
    assert c.per_call_stats and c.sweep_passes == 3 and c.dg_sweep == cases_lib.REGRET_P + (0,)
  # regret-push-shapes: dispatch-gemm-shapes' cases, each with the sweep.
  shapes = cases_lib.suite("dispatch-gemm-shapes", cases_lib.Case())
  swept = cases_lib.suite("regret-push-shapes", cases_lib.Case())
  assert [dataclasses.replace(c, dg_sweep=(), sweep_passes=1, per_call_stats=False) for c in swept] == shapes
  # regret-backward: backward-time's cases, the dgrad dispatch_gemm ones with the P sweep, the dx combines with C's.
  back = cases_lib.suite("backward-time", cases_lib.Case())
  swept = cases_lib.suite("regret-backward", cases_lib.Case())
  assert [dataclasses.replace(c, dg_sweep=(), sweep=(), sweep_passes=1, per_call_stats=False, table=True)
          for c in swept] == back
  assert all(c.dg_sweep == cases_lib.REGRET_P + (0,) and c.per_call_stats for c in swept if c.dg)
  assert all(c.sweep == cases_lib.REGRET_C and c.sweep_passes == 3 for c in swept if not c.dg)
  # tensor-time and tensor-backward-time: aligned, per-slot then GatherRS at each size, the backward's W1 transposed.
  for name, backward, sizes in (("tensor-time", False, 3), ("tensor-backward-time", True, 3),
                                 ("tensor-time-deepseek", False, 2)):
    v = cases_lib.suite(name, cases_lib.Case())
    assert all(c.per_call_stats and c.time and c.table and c.transpose_rhs == backward for c in v)
    assert [c.gather_rs for c in v] == [False, True] * sizes
  # The two shapes sit on either side of call_site.tensor_reduce's byte model (4 G <= k TP itemsize: GatherRS).
  from jax_moe_overlap import call_site  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.config import CallConfig  # pylint: disable=g-import-not-at-top
  picks = [call_site.tensor_reduce(CallConfig(), "gpu", c.ranks // c.tensor, c.tensor, c.top_k, 2, c.slots)
           for c in (cases_lib.suite(n, cases_lib.Case())[0] for n in ("tensor-time", "tensor-time-deepseek"))]
  assert picks == ["per_slot", "gather_rs"]
  # dispatch-gemm-order: those cases and dispatch-gemm-time's linked R = 2, 4, 8 ones, aligned, the two phases then
  # expert-major next to each other.
  ordered = cases_lib.suite("dispatch-gemm-order", cases_lib.Case())
  assert [c.producer_order for c in ordered] == [1, 2] * (len(ordered) // 2)
  assert all(c.per_call_stats and c.dg and c.time and c.table for c in ordered)
  linked = [c for c in dg if c.link_gbps > 0 and c.send_once != 1 and c.dispatch_gemm_pushers == cases_lib.AUTO
            and not c.per_call_stats]
  assert [dataclasses.replace(c, producer_order=0, per_call_stats=False) for c in ordered[::2]] == shapes + linked
  # dispatch-gemm-order-fp8: its dispatch-gemm-shapes cases on packed e4m3 rows, both orders.
  fp8 = cases_lib.suite("dispatch-gemm-order-fp8", cases_lib.Case())
  assert fp8 == [dataclasses.replace(c, fp8=True) for c in ordered[:2 * len(shapes)]] and all(c.fp8 for c in fp8)


def test_regret_suite_covers_gather_rs():
  # The regret suite's gather_rs cases (also alone as regret-gather): R = 4 as 2 x 2, R = 8 as 4 x 2 and 2 x 4, each in
  # bf16 and float32, over the emulated NVLink at 370 / R GB/s, a sweep of pinned C and the library's C, with the
  # shipped calibration's model for that link.
  cases = [c for c in cases_lib.suite("regret", cases_lib.Case()) if c.gather_rs]
  assert cases == cases_lib.suite("regret-gather", cases_lib.Case())
  assert sorted((c.expert_ranks, c.tensor, c.f32) for c in cases) == sorted(
      (R_e, TP, f32) for R_e, TP in ((2, 2), (4, 2), (2, 4)) for f32 in (False, True))
  for c in cases:
    assert c.invalid() is None, c.invalid()
    assert c.link_gbps == cases_lib.NVLINK_GBPS / c.ranks and c.model == cases_lib.calibrated_model(c.ranks, c.link_gbps)
    assert c.sweep == cases_lib.REGRET_C and c.consumers == 0 and c.time and not c.table and c.decision_iters > 0
    assert c.variants()[-2:] == [(0, False), (0, True)]  # the library's C, and its serialized form
    # every pinned C and the library's C once per pass, three passes in order, then the serialized form once
    assert c.sweep_passes == 3 and c.variants()[:-1] == [(q, False) for q in c.sweep + (0,)] * 3
    assert max(c.sweep) <= 132 // c.ranks - 1  # every pinned C leaves a producer on an H200 rank's budget
    assert c.rank_k % 64 == 0 and c.n_dim % 64 == 0  # bf16: the wgmma engine, the calibration's tile


def _gather_regret_result(case, sets, policy, fixed, chosen):
  """A simulated timed run of a gather_rs case with a consumer sweep: pinned C = c takes 100 + |c - 2| us, the
  library's C 101 us, and the device records `chosen` per rank; the first producer tile 1 us after the kernel's
  start (pinned) or 1.5 us (the library's C)."""
  def variant(us, consumers, start_ns):
    rec = {"consumers": consumers, "begin_t": 0, "prod_t0": start_ns, "prod_t1": 5000, "prod_t0_last": 1000,
           "cons_t0": 6000, "cons_t1": 7000, "comb_t0": 9000, "comb_t1": 12000, "pushed_bytes": 0, "entry_t": 0}
    return [{"call_us": [us] * 3, "device": [dict(rec, consumers=c)]} for c in consumers]
  timed = [variant(100.0 + abs(c - 2) if c else 101.0 if not ser else 150.0, [c] * case.ranks if c else chosen,
                   1000 if c else 1500) for c, ser in case.variants()]
  return {"budget": 33, "consumer_policy": policy, "fixed_consumers": fixed, "timed": timed}


@pytest.mark.parametrize("n", [9, 10, 11, 8, 12])
def test_model_flag_takes_9_to_11_numbers(n, capsys):
  # --model: the 11 ModelParams numbers in resource_model.h's order; 10 leave gather_gbps 0, 9 pusher_gbps too. The
  # regret's host model (regret._rank_model) reads them by the same order.
  from tools.loopback import regret, run  # pylint: disable=g-import-not-at-top
  vals = [132, 1, 128, 256, 2.4, 0.0108, 29.6, 1745.0, 0.43, 17.3, 14.5][:n] + [1.0] * max(0, n - 11)
  argv = ["--model", ",".join(map(str, vals))]
  if not 9 <= n <= 11:
    with pytest.raises(SystemExit):
      run.parse_args(argv)
    assert "--model takes 11 comma-separated numbers" in capsys.readouterr().err
    return
  _, base = run.parse_args(argv)
  assert base.model == tuple(float(v) for v in vals)
  p, _ = regret._rank_model(dataclasses.replace(base, link_gbps=50.0), 33)  # pylint: disable=protected-access
  assert (p.sms, p.link_gbps, p.cta_gbps) == (33, 50.0, 29.6)
  assert (p.pusher_gbps, p.gather_gbps) == ((17.3 if n > 9 else 0.0), (14.5 if n > 10 else 0.0))


def test_regret_rows_of_gather_rs():
  # tools/loopback/regret.py on a simulated gather_rs sweep: under the model the host mirror is
  # kernel_gather_consumer_ctas on each rank's plan (the device's GatherConsumersOfCall restated), under the fixed
  # policy (float32: the SIMT engine) the workspace's fixed C; the rows' kinds are summarized apart.
  from benchmarks import bench_resource  # pylint: disable=g-import-not-at-top
  from tools.loopback import regret  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  case = dataclasses.replace(_small_case(ranks=4, tensor=2, experts=4, gather_rs=True, tokens=1024, k_dim=14336,
                                         n_dim=4096), time=True, consumers=0, sweep=(1, 2, 4), link_gbps=50.0,
                             model=cases_lib.calibrated_model(4, 50.0), datasets=1)
  assert case.invalid() is None
  # Each rank's plan as consumer_row reads it: seg_rows [E_l, R] flattened (balanced rows, one source empty on rank 3).
  rng = np.random.default_rng(0)
  seg = [rng.integers(400, 700, (case.experts_per_rank, 4)) for _ in range(4)]
  seg[3][:, 0] = 0
  sets = [[types.SimpleNamespace(plan={"seg_rows": s.reshape(-1)}) for s in seg]]
  p, _ = regret._rank_model(case, 33)  # pylint: disable=protected-access
  assert p.sms == 33 and p.link_gbps == 50.0
  want = [bench_resource.kernel_gather_consumer_ctas(p, d.plan["seg_rows"].reshape(case.experts_per_rank, 4).tolist(),
                                                     r, case.tokens, case.slot_top_k, case.n_dim, case.rank_k, 2, 32,
                                                     16) for r, d in enumerate(sets[0])]
  assert all(1 <= c <= 32 for c in want)
  row = regret.consumer_row(case, _gather_regret_result(case, sets, "model", 16, want), sets[0])
  assert row["what"] == "C gather_rs" and row["mirror"] == want and row["mirror_agrees"]
  assert row["best"] == 2 and row["regret"] == pytest.approx(0.01) and row["chosen"] == want
  assert row["producer_start_us"] == {"model": 1.5, "pinned": 1.0}
  assert regret.line(row).endswith("| first tile after kernel start: model 1.50 us, pinned 1.00 us")
  other = [c + 1 for c in want]
  assert not regret.consumer_row(case, _gather_regret_result(case, sets, "model", 16, other), sets[0])["mirror_agrees"]
  fixed = regret.consumer_row(case, _gather_regret_result(case, sets, "fixed", 16, [16] * 4), sets[0])
  assert fixed["what"] == "C gather_rs (fixed policy)" and fixed["mirror"] == [16] * 4 and fixed["mirror_agrees"]
  lines = regret.summary([row, fixed, dict(row, regret=0.2)])
  assert lines[0].startswith("regret C gather_rs: mean 10.5%, worst 20.0% over 2 cases (OUTSIDE the target")
  assert lines[2].startswith("regret C gather_rs (fixed policy): mean 1.0%, worst 1.0% over 1 cases (within")
  # Three interleaved passes: the library's C timed 101, 150 (a run the ranks' drift slowed) and 101 us: its median.
  three = dataclasses.replace(case, sweep_passes=3)
  res = _gather_regret_result(three, sets, "model", 16, want)
  slow = next(i for i, v in enumerate(three.variants()) if v == (0, False) and i > len(case.sweep))
  for rank in res["timed"][slow]:
    rank["call_us"] = [150.0] * 3
  row3 = regret.consumer_row(three, res, sets[0])
  assert row3["best"] == 2 and row3["regret"] == pytest.approx(0.01) and row3["chosen"] == want


def test_the_suites_model_is_the_calibration_of_the_gpu_they_run_on(monkeypatch):
  """run.py hands the suites the calibration the library loads on the runner's GPU (the H100's on an H100), and the
  shipped H200 one where that GPU has none; each case's --model is then that file's constants, its link the rank's."""
  import os  # pylint: disable=import-outside-toplevel
  from jax_moe_overlap import resource  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(cases_lib, "_calibration_file", None)
  monkeypatch.delenv("JMO_CALIBRATION", raising=False)
  h100 = resource.load_params(os.path.join(resource.CALIBRATION_DIR, "nvidia_h100_80gb_hbm3.json"))
  h200 = resource.load_params(os.path.join(resource.CALIBRATION_DIR, "nvidia_h200.json"))
  assert h100.tile_us_base != h200.tile_us_base
  assert cases_lib.calibrated_model(2, 185.0) == tuple(dataclasses.replace(h200, link_gbps=185.0).as_list())
  line = cases_lib.use_device_calibration("NVIDIA H100 80GB HBM3", 132)
  assert "nvidia_h100_80gb_hbm3.json" in line
  assert cases_lib.calibrated_model(2, 185.0) == tuple(dataclasses.replace(h100, link_gbps=185.0).as_list())
  line = cases_lib.use_device_calibration("NVIDIA A100-SXM4-80GB", 108)
  assert "shipped H200" in line and "no resource-model calibration" in line
  assert cases_lib.calibrated_model(4, 92.5) == tuple(dataclasses.replace(h200, link_gbps=92.5).as_list())
