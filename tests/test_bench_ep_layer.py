"""benchmarks.bench_ep_layer's correctness check for the quick shape on 4 CPU devices: ours, serialized, xla (the
library's impl="xla") and xla_dense_a2a agree with the reference; xla_ragged is skipped on CPU (no ragged_all_to_all in XLA:CPU) with its
reason, and its offset logic agrees through the all_gather emulation of ragged_all_to_all; the probes of the ideal
(compute_alone, comm_alone, dispatch_alone) pass their checks (and fail them when wrong), the ideal and bound rows
are derived from the timed rows as documented, the summary table has its columns, the wire bytes of a count from
the expert ids and the ratios of the rows it quotes, and run_multi_gpu.sh's dry run selects this benchmark's shapes."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_moe_overlap as jmo
from benchmarks import baselines
from benchmarks import bench_ep_layer
from benchmarks import common
from benchmarks import ideal_probes
from benchmarks import references

# The benchmark's own checks at its quick shape: a dozen programs with their references and probes, in the slow pass.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def table():
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--check-only"])
  return bench_ep_layer.run(args, timing=False)


@pytest.fixture(scope="module")
def rows(table):
  return {(r["pass"], r["impl"]): r for r in table.rows}


def wire_bytes_from_ids(shape, R: int, itemsize: int, transfers: int) -> float:
  """The bytes ours' transfers move between ranks, counted here from the expert ids of the benchmark's two input
  sets (seeds 0 and 1): slots whose expert's rank (id // (E / R)) is not the token's rank (token // T_local), one
  D-wide row per slot and transfer, the mean over the sets."""
  T = shape.tokens_per_rank * R
  counts = []
  for seed in range(2):
    ids = common.topk_routing(T, shape.experts, shape.k, shape.skew, seed=seed)
    token_rank = np.arange(T)[:, None] // shape.tokens_per_rank
    counts.append(np.count_nonzero(ids // (shape.experts // R) != token_rank))
  return float(np.mean(counts)) * shape.d * itemsize * transfers


def test_summary_columns_and_wire_bytes(table, tmp_path):
  """One summary line per pass with exactly the summary columns; its wire bytes (and those of the rows of ours'
  transfers) are the count from the expert ids: 2 transfers forward, 4 for fwd+bwd, fewer than the logical payload
  (some slots stay on their rank); written to --out after the result rows as table="summary" rows."""
  shape = bench_ep_layer.shapes(quick=True)[0]
  summ = bench_ep_layer.summary(table.rows)
  assert summ.columns == ["shape", "skew", "pass", "ours_ms", "serialized_ms", "xla_ms", "compute_ms", "comm_ms",
                          "comm_wire_MB", "comm_GBps", "ideal_ms", "ours/ideal", "hidden", "ours/serialized",
                          "ours/xla"]
  assert [r["pass"] for r in summ.rows] == ["fwd", "fwd+bwd"], summ.rows
  by_pass = {(r["pass"], r["impl"]): r for r in table.rows}
  for r in summ.rows:
    want = wire_bytes_from_ids(shape, 4, 4, 2 if r["pass"] == "fwd" else 4)      # float32 on CPU
    assert r["wire_bytes"] == want and r["comm_wire_MB"] == f"{want / 1e6:.4g}", (r, want)
    assert 0 < want < float(by_pass[(r["pass"], "ours")]["a2a_MB"]) * 1e6, (r, want)
    for impl in ("ours", "serialized", "comm_alone"):
      assert by_pass[(r["pass"], impl)]["wire_bytes"] == want, impl
    assert by_pass[(r["pass"], "dispatch_alone")]["wire_bytes"] == want / 2
    assert "wire_bytes" not in by_pass[(r["pass"], "xla")]
    assert r["ours_ms"] == r["xla_ms"] == r["comm_ms"] == "check only", r      # nothing timed: no ratios
    assert r["ours/xla"] == r["ours/serialized"] == r["hidden"] == "", r
  path = tmp_path / "ep_layer.jsonl"
  table.save(str(path), meta={})
  lines = [json.loads(x) for x in path.read_text().splitlines()]
  assert [x for x in lines if x.get("table") == "summary"] == summ.rows
  assert len(lines) == 1 + len(table.rows) + len(summ.rows)


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["ours", "serialized", "xla", "xla_dense_a2a", "xla_ragged[emulated]", "compute_alone",
                                  "comm_alone", "dispatch_alone"])
def test_agrees_with_reference(rows, pass_, impl):
  r = rows[(pass_, impl)]
  assert r["check"].startswith("ok "), r
  assert r["ms"] == "check only", r            # timing=False: nothing was timed


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_ragged_skipped_on_cpu_with_reason(rows, pass_):
  r = rows[(pass_, "xla_ragged")]
  if jax.default_backend() != "cpu":
    pytest.skip("the skip is CPU-only")
  assert r["ms"] == "skipped", r
  assert "ragged_all_to_all" in r["check"] and "cpu" in r["check"], r


def test_dispatch_pushers_adds_ours_dg():
  # ours with CallConfig(dispatch_pushers=...) (on CPU dispatch_gemm's CPU handler): checked like every implementation.
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--check-only", "--passes", "fwd",
                                    "--impls", "ours_dg", "--dispatch-pushers", "2"])
  got = {r["impl"]: r for r in bench_ep_layer.run(args, timing=False).rows}
  assert got["ours_dg"]["check"].startswith("ok "), got["ours_dg"]
  assert "ours" in got


def test_wrong_code_is_excluded_and_slow_code_skipped(monkeypatch):
  """A layer that disagrees with the reference is reported as excluded, never timed; one whose checked call took
  longer than --max-call-s as skipped, with its check."""
  real = baselines.dense_a2a_layer
  monkeypatch.setattr(baselines, "dense_a2a_layer",
                      lambda mesh, c: (lambda *a: real(mesh, c)(*a) * 1.01))
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--passes", "fwd", "--impls", "xla_dense_a2a",
                                    "--max-call-s", "1e-9"])
  rows = {x["impl"]: x for x in bench_ep_layer.run(args, timing=True).rows}
  r = rows["xla_dense_a2a"]
  assert r["ms"] == "excluded" and r["check"].startswith("FAIL"), r
  r = rows["ours"]
  assert r["ms"] == "skipped" and r["check"].startswith("ok rel err") and "--max-call-s" in r["check"], r


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["ideal", "bound"])
def test_ideal_and_bound_are_check_only_without_timing(rows, pass_, impl):
  r = rows[(pass_, impl)]
  assert r["ms"] == "check only" and r["overlap_eff"] == "" and r["ours/bound"] == "", r


def test_ideal_and_bound_rows_from_timed_rows(monkeypatch):
  """Timed (few batches): ideal = max(compute_alone, comm_alone), overlap_eff = (serialized - ours) / min(...),
  ours/ideal; bound = compute_alone + dispatch_alone, ours/bound; the probes' rows are what the two rows quote, and
  dispatch_alone moves half of ours' bytes."""
  monkeypatch.setattr(common, "time_fn", functools.partial(common.time_fn, warmup=1, batches=2, per_batch=1))
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--passes", "fwd", "--impls", "serialized,xla,ideal"])
  table = bench_ep_layer.run(args, timing=True)
  r = {x["impl"]: x for x in table.rows}
  assert set(r) == {"ours", "serialized", "xla", "compute_alone", "comm_alone", "dispatch_alone", "ideal", "bound"}, r
  ms = {k: float(v["ms"]) for k, v in r.items()}
  ideal = r["ideal"]
  assert float(ideal["compute_ms"]) == ms["compute_alone"] and float(ideal["comm_ms"]) == ms["comm_alone"], ideal
  assert ms["ideal"] == max(ms["compute_alone"], ms["comm_alone"]), ideal
  eff = (ms["serialized"] - ms["ours"]) / min(ms["compute_alone"], ms["comm_alone"])
  assert float(ideal["overlap_eff"]) == pytest.approx(eff, abs=0.02), ideal
  hidden = (ms["compute_alone"] + ms["comm_alone"] - ms["ours"]) / ms["comm_alone"]
  assert float(ideal["hidden"]) == pytest.approx(hidden, abs=0.02), ideal
  (s,) = bench_ep_layer.summary(table.rows).rows                    # the summary quotes these rows
  assert [float(s[c]) for c in ("ours_ms", "serialized_ms", "xla_ms", "compute_ms", "comm_ms", "ideal_ms")] == \
      [ms[i] for i in ("ours", "serialized", "xla", "compute_alone", "comm_alone", "ideal")], s
  assert s["hidden"] == ideal["hidden"] and s["ours/ideal"] == ideal["ours/ideal"], s
  assert float(s["ours/serialized"]) == pytest.approx(ms["ours"] / ms["serialized"], abs=0.01), s
  assert float(s["ours/xla"]) == pytest.approx(ms["ours"] / ms["xla"], abs=0.01), s
  assert float(s["comm_GBps"]) == pytest.approx(s["wire_bytes"] / ms["comm_alone"] / 1e6, rel=2e-3), s
  assert float(ideal["ours/ideal"]) == pytest.approx(ms["ours"] / ms["ideal"], abs=0.02), ideal
  assert r["compute_alone"]["a2a_MB"] == "" and r["comm_alone"]["a2a_MB"] == r["ours"]["a2a_MB"], r
  assert ideal["dispatch_ms"] == "" and ideal["ours/bound"] == "", ideal
  bound = r["bound"]
  assert float(bound["compute_ms"]) == ms["compute_alone"] and float(bound["dispatch_ms"]) == ms["dispatch_alone"]
  assert ms["bound"] == pytest.approx(ms["compute_alone"] + ms["dispatch_alone"], abs=1.5e-3), bound
  assert float(bound["ours/bound"]) == pytest.approx(ms["ours"] / ms["bound"], abs=0.02), bound
  assert bound["comm_ms"] == "" and bound["ours/ideal"] == "" and bound["a2a_MB"] == "", bound
  assert float(r["dispatch_alone"]["a2a_MB"]) == pytest.approx(float(r["ours"]["a2a_MB"]) / 2, rel=1e-3), r
  assert r["dispatch_alone"]["a2a_GBps"] != "", r


def test_comm_probe_keeps_gate_and_up_columns():
  """The shrunk w1 is [gate[:f] | up[:f]] (SwiGLU splits it in halves), w2 the first f rows; the rest unchanged."""
  E, D, F, f = 2, 3, 5, 2
  w1 = np.arange(E * D * 2 * F, dtype=np.float32).reshape(E, D, 2 * F)
  w2 = np.arange(E * F * D, dtype=np.float32).reshape(E, F, D)
  x, ids, gates, w1s, w2s, ct = ideal_probes.comm_probe_args(("x", "ids", "g", w1, w2, "ct"), f)
  np.testing.assert_array_equal(w1s, np.concatenate([w1[..., :f], w1[..., F:F + f]], -1))
  np.testing.assert_array_equal(w2s, w2[:, :f])
  assert (x, ids, gates, ct) == ("x", "ids", "g", "ct")


def test_compute_probe_rejects_other_group_sizes():
  """The compute probe's check compares its group sizes with the routing's rows per (rank, local expert)."""
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4"])
  mesh = bench_ep_layer.make_mesh(args.devices)
  shape = bench_ep_layer.shapes(quick=True)[0]
  (x, ids, _, w1, w2, _), ids_np = bench_ep_layer.make_inputs(shape, 4, np.float32, 0, mesh)
  prepare, fn = ideal_probes.compute_probe(mesh, shape, want_grads=False)
  sets = [prepare(x, ids) + (w1, w2)]
  v = ideal_probes.compute_probe_verdict(fn, sets, [ids_np], 4, shape.experts)
  assert v.ok, v
  other = ids_np.copy()
  other[0, 0] = (other[0, 0] + 1) % shape.experts          # one slot to another expert: two counts change
  v = ideal_probes.compute_probe_verdict(fn, sets, [other], 4, shape.experts)
  assert not v.ok and "group sizes" in v.text, v


@pytest.mark.parametrize("wrong", [None, 0, 1])
def test_dispatch_probe_check_rejects_wrong_rows(monkeypatch, wrong):
  """The dispatch probe's check passes the probe as built, and fails it when one of its dispatches (0: the tokens',
  1: fwd+bwd's second, of d_slot) is given the next slot_src_row (each slot's source row shifted by one)."""
  calls = []
  real = ideal_probes.dispatch

  def dispatch(src, slot_src_row, *a):
    calls.append(1)
    if len(calls) - 1 == wrong:
      slot_src_row = (slot_src_row + 1) % src.shape[0]
    return real(src, slot_src_row, *a)

  monkeypatch.setattr(ideal_probes, "dispatch", dispatch)
  mesh = bench_ep_layer.make_mesh(4)
  shape = bench_ep_layer.shapes(quick=True)[0]
  (x, ids, *_), ids_np = bench_ep_layer.make_inputs(shape, 4, np.float32, 0, mesh)
  prepare, fn = ideal_probes.dispatch_probe(mesh, shape, want_grads=True)
  v = ideal_probes.dispatch_probe_verdict(fn, [prepare(x, ids)], [ids_np], mesh, shape)
  assert len(calls) == 2, calls                              # traced once: the two dispatches of a fwd+bwd call
  if wrong is None:
    assert v.ok and "bit-exact" in v.text, v
  else:
    assert not v.ok and v.text.startswith(("x_recv", "d_recv")[wrong]), v


@pytest.mark.parametrize("sampled,max_bytes", [(False, 2 ** 32), (True, 1)])
def test_reference_equals_dense_oracle(monkeypatch, sampled, max_bytes):
  """The benchmark's reference (sparse, expert-parallel, token chunks when max_bytes asks for them: here 1 byte, the
  most chunks) gives moe_experts(impl="reference")'s y and gradients; sampled: dw1 and dw2 of the fixed sample
  (2 of 8 experts: ceil(2 / 4) local expert 0 of every rank) only, the rest whole."""
  monkeypatch.setattr(references, "REF_SAMPLE_EXPERTS", 2)
  mesh = bench_ep_layer.make_mesh(4)
  shape = bench_ep_layer.shapes(quick=True)[0]
  args, _ = bench_ep_layer.make_inputs(shape, 4, np.float32, 1, mesh)

  def dense(x, ids, g, w1, w2):
    return jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, impl="reference")[0]

  y = references.reference_results(mesh, args, False, max_bytes=max_bytes)
  assert y.experts is None and references.rel_err(y.outputs[0], bench_ep_layer.fwd_fn(dense)(*args)) < 1e-6
  ref = references.reference_results(mesh, args, True, max_bytes=max_bytes,
                                         max_wgrad_bytes=0 if sampled else 2 ** 32)
  want = bench_ep_layer.grad_fn(dense)(*args)
  if sampled:
    np.testing.assert_array_equal(ref.experts, [0, 2, 4, 6])
    want = want[:2] + tuple(w[ref.experts] for w in want[2:])
  else:
    assert ref.experts is None
  for got, w in zip(ref.outputs, want):
    assert got.shape == w.shape and references.rel_err(got, w) < 1e-5


def test_sampled_weight_gradients_are_named_and_checked(monkeypatch):
  """Where the reference samples the weight gradients, the check text names the experts and a wrong gradient on a
  sampled expert still fails the check."""
  real = references.reference_results
  monkeypatch.setattr(references, "REF_SAMPLE_EXPERTS", 4)
  monkeypatch.setattr(references, "reference_results",
                      lambda *a, **kw: real(*a, **kw, max_wgrad_bytes=0))
  real_ours = bench_ep_layer.ours_layer

  def ours_with_wrong_w1_grad_on_expert_2(mesh, config=jmo.CallConfig()):
    f = real_ours(mesh, config)
    scale = np.ones((8, 1, 1), np.float32)
    scale[2] = 1.5

    @jax.custom_vjp
    def w1_scaled(w1):
      return w1

    w1_scaled.defvjp(lambda w1: (w1, None), lambda _, g: (g * scale,))
    return lambda x, ids, g, w1, w2: f(x, ids, g, w1_scaled(w1), w2)

  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--passes", "fwd+bwd", "--impls", "ours",
                                    "--check-only"])
  rows = {r["impl"]: r for r in bench_ep_layer.run(args, timing=False).rows}
  assert rows["ours"]["check"].startswith("ok rel err"), rows["ours"]
  assert "dw1, dw2 on experts 0,2,4,6 of 8: sampled" in rows["ours"]["check"], rows["ours"]
  monkeypatch.setattr(bench_ep_layer, "ours_layer", ours_with_wrong_w1_grad_on_expert_2)
  r = {r["impl"]: r for r in bench_ep_layer.run(args, timing=False).rows}["ours"]
  errs = [float(e) for e in r["check"].split()[3].split("/")]       # FAIL rel err dx/dgates/dw1/dw2 (...)
  assert r["check"].startswith("FAIL") and max(errs[:2] + errs[3:]) < 1e-5 < errs[2], r


def _multi_gpu_dry_run(out_dir, *args, timeout=300):
  """benchmarks/run_multi_gpu.sh --dry-run ARGS with its plumbing on CPU and $OUT = out_dir: the finished process."""
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, OUT=str(out_dir), BENCH_PLATFORMS="cpu", PYTHONPATH=str(root),
             PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
  return subprocess.run(["bash", "benchmarks/run_multi_gpu.sh", "--dry-run", *args], cwd=root, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


def test_multi_gpu_script_dry_run_selects_the_shapes(tmp_path):
  """benchmarks/run_multi_gpu.sh --dry-run: its default EP groups each select their shape of this benchmark (seed,
  Mixtral-like, DeepSeek-like E=64), each run of bench_ep_layer times ours, serialized, xla, the ideal and
  dispatch_gemm with 16 pushing CTAs pinned (ours_dg; ours takes the library's choice, 8 on an H200), and nothing
  runs (only summary.txt is written)."""
  r = _multi_gpu_dry_run(tmp_path)
  assert r.returncode == 0, r.stdout + r.stderr
  for shape in ("seed T=8192 N=4096 E=8 balanced:", "mixtral-like balanced:", "deepseek-like E=64 balanced:"):
    assert f"     {shape}" in r.stdout, r.stdout
  runs = [line for line in r.stdout.splitlines() if line.startswith("== ep_layer")]
  assert len(runs) == 3 and all("bench_ep_layer" in x and "--out" in x for x in runs), runs
  impls = [x.split("--impls ")[1].split()[0].replace("\\", "") for x in runs]
  assert impls == ["ours,serialized,xla,ideal,ours_dg"] * 3, impls
  assert all("--dispatch-pushers 16" in x for x in runs), runs
  assert os.listdir(tmp_path) == ["summary.txt"]


def test_multi_gpu_script_dry_run_trains_each_impl_and_one_process_per_gpu(tmp_path):
  """run_multi_gpu.sh --steps train --dry-run: the training example at its GPU preset with impl overlap and xla (xla
  in microbatches), then overlap as a job of one process per GPU through benchmarks.launch_job, whose own deadline
  comes before the step's."""
  r = _multi_gpu_dry_run(tmp_path, "--steps", "train", timeout=60)
  assert r.returncode == 0, r.stdout + r.stderr
  runs = {line.split(" (limit")[0][3:]: line for line in r.stdout.splitlines() if line.startswith("== train")}
  assert list(runs) == ["train overlap", "train xla", "train overlap, one process per GPU"], runs
  assert all("--preset gpu" in line for line in runs.values()), runs
  assert "--impl xla" in runs["train xla"] and "--grad-accum 4" in runs["train xla"]
  job = runs["train overlap, one process per GPU"]
  step_limit = int(job.split("(limit ")[1].split(" s)")[0])
  assert "benchmarks.launch_job --processes 2" in job and "--impl overlap" in job
  assert int(job.split("--limit-s ")[1].split()[0]) < step_limit


def test_multi_gpu_script_dry_run_pushes_into_the_peer(tmp_path):
  """run_multi_gpu.sh --steps push_rate --dry-run: the row-push probe built from the tools build and run with its
  destination on GPU 1 (--peer 1), under the step's limit; not a default step."""
  r = _multi_gpu_dry_run(tmp_path, "--steps", "push_rate", timeout=60)
  assert r.returncode == 0, r.stdout + r.stderr
  step = [line for line in r.stdout.splitlines() if line.startswith("== push_rate")]
  assert len(step) == 1 and "(limit 60 s)" in step[0], r.stdout
  assert "tools/build_tools.sh\\ row_push_probe" in step[0], step  # (the dry run prints the command shell-quoted)
  assert "build/tools/row_push_probe\\ --peer\\ 1" in step[0], step
  assert "== push_rate" not in _multi_gpu_dry_run(tmp_path / "default").stdout


def test_multi_gpu_script_dry_run_has_the_tensor_parallel_step(tmp_path):
  """run_multi_gpu.sh --steps tp_layer --dry-run: bench_tp_layer as expert x tensor = 2 x 2 on four devices (the dry
  run counts four), its rows into tp_layer.jsonl, nothing run."""
  r = _multi_gpu_dry_run(tmp_path, "--steps", "tp_layer")
  assert r.returncode == 0, r.stdout + r.stderr
  [run] = [line for line in r.stdout.splitlines() if line.startswith("== tp_layer")]
  assert "(limit 240 s)" in run and "benchmarks.bench_tp_layer --ep 2 --tp 2 --devices 4" in run, run
  assert "--out" in run and "tp_layer.jsonl" in run, run
