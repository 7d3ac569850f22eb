"""benchmarks/layer_memory.py: XLA's memory analysis of one layer's forward + backward, per impl."""

from benchmarks import layer_memory


def test_largest_buffers_reads_the_arrays_instructions_write():
  # Arrays written by instructions of non-fused computations, tuple results counted per array; not the parameters,
  # the instructions that only name arrays, nor anything inside a fusion's body (computed in registers).
  hlo = """
%fused_computation (p: f32[4]) -> f32[64,1024,128] {
  %big = f32[64,1024,128]{2,1,0} broadcast(%p), dimensions={}
  ROOT %r = f32[64,1024,128]{2,1,0} multiply(%big, %big)
}

ENTRY %main (a: bf16[4,8]) -> f32[16,1024,128] {
  %a = bf16[4,8]{1,0} parameter(0)
  %f = f32[16,1024,128]{2,1,0} fusion(%x), kind=kLoop, calls=%fused_computation
  ROOT %b = f32[16,1024,128]{2,1,0} select(%p, %x, %y)
  %m = (f32[8,8]{1,0}, f8e4m3fn[1024]{0}) custom-call(%a), custom_call_target="k"
  %g = f32[8,8]{1,0} get-tuple-element(%m), index=0
  %c = (f32[2], s32[3]) tuple(%d, %e)
  %t = s32[] constant(1)
}
"""
  got = layer_memory.largest_buffers(hlo, 4)
  assert [n for n, _ in got] == [16 * 1024 * 128 * 4] * 2 + [1024, 8 * 8 * 4], got
  assert {got[0][1].split()[0], got[1][1].split()[0]} == {"%f", "ROOT"} and "custom-call" in got[2][1]


def test_reports_each_impl(capsys):
  layer_memory.main(["--tokens", "64", "--d-model", "16", "--d-ff", "16", "--experts", "4", "--top-k", "2",
                     "--impls", "xla,overlap", "--top", "2"])
  out = capsys.readouterr().out
  for impl in ("xla", "overlap"):
    line = next(x for x in out.splitlines() if x.startswith(f"{impl}: temporaries "))
    assert float(line.split()[2]) >= 0.0, line
  assert out.count(" GiB  ") == 4, out


def test_reports_each_quantization(capsys, tmp_path):
  layer_memory.main(["--tokens", "64", "--d-model", "128", "--d-ff", "128", "--experts", "4", "--top-k", "2",
                     "--impls", "overlap", "--quantizations", "none,fp8", "--top", "1", "--hlo-dir", str(tmp_path)])
  # One optimized HLO per program, named by plain characters only.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["overlap.hlo.txt", "overlap_fp8.hlo.txt"]
  assert "ENTRY" in (tmp_path / "overlap_fp8.hlo.txt").read_text()
  out = capsys.readouterr().out
  for label in ("overlap", "overlap fp8"):
    line = next(x for x in out.splitlines() if x.startswith(f"{label}: temporaries "))
    assert float(line.split()[-2]) >= 0.0, line
  assert out.count(" GiB  ") == 2, out
