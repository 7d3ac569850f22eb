"""benchmarks/bench_multiprocess.py: a jax.distributed job on localhost, timed, checked against float32."""

import json

import pytest

from benchmarks import bench_multiprocess


@pytest.mark.slow
def test_two_processes_and_one(tmp_path, capsys):
  out = tmp_path / "rows.jsonl"
  bench_multiprocess.main(["--layouts", "1x2,2x1", "--calls", "3", "--tokens-per-rank", "16", "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["layout"] for r in rows] == ["1x2", "2x1"], rows
  for r in rows:
    assert "error" not in r, r
    assert r["rel_err"] < 1e-2 and r["median_ms"] > 0 and r["first_ms"] > 0, r
  assert "| 2x1 |" in capsys.readouterr().out
