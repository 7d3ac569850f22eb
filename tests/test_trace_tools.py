"""benchmarks/device_trace.py's reader of a written trace and its kernel table, and benchmarks/decode_trace.py on a
tiny model on CPU (no GPU events there: the traces carry host planes only)."""

import pytest

from benchmarks import decode_trace, device_trace


def test_kernel_table_divides_by_the_traced_steps():
  s = {"kernels": {"gemm": {"calls": 16, "total_us": 6000.0, "mean_us": 375.0},
                   "quant": {"calls": 8, "total_us": 1000.0, "mean_us": 125.0}}}
  lines = device_trace.format_kernels(s, per=2).splitlines()
  assert lines[0] == "all kernels 3.50 ms per 2"
  assert lines[1].split()[:3] == ["3.000", "ms", "8.0x"] and lines[1].endswith("gemm")
  assert lines[2].split()[:3] == ["0.500", "ms", "4.0x"] and lines[2].endswith("quant")


@pytest.mark.slow  # a decode step compiled and traced; test_kernel_table_divides_by_the_traced_steps stays by default
def test_a_written_trace_is_read_back_and_the_decode_trace_runs(tmp_path, capsys):
  import jax.numpy as jnp
  device_trace.trace_calls(lambda v: v * 2, (jnp.ones(8),), calls=2, warmup=1, logdir=str(tmp_path))
  device_trace.main([str(tmp_path), "--per", "2"])
  assert capsys.readouterr().out.startswith("all kernels 0.00 ms per 2")
  decode_trace.main(["--tokens", "4", "--layers", "1", "--d-model", "128", "--d-ff", "128", "--experts", "4",
                     "--top-k", "2", "--calls", "1"])
  out = capsys.readouterr().out
  assert "=== decode T=4 bf16" in out and "=== decode T=4 fp8" in out
