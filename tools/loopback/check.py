"""The loopback checks: what a run of the kernels must have produced, judged against float32 host references.

* The first call of each rank on each data set against the references (with expert tensor parallelism, y and GEMM1
  against the whole experts': tools/loopback/tensor.py): dispatch's rows exactly (rows past the received ones zero; outputs were poisoned before the call, so an unwritten row shows), expert_combine's y and
  slot outputs by relative error (its input's rows past the received ones are NaN: a read of one shows),
  dispatch_gemm's GEMM1 (its float32 product or preactivation, and its SwiGLU h) by max-norm relative error and no
  non-finite value. dispatch_gemm leaves every result's rows past the kept ones unwritten (no consumer reads them):
  they must still hold the poison. Where dispatch_gemm keeps no x_recv (its inference mode), the dispatch is
  checked through h alone.
* Every later call bit for bit against that first call (the kernels are deterministic), also after the timed calls.
* dispatch_gemm equals the same dispatch and GEMM1 made as two calls (Dispatch, then GroupedMatmul or
  GroupedMatmulSwiGlu), bit for bit in the kept rows.
* A forced timeout is reported by the next call of every rank (DEADLINE_EXCEEDED, "timed out"), and the calls
  after it are correct again; every call ran (2 per rank and iteration). With rank 0's stream held past the timeout
  (stuck_stream_ms), the call before that report gives up within the timeout on every rank (rank 0 waiting for its
  stream, the others at the recovery barrier).
* A timed run recorded every rank's consumer count C, with C >= 1 exactly where the rank had rows to push (gather_rs:
  on every rank, which ships a partial to every source).
* gather_rs (tools/loopback/tensor.py): its y against the whole experts; its rows output (the GEMM's rows) against
  each slot's product from the rank's own operands, exactly zero past the kept rows; and y bit for bit the operator's
  float32 sums restated on the host from those rows (tensor.gather_sums: the CPU handler's order), so the kernel's
  reduce-scatter equals the CPU handler's on the same GEMM rows.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from tools.loopback import tensor
from tools.loopback.cases import Case, RankData, Values, remote_rows

MAX_LOGGED = 20


@dataclasses.dataclass
class Expected:
  """Host references of one rank's outputs on one data set."""
  recv: np.ndarray          # [cap, D] in the call's dtype (bytes compared exactly)
  y: np.ndarray             # [T, N] float32
  slot: np.ndarray          # [P, N] float32
  a: np.ndarray | None      # [cap, K] float32: dispatch_gemm's GEMM1 preactivation (at the rows a_checked marks)
  a_checked: np.ndarray | None  # [cap] bool: rows whose GEMM1 reference was computed


def swiglu(pre: np.ndarray) -> np.ndarray:
  """[rows, 2F] -> [rows, F]: silu(pre[:, :F]) * pre[:, F:] in float64."""
  gate, up = np.split(pre.astype(np.float64), 2, axis=1)
  return gate / (1.0 + np.exp(-gate)) * up


def scaled_rows(case: Case, src: RankData) -> np.ndarray:
  """[P, row] the row each slot of `src` sends, in the rows' dtype: its token's row of x, with row_scale the float32
  product gates[p] * x[token] rounded once to the rows' dtype (the dispatch's rule)."""
  token = src.plan["slot_src_row"]
  if not case.row_scale:
    return src.x.data[token]
  product = src.x.rows(token) * src.gates[:, None]  # (float32: rounded once)
  return product if case.f32 else product.astype(ml_dtypes.bfloat16).view(np.uint16)


def references(case: Case, data: list[RankData]) -> list[Expected]:
  """Per rank, the references of one data set, from the plans and the float32 values of the operands: the dispatch
  and the slot outputs from each rank's own operands; y and GEMM1 from them too, or with `tensor` > 1 from the whole
  experts (tensor.references)."""
  R, T, k, N, K, P, cap = case.ranks, case.tokens, case.slot_top_k, case.n_dim, case.rank_k, case.slots, case.cap
  stride = case.check_stride
  dg = case.dg
  whole = case.tensor > 1
  out = []
  for d in range(R):
    x = data[d].x.data  # (the call's rows: D elements, or under fp8 with dispatch_gemm packed rows of bytes)
    out.append(Expected(np.zeros((cap, x.shape[1]), x.dtype), np.zeros((T, N), np.float32),
                        np.zeros((P, N), np.float32), np.zeros((cap, K), np.float32) if dg else None,
                        np.zeros(cap, bool) if dg else None))
  sel = {}  # (s, d, e): the checked slots of source s kept by expert e of rank d
  for s in range(R):
    pl = data[s].plan
    dest_rank, dest_row, expert = pl["slot_dest_rank"], pl["slot_dest_row"], pl["slot_expert"]
    token = pl["slot_src_row"]
    checked_slot = (token % stride) == 0
    sent = scaled_rows(case, data[s])
    for d in range(R):
      to_d = (dest_rank == d) & (dest_row >= 0)
      out[d].recv[dest_row[to_d]] = sent[to_d]
      for e in range(case.experts_per_rank):
        sel[s, d, e] = np.nonzero(to_d & checked_slot & (expert == e))[0]
  # Per expert, one product over the checked rows of every source (each weight converted and read once).
  for d in range(R):
    for e in range(case.experts_per_rank):
      parts = [(s, sel[s, d, e]) for s in range(R) if sel[s, d, e].size]
      if not parts:
        continue
      recv_rows = np.concatenate([data[s].plan["slot_dest_row"][i] for s, i in parts])
      # expert_combine: the slot's row of lhs on its expert's rank, times that expert's w, back on the source.
      slot = data[d].lhs.rows(recv_rows) @ data[d].w.rows(e)
      if dg and not whole:  # GEMM1 at the expert's rank: the dispatched row times w1[expert]
        tokens = (Values(out[d].recv[recv_rows]).f if case.row_scale else
                  np.concatenate([data[s].x.rows(data[s].plan["slot_src_row"][i]) for s, i in parts]))
        out[d].a[recv_rows] = tokens @ data[d].w1.rows(e)
        out[d].a_checked[recv_rows] = True
      at = 0
      for s, i in parts:
        out[s].slot[i] = slot[at:at + i.size]
        at += i.size
  if whole:
    tensor.references(case, data, out)
    return out
  for s in range(R):
    weighted = out[s].slot.reshape(T, k, N) * data[s].gates.reshape(T, k, 1)
    out[s].y = weighted.sum(axis=1, dtype=np.float32)
  return out


def _floats(raw: bytes, f32: bool, shape) -> np.ndarray:
  if f32:
    return np.frombuffer(raw, np.float32).reshape(shape)
  return np.frombuffer(raw, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32).reshape(shape)


def _dg_parts(case: Case, key: str, raw: bytes, cap: int) -> list[np.ndarray]:
  """A dispatch_gemm result's bytes as [cap, row bytes] arrays: one, or under fp8 with the SwiGLU (h and a e4m3, each
  followed by its 1 x 128 scales in the same buffer: tools/loopback/runner.cc) the values and the scales."""
  b = np.frombuffer(raw, np.uint8)
  if not b.size:
    return []
  if case.fp8 and case.swiglu and key.rstrip("2") in ("a", "pre"):
    cols = case.rank_k // 2 if key.rstrip("2") == "a" else case.rank_k
    return [b[:cap * cols].reshape(cap, cols), b[cap * cols:].reshape(cap, -1)]
  return [b.reshape(cap, -1)]


def _fp8_rows(parts: list[np.ndarray]) -> np.ndarray:
  """(e4m3 values [cap, C], their 1 x 128 scales' bytes [cap, C / 128 x 4]) -> float32 [cap, C], dequantized."""
  q, s = parts[0].view(ml_dtypes.float8_e4m3fn).astype(np.float32), parts[1].view(np.float32)
  return (q.reshape(q.shape[0], -1, 128) * s[:, :, None]).reshape(q.shape)


# fp8: a dispatch_gemm result quantized to e4m3 (h, a) against its float reference: e4m3 keeps 3 mantissa bits, so an
# element of a tile is off by up to 2^-4 of itself (half its spacing), at most 2^-4 of the tile's largest; with the
# FP8 GEMM's own error below 1e-2, 0.08 of the largest reference value.
FP8_QUANTIZED_TOL = 0.08


def rel_err(got: np.ndarray, ref: np.ndarray, rows: np.ndarray) -> tuple[float, int]:
  """Relative Frobenius error over the selected rows, and the count of non-finite values among them."""
  g, r = got[rows].astype(np.float64), ref[rows].astype(np.float64)
  nonfinite = int(np.count_nonzero(~np.isfinite(g)))
  num = float(np.sum((g - r) ** 2))
  den = max(float(np.sum(r * r)), 1e-30)
  return float(np.sqrt(num / den)), nonfinite


@dataclasses.dataclass
class Verdict:
  """What check() found on one case."""
  passed: bool = False
  failures: list[str] = dataclasses.field(default_factory=list)
  failure_count: int = 0
  max_rel_y: float = 0.0
  max_rel_slot: float = 0.0
  tol: float = 0.0
  bit_checks: int = 0
  max_recv_rows: int = 0
  dropped: int = 0
  timeout_msg: str = ""
  identical: list[bool] = dataclasses.field(default_factory=list)  # per timed variant
  remote_rows: list[int] = dataclasses.field(default_factory=list)  # per rank, data set 0: rows its consumer pushes

  def fail(self, msg: str) -> None:
    self.failure_count += 1
    if len(self.failures) < MAX_LOGGED:
      self.failures.append(msg)


def _check_gather(case: Case, ranks: list[RankData], expected: list[Expected], first: list[dict], first_iter: dict,
                  ds: int, v: Verdict) -> None:
  """gather_rs on one data set (the first call of every rank): its rows output and y's bits (module docstring)."""
  R, T, N, cap = case.ranks, case.tokens, case.n_dim, case.cap
  if any((ds, r) not in first_iter for r in range(R)):
    return
  rows = [_floats(first[r]["slot"], case.f32, (cap, N)) for r in range(R)]
  for d in range(R):
    where = f"rank {d} iter {first_iter[(ds, d)]}"
    kept = int(ranks[d].plan["recv_rows"])
    raw = np.frombuffer(first[d]["slot"], np.uint8).reshape(cap, -1)
    if np.any(raw[kept:] != 0):
      v.fail(f"{where}: gather_rs rows past the {kept} kept ones are not zero")
    # Each checked slot of every source: its product at the recv row it has here (expected[s].slot).
    got, ref = [], []
    for s in range(R):
      pl = ranks[s].plan
      p = np.nonzero((pl["slot_dest_rank"] == d) & (pl["slot_dest_row"] >= 0) &
                     (pl["slot_src_row"] % case.check_stride == 0))[0]
      got.append(rows[d][pl["slot_dest_row"][p]])
      ref.append(expected[s].slot[p])
    if got:
      g, r = np.concatenate(got), np.concatenate(ref)
      e, nonfinite = rel_err(g, r, np.arange(len(g)))
      v.max_rel_slot = max(v.max_rel_slot, e)
      if not e < v.tol or nonfinite:
        v.fail(f"{where}: gather_rs rows rel err {e:g}, non-finite {nonfinite} (tolerance {v.tol:g})")
  for s, y in enumerate(tensor.gather_sums(case, ranks, rows)):
    want = y.tobytes() if case.f32 else y.astype(ml_dtypes.bfloat16).tobytes()
    if want != first[s]["y"]:
      got_y = _floats(first[s]["y"], case.f32, (T, N))
      bad = int(np.count_nonzero(np.any(got_y.view(np.uint32) != _floats(want, case.f32, (T, N)).view(np.uint32),
                                        axis=1)))
      v.fail(f"rank {s} iter {first_iter[(ds, s)]}: gather_rs y differs from its float32 sums restated on the host "
             f"(tensor.gather_sums) in {bad} of {T} tokens")


def check(case: Case, sets: list[list[RankData]], result: dict) -> Verdict:
  """Judges one run (tools/loopback/module.cc's run_ranks result) of `case` over the data `sets`."""
  from tools.loopback import _jmo_loopback  # pylint: disable=g-import-not-at-top
  v = Verdict(tol=1e-5 if case.f32 and not case.fp8 else 1e-2)  # (FP8: its tensor cores keep ~14 bits per chunk)
  R, T, k, N, K, P, cap = case.ranks, case.tokens, case.slot_top_k, case.n_dim, case.rank_k, case.slots, case.cap
  dg = case.dg
  for msg in result["errors"]:
    v.fail(msg)
  for ranks in sets[:1]:
    v.remote_rows = [remote_rows(d.plan, R, r) for r, d in enumerate(ranks)]
  for ranks in sets:
    for d in ranks:
      v.max_recv_rows = max(v.max_recv_rows, int(d.plan["recv_rows"]))
      v.dropped += int(d.plan["dropped"]) // case.tensor  # the layer's count: a dropped choice is `tensor` slots

  stride = case.check_stride
  slot_rows = (np.arange(P) // k) % stride == 0
  token_rows = np.arange(T) % stride == 0
  first_iter = {}
  for it, r, ds, *_ in result["digests"]:
    first_iter.setdefault((ds, r), it)
  for ds, ranks in enumerate(sets):
    if not any(key[0] == ds for key in first_iter):
      continue
    expected = references(case, ranks)
    if case.gather_rs:
      _check_gather(case, ranks, expected, result["first"][ds], first_iter, ds, v)
    for r, ex in enumerate(expected):
      if (ds, r) not in first_iter:
        continue
      where = f"rank {r} iter {first_iter[(ds, r)]}"
      got = result["first"][ds][r]
      kept = int(ranks[r].plan["recv_rows"])
      recv = np.frombuffer(got["recv"], np.uint8).reshape(cap, -1)  # bytes: NaN poison and -0.0 count as different
      # dispatch: every row (zeros past the kept ones); dispatch_gemm: the kept rows (the rest: below)
      rows = kept if dg else cap
      bad = int(np.count_nonzero(np.any(recv[:rows] != ex.recv.view(np.uint8).reshape(cap, -1)[:rows], axis=1)))
      if bad and case.keeps_recv:
        v.fail(f"{where}: dispatch output differs from the reference in {bad} of {rows} rows")
      ey, ny = rel_err(_floats(got["y"], case.f32, (T, N)), ex.y, token_rows)
      es, ns = (0.0, 0) if case.gather_rs else rel_err(_floats(got["slot"], case.f32, (P, N)), ex.slot, slot_rows)
      v.max_rel_y, v.max_rel_slot = max(v.max_rel_y, ey), max(v.max_rel_slot, es)
      if not (ey < v.tol and es < v.tol) or ny + ns:
        v.fail(f"{where}: expert_combine rel err y {ey:g}, slots {es:g}, non-finite {ny + ns} (tolerance {v.tol:g})")
      if dg:
        checks = []  # (name, got [cap, cols] float32, reference, tolerance)
        if case.fp8 and case.swiglu:
          checks.append(("h", _fp8_rows(_dg_parts(case, "a", got["a"], cap)), swiglu(ex.a), FP8_QUANTIZED_TOL))
          if case.dispatch_gemm_mode == "train":
            checks.append(("preactivation", _fp8_rows(_dg_parts(case, "pre", got["pre"], cap)), ex.a,
                           FP8_QUANTIZED_TOL))
        elif case.fp8:  # (the FP8 GEMM on the dequantized operands' float32 reference)
          checks.append(("GEMM1", np.frombuffer(got["a"], np.float32).reshape(cap, K), ex.a, 1e-2))
        elif case.swiglu:
          h = _floats(got["a"], False, (cap, K // 2))
          checks.append(("h", h, swiglu(ex.a), 1e-2))
          if case.dispatch_gemm_mode == "train":
            checks.append(("preactivation", np.frombuffer(got["pre"], np.float32).reshape(cap, K), ex.a, 1e-4))
        elif case.dg_out_bf16:  # (the float32 product rounded once to bf16)
          checks.append(("GEMM1", _floats(got["a"], False, (cap, K)), ex.a, 1e-2))
        else:
          checks.append(("GEMM1", np.frombuffer(got["a"], np.float32).reshape(cap, K), ex.a, 1e-4))
        for name, a, ref, tol in checks:
          nonfinite = int(np.count_nonzero(~np.isfinite(a[:kept])))
          diff = np.abs(a[ex.a_checked].astype(np.float64) - ref[ex.a_checked])
          num = float(diff.max()) if diff.size else 0.0
          den = float(np.abs(ref[ex.a_checked]).max()) if diff.size else 0.0
          ea = num / den if den > 0 else num
          if not ea < tol or nonfinite:
            v.fail(f"{where}: dispatch_gemm {name} rel err {ea:g}, non-finite {nonfinite} (tolerance {tol:g})")
        results = ("recv", "a", "pre") if case.keeps_recv else ("a", "pre")
        for key in results:  # rows past the kept ones: left as poisoned (all bits set), never written
          for part in _dg_parts(case, key, got[key], cap):
            pad = part[kept:]
            if np.any(pad != 0xFF):
              v.fail(f"{where}: dispatch_gemm {key}: {int(np.count_nonzero(np.any(pad != 0xFF, axis=1)))} rows past "
                     "the kept ones were written")
        differ = {key: int(any(a[:kept].tobytes() != b[:kept].tobytes() for a, b in
                               zip(_dg_parts(case, key, got[key], cap), _dg_parts(case, key + "2", got[key + "2"], cap))))
                  for key in results}
        if any(differ.values()):
          v.fail(f"{where}: dispatch_gemm differs from dispatch + GEMM1 as two calls in the kept rows ({differ})")

  # Every later call on a data set: bit for bit the first call's outputs.
  first_digest = {}
  for it, r, ds, *digests in result["digests"]:
    ref = first_digest.setdefault((ds, r), digests)
    if ref is digests:
      continue
    v.bit_checks += 1
    if digests != ref:
      recv, y, slot, a, pre = (int(x != y_) for x, y_ in zip(digests, ref))
      v.fail(f"rank {r} iter {it}: outputs differ from the first call on the same data (recv {recv}, y {y}, "
             f"slots {slot}{f', GEMM1 {a}, preactivation {pre}' if dg else ''})")

  if 0 <= case.timeout_at < case.iters:
    for r, rep in enumerate(result["timeout"]):
      if rep["reported"] and (rep["code"] != _jmo_loopback.DEADLINE_EXCEEDED or "timed out" not in rep["msg"]):
        v.fail(f"rank {r}: unexpected error after the forced timeout: {rep['msg']}")
    if result["timeout"]:
      v.timeout_msg = result["timeout"][0]["msg"]
  if 0 <= case.timeout_at < case.iters and case.stuck_stream_ms > 0:
    # Rank 0's recovery gives up on its held stream, the others at the barrier rank 0 never reaches; each within
    # the call's timeout, well before the stream is free.
    for r, rep in enumerate(result["timeout"]):
      where = "for its stream" if r == 0 else "at the recovery barrier"
      if (not rep["stuck_reported"] or rep["stuck_code"] != _jmo_loopback.DEADLINE_EXCEEDED
          or where not in rep["stuck_msg"]):
        v.fail(f"rank {r}: with rank 0's stream held, expected a deadline {where!r}, got "
               f"{'no error' if not rep['stuck_reported'] else repr(rep['stuck_msg'])}")
      elif rep["stuck_ms"] > case.short_timeout_ms + 0.5 * case.stuck_stream_ms:
        v.fail(f"rank {r}: with rank 0's stream held {case.stuck_stream_ms} ms, its call returned after "
               f"{rep['stuck_ms']:.0f} ms (timeout {case.short_timeout_ms} ms)")

  # Timed calls ran on data set 0: y after each variant must equal the checked call's.
  for vi, (consumers, serialize) in enumerate(case.variants() if not dg else []):
    same = True
    for r in range(R):
      after = result["timed"][vi][r]["y_after"] if vi < len(result["timed"]) else None
      ref = first_digest.get((0, r))
      if after is not None and ref is not None and after != ref[1] and result["timed"][vi][r]["call_us"]:
        same = False
        v.fail(f"rank {r}: outputs after the timed calls with C={consumers}{' (serialized)' if serialize else ''} "
               "differ from the checked call")
    v.identical.append(same)

  chosen_ok = True
  if case.time and not dg:
    last = result["timed"][-1] if result["timed"] else []
    chosen = [t["device"][-1]["consumers"] if t["device"] else 0 for t in last]
    chosen_ok = len(chosen) == R and all((c > 0) == (rows > 0 or case.gather_rs)
                                         for c, rows in zip(chosen, v.remote_rows))
    if not chosen_ok:
      v.fail(f"consumer counts {chosen} do not match the ranks with rows to push {v.remote_rows}")
  if result["calls"] != 2 * R * case.iters:
    v.fail(f"{result['calls']} calls ran of {2 * R * case.iters}")
  v.passed = v.failure_count == 0
  return v
