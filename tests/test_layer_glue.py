"""benchmarks/layer_glue.py: the ops of a layer's optimized program outside the library's custom calls."""

import re

import pytest

from benchmarks import layer_glue

HLO = """HloModule jit_f, entry_computation_layout={()}

%fused_computation (param_0: f32[64,8], param_1: f32[64,8]) -> bf16[64,16] {
  %param_0 = f32[64,8]{1,0} parameter(0)
  %param_1 = f32[64,8]{1,0} parameter(1)
  %concatenate.1 = f32[64,16]{1,0} concatenate(%param_0, %param_1), dimensions={1}
  ROOT %convert.2 = bf16[64,16]{1,0} concatenate(%concatenate.1, %concatenate.1), dimensions={1}
}

ENTRY %main (p: f32[64,8], q: bf16[32,4]) -> bf16[64,16] {
  %p = f32[64,8]{1,0} parameter(0)
  %q = bf16[32,4]{1,0} parameter(1)
  %cc = (bf16[64,4]{1,0}, bf16[0,4]{1,0}) custom-call(bf16[32,4]{1,0} %q), custom_call_target="jmo_dispatch", metadata={op_name="jit(f)/jvp(layer)/jmo_workspace_call"}
  %copy.3 = f32[64,8]{0,1} copy(f32[64,8]{1,0} %p), metadata={op_name="jit(f)/jvp(layer)/copy"}
  ROOT %fusion = bf16[64,16]{1,0} fusion(f32[64,8]{1,0} %p, f32[64,8]{0,1} %copy.3), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/transpose(jvp(layer))/concatenate"}
}
"""


def test_glue_ops_reads_kinds_phases_and_bytes():
  ops = {op["name"]: op for op in layer_glue.glue_ops(HLO)}
  assert set(ops) == {"cc", "copy.3", "fusion"}, ops          # parameters and the fused body are not ops that run
  assert (ops["cc"]["kind"], ops["cc"]["group"], ops["cc"]["phase"]) == ("jmo_dispatch", "library custom calls", "fwd")
  assert ops["cc"]["bytes"] == 64 * 4 * 2 + 32 * 4 * 2
  assert (ops["copy.3"]["group"], ops["copy.3"]["bytes"]) == ("copy / transpose", 2 * 64 * 8 * 4)
  fusion = ops["fusion"]
  assert (fusion["kind"], fusion["group"], fusion["phase"]) == ("fusion:concatenate", "concatenate", "bwd")
  assert fusion["bytes"] == 64 * 16 * 2 + 2 * 64 * 8 * 4 and fusion["shape"] == "bf16[64,16]"


def test_lists_the_layer_ops_and_times_them(capsys):
  layer_glue.main(["--tokens", "64", "--d-model", "16", "--d-ff", "16", "--experts", "4", "--top-k", "2",
                   "--min-mib", "0", "--calls", "1"])
  out = capsys.readouterr().out
  assert "1 calls traced:" in out and "  concatenate " in out, out
  assert "fwd jmo_dispatch" in out and "bwd jmo_expert_combine" in out, out
  assert "MiB moved by every op: library custom calls" in out, out


def _packed_row_shapes(hlo: str, D: int) -> list[str]:
  """The uint8 arrays of FP8 byte rows (``fp8.pack_rows``: D e4m3 values and D / 128 float32 scales a row) anywhere in
  an optimized program, fused computations included."""
  return re.findall(rf"\bu8\[\d+(?:,1)?,{D + D // 32}\]", hlo)


# impl="overlap" runs impl="collective"'s FP8 block on a one-rank group (api._moe_local): the same program, in the slow
# pass only.
@pytest.mark.parametrize("impl", [pytest.param("overlap", marks=pytest.mark.slow), "collective"])
def test_fp8_one_rank_layer_moves_no_packed_rows(impl):
  """On a one-rank expert axis the FP8 rows never leave the device: the layer's forward + backward moves the e4m3
  values and the scales each by itself (``fp8_exchange.moved``), so its optimized program holds no packed byte rows
  (a concatenate written, then sliced apart for the GEMMs) and no concatenate of their size."""
  T, D, F, E, k = 64, 128, 128, 4, 2
  _, _, hlo = layer_glue.layer_grad(T, D, F, E, k, impl=impl, quantization="fp8")
  assert not _packed_row_shapes(hlo, D), _packed_row_shapes(hlo, D)
  concatenates = [op for op in layer_glue.glue_ops(hlo) if op["group"] == "concatenate" and op["bytes"] >= T * D]
  assert not concatenates, concatenates


@pytest.mark.slow
def test_fp8_two_rank_layer_packs_its_rows():
  """The control of the test above: where rows cross an exchange they travel packed, and the same search finds
  them."""
  D = 128
  _, _, hlo = layer_glue.layer_grad(64, D, 128, 4, 2, R=2, impl="collective", quantization="fp8")
  assert _packed_row_shapes(hlo, D)
