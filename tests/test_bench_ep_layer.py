"""benchmarks/bench_ep_layer.py's correctness check (not its timing) for the quick shape on 4 CPU devices: ours and
xla_dense_a2a agree with the reference; xla_ragged is skipped on CPU (no ragged_all_to_all in XLA:CPU) with its
reason, and its offset logic agrees through the all_gather emulation of ragged_all_to_all."""

import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_ep_layer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope="module")
def rows():
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--check-only"])
  table = bench_ep_layer.run(args, timing=False)
  return {(r["pass"], r["impl"]): r for r in table.rows}


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["ours", "xla_dense_a2a", "xla_ragged[emulated]"])
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


def test_wrong_code_is_excluded(monkeypatch):
  """A layer that disagrees with the reference is reported as excluded, never timed."""
  real = bench_ep_layer.dense_a2a_layer
  monkeypatch.setattr(bench_ep_layer, "dense_a2a_layer",
                      lambda mesh, c: (lambda *a: real(mesh, c)(*a) * 1.01))
  args = bench_ep_layer.parse_args(["--quick", "--devices", "4", "--passes", "fwd", "--impls", "xla_dense_a2a"])
  table = bench_ep_layer.run(args, timing=True)
  r = {x["impl"]: x for x in table.rows}["xla_dense_a2a"]
  assert r["ms"] == "excluded" and r["check"].startswith("FAIL"), r
