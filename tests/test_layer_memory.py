"""benchmarks/layer_memory.py: XLA's memory analysis of one layer's forward + backward, per impl."""

from benchmarks import layer_memory


def test_largest_buffers_reads_shapes_and_sizes():
  hlo = """
  %a = bf16[4,8]{1,0} parameter(0)
  ROOT %b = f32[16,1024,128]{2,1,0} select(%p, %x, %y)
  %c = (f32[2], s32[3]) tuple(%d, %e)
  %t = s32[] constant(1)
  """
  got = layer_memory.largest_buffers(hlo, 2)
  assert [n for n, _ in got] == [16 * 1024 * 128 * 4, 4 * 8 * 2], got
  assert "select" in got[0][1]


def test_reports_each_impl(capsys):
  layer_memory.main(["--tokens", "64", "--d-model", "16", "--d-ff", "16", "--experts", "4", "--top-k", "2",
                     "--impls", "xla,overlap", "--top", "2"])
  out = capsys.readouterr().out
  for impl in ("xla", "overlap"):
    line = next(x for x in out.splitlines() if x.startswith(f"{impl}: temporaries "))
    assert float(line.split()[2]) >= 0.0, line
  assert out.count(" GiB  ") == 4, out


def test_reports_each_quantization(capsys):
  layer_memory.main(["--tokens", "64", "--d-model", "128", "--d-ff", "128", "--experts", "4", "--top-k", "2",
                     "--impls", "overlap", "--quantizations", "none,fp8", "--top", "1"])
  out = capsys.readouterr().out
  for label in ("overlap", "overlap fp8"):
    line = next(x for x in out.splitlines() if x.startswith(f"{label}: temporaries "))
    assert float(line.split()[-2]) >= 0.0, line
  assert out.count(" GiB  ") == 2, out
