"""The loopback harness: R ranks of the library's kernels on one GPU, every call checked.

  python -m tools.loopback.run --suite full         R = 2, 4, 8 x balanced / moderate / extreme routing, float32,
                                                    capacity drops, a held-back rank, a forced timeout with
                                                    recovery, 1000 consecutive iterations, w transposed on every
                                                    producer engine, the resource suite
  python -m tools.loopback.run --suite resource     the device-side manager and the serialized mode
  python -m tools.loopback.run --suite dispatch-gemm        dispatch and GEMM1 in one launch, R = 1, 2, 4, 8, its
                                                            three result modes, a forced timeout, an emulated link
  python -m tools.loopback.run --suite dispatch-gemm-time   dispatch + GEMM1 as two calls vs dispatch_gemm, timed
                                                            (also over an emulated NVLink)
  python -m tools.loopback.run --suite dispatch-gemm-fp8    dispatch-gemm on packed e4m3 rows (dispatch_gemm's FP8
                                                            kernel; its twin: the dispatch, then the FP8 GEMM1 on the
                                                            rows unpacked on the host), checked
  python -m tools.loopback.run --suite dispatch-gemm-time-fp8   dispatch-gemm-time on packed e4m3 rows
  python -m tools.loopback.run --suite dispatch-gemm-shapes     its training forward at Mixtral- and DeepSeek-like
                                                                shapes, R = 2 and 4 over the emulated NVLink
  python -m tools.loopback.run --suite dispatch-gemm-variants   its Mixtral-like R = 4 case untimed, as it is and
                                                                with one thing changed each
  python -m tools.loopback.run --suite dispatch-gemm-shapes-fp8 the same on packed e4m3 rows (x_recv stored by the
                                                                tiles, then copied by the side units)
  python -m tools.loopback.run --suite combine-time         expert_combine vs its serialized form and GEMM2 alone,
                                                            over an emulated NVLink, R = 2, 4, 8, three shapes
  python -m tools.loopback.run --suite combine-fp8          expert_combine with the FP8 producer (e4m3 operands),
                                                            checked: R = 1, 2, 4, 8, drops, serialized, a link
  python -m tools.loopback.run --suite combine-time-fp8     combine-time with the FP8 producer
  python -m tools.loopback.run --suite consumer-rate        expert_combine's consumer alone (serialized) and beside
                                                            the running GEMM, C = 1 and 2, R = 2, three shapes:
                                                            CONSUMER lines (timing.consumer_rate_lines)
  python -m tools.loopback.run --suite backward-time        the backward's exchanges over an emulated NVLink: the dgrad
                                                            dispatch with dh = dy W2^T (dispatch_gemm, plain mode) and
                                                            the dx combine (K = 2F), R = 2, 4, 8, vs serialized
  python -m tools.loopback.run --suite dgrad-row-scale      its dgrad dispatch_gemm with gates * dy as the
                                                            dispatched rows against the rows scaled by the call
                                                            (row_scale), each pair twice, calls aligned
  python -m tools.loopback.run --suite regret       the resource manager's C (expert_combine, gather_rs) and P
                                                    (dispatch_gemm) against sweeps of pinned counts over the emulated
                                                    NVLink: REGRET lines and the mean / worst regret per kind (target
                                                    3% / 10%)
  python -m tools.loopback.run --suite regret-combine   its expert_combine cases alone: seed, Mixtral-like and
                                                        DeepSeek-like shapes at R = 2, 4, 8 over the emulated NVLink
  python -m tools.loopback.run --suite regret-gather    its gather_rs cases alone: R = 4 as 2 x 2, R = 8 as 4 x 2 and
                                                        2 x 4, bf16 (the model's C) and float32 (the fixed C)
  python -m tools.loopback.run --suite regret-push      its dispatch_gemm cases alone: P at R = 2, 4, 8 over the
                                                        emulated NVLink and at R = 2 at HBM speed, the sweep timed
                                                        in three interleaved passes
  python -m tools.loopback.run --suite regret-push-shapes   the same sweep on dispatch-gemm-shapes' Mixtral- and
                                                            DeepSeek-like cases at R = 2 and 4
  python -m tools.loopback.run --suite regret-backward  the same sweeps on backward-time's cases: P for the dgrad
                                                        dispatch_gemm, C for the dx combine
  python -m tools.loopback.run --suite dispatch-gemm-order  dispatch_gemm's GEMM tile order: the own rows' m-tiles
                                                            first, then expert-major, at dispatch-gemm-shapes' cases
                                                            and dispatch-gemm-time's linked ones, calls aligned
  python -m tools.loopback.run --suite dispatch-gemm-order-fp8  its dispatch-gemm-shapes cases on packed e4m3 rows
  python -m tools.loopback.run --suite tensor       expert tensor parallelism: R = 4 as 2 x 2, R = 8 as 2 x 4 and
                                                    4 x 2 (expert x tensor ranks), y against the whole experts,
                                                    the shards' partials summed per slot and by GatherRS
  python -m tools.loopback.run --suite tensor-time  GEMM2 + GatherRS overlapped vs serialized vs the per-slot path
                                                    at TP = 2 / EP = 2, Mixtral-like, 4096-16384 tokens, one table
                                                    (--tokens 1024|2048|4096: one of its shapes, per rank)
  python -m tools.loopback.run --suite tensor-backward-time  the same for the backward's dx = da W1^T (K = 2F, W1
                                                             read transposed) and its reduction over the tensor group
  python -m tools.loopback.run --suite tensor-time-deepseek  tensor-time's forward at a DeepSeek-like shape (64
                                                             experts, top-8: where the byte model picks GatherRS)
  python -m tools.loopback.run --suite small        one-rank calls at small sizes (for compute-sanitizer)
  python -m tools.loopback.run --suite small-mma    the same without the wgmma-producer cases (for racecheck)
  python -m tools.loopback.run --ranks 4 --routing 1 --iters 100 ...   one case (the options: cases.Case)

Prints one PASS/FAIL line per case, then (timed cases with --table, as the *-time suites' are) one markdown table of
their overlap rows (timing.overlap_row), then "loopback: N of M cases passed"; exits 1 if a case fails, 2 if the harness
cannot run (no GPU, runner not built, bad options). Run from the repository root after building tools/
(tools/CMakeLists.txt); the plans come from jax_moe_overlap.plan under JAX on the CPU, so JAX never takes GPU memory.

Timing (benchmarks/loopback_runner.py drives these):
  --time                   after the checked calls, time expert_combine alone on data set 0 (--warmup, --reps);
                           one TIMED and one `RESULT {json}` line per variant
  --sweep-consumers 1,2,4  one variant per C, then the manager, then the manager serialized
  --model a,b,...          the workspace's 11 ModelParams (resource_model.h order; 10: no gather rate, 9: nor a
                           pusher rate)
  --plain-copy             the consumer pushes with 16-byte loads and stores instead of TMA bulk copies
  --push-slots N, --push-read-lag N, --push-issuers N
                           the bulk-copy consumer's ring slots, stores that may still read their slot, issuing
                           threads per CTA (CallConfig.consumer_tuning; defaults as the library's)
  --per-call-stats         start every timed call together on every rank (after its stream drained and a barrier)
                           and time it from its start; expert_combine's also read their device spans (and a TIMELINE
                           line)
  --dispatch-gemm P --dispatch-gemm-mode plain|train|infer
                           every dispatch a dispatch_gemm with P pushing CTAs (auto: the library's count for the
                           rank's SMs), and its results (cases.Case)
  --send-once 0|1          every dispatch sends a token's row once per destination rank (1) or once per slot (0);
                           default the library's rule (at two ranks or more)
  --x-recv-copied          with --dispatch-gemm: its x_recv copied by its side units instead of stored by the GEMM
                           tiles from their A tiles in shared memory (CallConfig.x_recv_from_tiles=False)
  --out-bf16               with --dispatch-gemm-mode plain: its product rounded once to bf16 (the layer's dh)
  --row-scale              every dispatch (and dispatch_gemm) lands slot p's row scaled by its gate (the calls'
                           row_scale, as the layer's backward dispatches gates * dy)
  --dispatch-pushers-sweep 1,2,4,0
                           with --dispatch-gemm and --time: also the fused call per P (0: the library's choice), and
                           with --model the regret of its choice (tools/loopback/regret.py)
  --sweep-passes N         time the sweeps N times over, interleaved; each count's time the median over the passes
  --link-gbps G            pace every push to another rank (dispatch rows, expert_combine bands) as over a link of
                           G GB/s per rank (0: HBM speed)
  --table                  with --time: also the GEMM alone (and expert_combine serialized), and the overlap row
  --tensor TP              expert tensor parallelism: the --ranks are ranks / TP expert ranks x TP tensor ranks
                           (tools/loopback/tensor.py; K is the whole expert's)
  --gather-rs              with --tensor: GEMM2 + GatherRS in expert_combine's place
  --fp8                    expert_combine's producer on e4m3 operands (the FP8 grouped GEMM's loop; K and N multiples
                           of 128): the FP8 layer's GEMM2 and way back; with --dispatch-gemm, dispatch_gemm
                           on packed e4m3 rows too (D a multiple of 512)
  --decision-cost N        time the device-side choice (N evaluations in one CTA) on rank 0's plan
  --check-tokens N         check the expert outputs of about N tokens per rank (big timing shapes)
  --copy-ceiling B1,B2     only: median cudaMemcpyAsync device-to-device time of each size
  --device-info            only: the device's name and SM count, the producer engine and tile (calibrate.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

# Before CUDA or JAX start in this process: R rank streams must not share hardware queues (a waiting kernel would
# block another rank's kernel behind it); every kernel loads up front (lazy loading can wait for running kernels,
# and ranks sharing a GPU spin on each other's); JAX computes the plans on the CPU and leaves the GPU alone.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ["JAX_PLATFORMS"] = "cpu"

from tools.loopback import cases as cases_lib  # noqa: E402
from tools.loopback import check as check_lib  # noqa: E402
from tools.loopback import regret as regret_lib  # noqa: E402
from tools.loopback import timing  # noqa: E402


def _ints(s: str) -> tuple[int, ...]:
  return tuple(int(float(v)) for v in s.split(",") if v)


def _floats(s: str) -> tuple[float, ...]:
  return tuple(float(v) for v in s.split(",") if v)


def _pushers(s: str) -> int:
  return cases_lib.AUTO if s == "auto" else int(s)


def parse_args(argv):
  ap = argparse.ArgumentParser(prog="python -m tools.loopback.run", description=__doc__.split("\n")[0])
  ap.add_argument("--suite", choices=cases_lib.SUITES)
  opt = {  # option -> Case field and type (the defaults are Case's)
      "--ranks": ("ranks", int), "--tokens": ("tokens", int), "--top-k": ("top_k", int),
      "--experts": ("experts", int), "--d-model": ("d_model", int), "--k-dim": ("k_dim", int),
      "--n-dim": ("n_dim", int), "--iters": ("iters", int), "--routing": ("routing", int),
      "--zipf": ("zipf", float), "--capacity-factor": ("capacity_factor", float),
      "--delay-rank": ("delay_rank", int), "--delay-us": ("delay_us", int), "--timeout-at": ("timeout_at", int),
      "--timeout-ms": ("timeout_ms", int), "--stuck-stream-ms": ("stuck_stream_ms", int),
      "--datasets": ("datasets", int), "--seed": ("seed", int),
      "--consumers": ("consumers", int), "--sm-budget": ("sm_budget", int), "--device": ("device", int),
      "--warmup": ("warmup", int), "--reps": ("reps", int), "--decision-cost": ("decision_iters", int),
      "--check-tokens": ("check_tokens", int), "--dispatch-gemm": ("dispatch_gemm_pushers", _pushers),
      "--sweep-consumers": ("sweep", _ints), "--model": ("model", _floats),
      "--push-slots": ("push_slots", int), "--push-read-lag": ("push_read_lag", int),
      "--push-issuers": ("push_issuers", int), "--dispatch-gemm-mode": ("dispatch_gemm_mode", str),
      "--link-gbps": ("link_gbps", float), "--tensor": ("tensor", int), "--send-once": ("send_once", int),
      "--dispatch-pushers-sweep": ("dg_sweep", _ints), "--sweep-passes": ("sweep_passes", int),
      "--producer-band-m": ("producer_band_m", int), "--producer-order": ("producer_order", int),
  }
  for flag, (dest, kind) in opt.items():
    ap.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS)
  for flag, dest in (("--f32", "f32"), ("--transpose-rhs", "transpose_rhs"), ("--serialize", "serialize"),
                     ("--time", "time"), ("--per-call-stats", "per_call_stats"), ("--table", "table"),
                     ("--gather-rs", "gather_rs"), ("--fp8", "fp8"), ("--out-bf16", "dg_out_bf16"),
                     ("--row-scale", "row_scale")):
    ap.add_argument(flag, dest=dest, action="store_true", default=argparse.SUPPRESS)
  ap.add_argument("--plain-copy", dest="bulk_copy", action="store_false", default=argparse.SUPPRESS)
  ap.add_argument("--x-recv-copied", dest="x_recv_from_tiles", action="store_false", default=argparse.SUPPRESS)
  ap.add_argument("--copy-ceiling", type=_floats, default=None)
  ap.add_argument("--device-info", action="store_true")
  args = ap.parse_args(argv)
  fields = {f.name for f in dataclasses.fields(cases_lib.Case)}
  base = cases_lib.Case(**{k: v for k, v in vars(args).items() if k in fields})
  if base.model is not None and len(base.model) not in (9, 10, 11):
    ap.error(f"--model takes 11 comma-separated numbers (ModelParams order; 10: no gather rate, 9: nor a pusher "
             f"rate), got {len(base.model)}")
  return args, base


def _refuse(why: str):
  print(f"loopback: {why}", file=sys.stderr, flush=True)
  sys.exit(2)


def load_runner():
  """The compiled runner, or exit 2 saying why it cannot run here."""
  try:
    from tools.loopback import _jmo_loopback  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    _refuse(f"the runner is not built ({e}); build tools/ (cmake -S tools -B build/tools && cmake --build "
            "build/tools) and copy build/tools/_jmo_loopback*.so into tools/loopback/")
  n, why = _jmo_loopback.device_count()
  if n == 0:
    _refuse(f"needs a CUDA GPU ({why})")
  return _jmo_loopback


def use_device_calibration(runner, base: cases_lib.Case) -> str:
  """Has the suites' modelled cases (cases.calibrated_model) take the constants the library uses on the runner's GPU
  (base.device); returns the line that says which."""
  info = runner.device_info(base.device, base.k_dim, base.n_dim, base.transpose_rhs)
  return cases_lib.use_device_calibration(info["name"], info["sms"])


def runner_spec(case: cases_lib.Case) -> dict:
  """What the runner (runner.cc) gets for a case: its fields less those only Python uses, with the kernels' shapes."""
  spec = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)
          if f.name not in ("experts", "sweep", "model", "routing", "zipf", "capacity_factor", "datasets", "seed",
                            "check_tokens", "dispatch_gemm_mode", "link_gbps", "table", "tensor", "sweep_passes")}
  # The kernels' shapes: with `tensor` > 1 each choice is `tensor` shard slots and each rank's K is its shard's.
  spec.update(top_k=case.slot_top_k, k_dim=case.rank_k)
  spec.update(experts_per_rank=case.experts_per_rank, cap=case.cap, model=list(case.model) if case.model else None,
              variants=case.variants(), dg_mode=cases_lib.DG_MODES.index(case.dispatch_gemm_mode),
              emulated_link_gbps=case.link_gbps, gemm_alone=case.time and case.table,
              dg_sweep=case.timed_dg_sweep if case.dg and case.time else [])
  return spec


def run_case(runner, case: cases_lib.Case, table: list[dict] | None = None, regrets: list[dict] | None = None) -> bool:
  """Runs and checks one case; prints its lines (and appends its overlap row to `table`, its regret rows to
  `regrets`). True if it passed."""
  why = case.invalid()
  if why:
    print(f"FAIL {case.name()}: bad config: {why}", flush=True)
    return False
  sets = cases_lib.make_data(case)
  result = runner.run_ranks(runner_spec(case), [[d.inputs(case) for d in ranks] for ranks in sets])
  v = check_lib.check(case, sets, result)
  line = (f"{'PASS' if v.passed else 'FAIL'} {case.name()} | calls {result['calls']} | max rel err y "
          f"{v.max_rel_y:g}, slots {v.max_rel_slot:g} (tol {v.tol:g}) | bit-identical repeats {v.bit_checks} | "
          f"max recv rows {v.max_recv_rows}/{case.cap} | dropped {v.dropped} | producer {result['producer']} | "
          f"{result['seconds']:g} s")
  if case.check_stride > 1:
    line += f" | expert outputs checked on every {case.check_stride}th token"
  if case.dg:
    used = sorted({q.get("pushers", 0) for q in result.get("dg_device", [])} - {0})
    pinned = result.get("pushers", case.dispatch_gemm_pushers)
    line += f" | pushers {pinned if pinned > 0 else 'auto'}{f' (used {used})' if used and pinned <= 0 else ''}"
  push = timing.dispatch_gemm_push_rates(case, result, sets[0]) if case.dg and case.time else None
  if case.dg and case.time:
    line += timing.dispatch_gemm_summary(result)
  if v.failure_count:
    line += f" | failures {v.failure_count}"
  print(line)
  for msg in v.failures:
    print(f"  {msg}")
  if push is not None:
    print("RESULT " + json.dumps(push))
  if 0 <= case.timeout_at < case.iters:
    print(f"  reported after the forced timeout (rank 0): {v.timeout_msg}")
  if not case.dg:
    for text in timing.variant_lines(case, result, v.identical, v.remote_rows):
      print(text)
  row = timing.overlap_row(case, result, sets[0]) if case.time and case.table else None
  if row is not None:
    print("OVERLAP " + timing.overlap_cells(row))
    print("RESULT " + json.dumps(row))
    for text in timing.consumer_rate_lines(case, result, sets[0]):
      print(text)
    if table is not None:
      table.append(row)
  if case.time and v.passed:
    for rrow in (regret_lib.consumer_row(case, result, sets[0]), regret_lib.pusher_row(case, result, sets[0])):
      if rrow is not None:
        print(regret_lib.line(rrow))
        print("RESULT " + json.dumps(rrow))
        if regrets is not None:
          regrets.append(rrow)
  if case.time:
    for text in timing.plan_lines(case, sets[0], result["budget"], result.get("producer", "")):
      print(text)
  if case.decision_iters > 0 and result["decision_choice"] > 0:
    for text in timing.decision_lines(result):
      print(text)
  sys.stdout.flush()
  return v.passed


def _run_guarded(runner, case, table, regrets) -> bool:
  """run_case, with an exception counted as the case's failure (printed with its traceback) so that the suite
  goes on and its summary line is printed."""
  try:
    return run_case(runner, case, table, regrets)
  except Exception:  # pylint: disable=broad-except
    print(f"FAIL {case.name()} | the harness raised:\n{traceback.format_exc()}", flush=True)
    return False


def main(argv=None) -> int:
  args, base = parse_args(sys.argv[1:] if argv is None else argv)
  runner = load_runner()
  if args.device_info:
    print("RESULT " + json.dumps(runner.device_info(base.device, base.k_dim, base.n_dim, base.transpose_rhs)))
    return 0
  if args.copy_ceiling:
    for b in args.copy_ceiling:
      us = runner.copy_ceiling_us(base.device, int(b), base.reps)
      print(f"COPY bytes={b:.0f} median_us={us:.3f} GB/s={b / us * 1e-3:.1f}")
      print("RESULT " + json.dumps({"kind": "copy", "bytes": b, "median_us": us, "gbps": b / us * 1e-3}))
    return 0
  producer = lambda c: runner.producer_path(c.f32, c.rank_k, c.n_dim, c.transpose_rhs)  # noqa: E731
  if args.suite:
    print(use_device_calibration(runner, base), flush=True)
  todo = cases_lib.suite(args.suite, base, producer) if args.suite else [base]
  table, regrets = [], []
  passed = sum(_run_guarded(runner, c, table, regrets) for c in todo)
  if table:
    print("\n" + timing.TABLE_HEADER)
    for row in table:
      print(timing.overlap_cells(row))
    print()
  tensor_lines = timing.tensor_table(table)
  if tensor_lines:
    print("\n".join(tensor_lines) + "\n")
  for text in regret_lib.summary(regrets):
    print(text)
  print(f"loopback: {passed} of {len(todo)} cases passed", flush=True)
  return 0 if passed == len(todo) else 1


if __name__ == "__main__":
  sys.exit(main())
