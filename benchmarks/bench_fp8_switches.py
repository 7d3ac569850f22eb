"""The FP8 layer at EP = 1 under each setting of fp8_experts' GPU switches, side by side in one process:
``moe_experts(impl="collective")`` forward and forward + backward, bf16 and ``quantization="fp8"``, ms per call
(medians after warm-up, common.time_fn), with ``jax.clear_caches()`` between settings (the switches are read when
traced). Each fp8 setting's outputs are compared with the all-off setting's: "bitwise" or their largest max-relative
difference (a switch that swaps a kernel for XLA's ops of the same rule may move a byte where XLA:GPU's division is
inexact; a fused kernel must give the same bits).

Settings (the switches not named are off):
  off            XLA quantizes the weights; GEMM1, then the SwiGLU forward kernel
  fused          FUSED_GEMM1_SWIGLU_ON_GPU: GEMM1 with the SwiGLU forward in its epilogue
  wq             WEIGHT_QUANTIZER_ON_GPU: the forward's weights by the custom call
  fused+wq       both (the shipped defaults, where they are both on)
  fused+wq+bwq   both and BACKWARD_REQUANTIZES_WEIGHTS: the dgrads' weights quantized again from the master weights
  fused+wq+rq    both and ROW_QUANTIZED_COLUMNS_ON_GPU: the wgrads' x and dy to the column quantizer as the e4m3
                 rows the backward keeps (no dequantization pass in XLA)
  fused+wq+rq+pair     and FORWARD_QUANTIZES_DGRAD_WEIGHTS with WEIGHT_PAIR_KERNEL_ON_GPU: the dgrads' weights from the
                       forward's quantizer pass (no transposes in the backward)
  fused+wq+rq+pair+dh  and expert_gemms.DGRAD_IN_COMPUTE_DTYPE with BF16_DH_KERNEL_ON_GPU: dh in bfloat16 from the
                       dgrad GEMM to the SwiGLU backward's kernel
  fused+wq+rq+fq       FORWARD_QUANTIZES_DGRAD_WEIGHTS alone: the forward's quantizer call, then XLA's transpose
                       of its e4m3 weights (the pair kernel's fallback)
  fused+wq+rq+dh       dh in bfloat16 to the kernel, the backward transposing the kept weights
  fused+wq+rq+fq+dh    both
The bf16 rows run with every switch as shipped.

  python3 -m benchmarks.bench_fp8_switches --out /tmp/fp8_switches.jsonl
  python3 -m benchmarks.bench_fp8_switches --quick --passes fwd      # a small shape (CPU: minutes)
A --budget in seconds skips what is left once it is spent (each skipped row printed); --settings runs only the
settings named (and bf16 and off, the references).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks import bench_fp8_layer
from benchmarks import bench_layer
from benchmarks import common
from jax_moe_overlap import expert_gemms, fp8_experts

SWITCHES = ("FUSED_GEMM1_SWIGLU_ON_GPU", "WEIGHT_QUANTIZER_ON_GPU", "BACKWARD_REQUANTIZES_WEIGHTS",
            "ROW_QUANTIZED_COLUMNS_ON_GPU", "FORWARD_QUANTIZES_DGRAD_WEIGHTS", "WEIGHT_PAIR_KERNEL_ON_GPU",
            "DGRAD_IN_COMPUTE_DTYPE", "BF16_DH_KERNEL_ON_GPU")
_BASE = (*SWITCHES[:2], SWITCHES[3])
SETTINGS = {"off": (), "fused": SWITCHES[:1], "wq": SWITCHES[1:2], "fused+wq": SWITCHES[:2],
            "fused+wq+bwq": SWITCHES[:3], "fused+wq+rq": _BASE, "fused+wq+rq+pair": (*_BASE, *SWITCHES[4:6]),
            "fused+wq+rq+pair+dh": (*_BASE, *SWITCHES[4:]),
            "fused+wq+rq+fq": (*_BASE, SWITCHES[4]), "fused+wq+rq+dh": (*_BASE, *SWITCHES[6:]),
            "fused+wq+rq+fq+dh": (*_BASE, SWITCHES[4], *SWITCHES[6:])}


def module_of(name: str):
  """The module that holds switch `name` (dh's dtype is the layers' rule, expert_gemms'; the rest fp8_experts')."""
  return expert_gemms if name == "DGRAD_IN_COMPUTE_DTYPE" else fp8_experts


def shipped_switches() -> dict:
  return {name: getattr(module_of(name), name) for name in SWITCHES}


def plan(quick: bool):
  """(name, tokens, D, F, E, k, settings): bf16 then the fp8 settings timed at each shape."""
  if quick:
    return [("small", 2048, 1024, 1024, 8, 2, ["bf16", *SETTINGS])]
  new = ["fused+wq+rq+pair", "fused+wq+rq+pair+dh", "fused+wq+rq+fq", "fused+wq+rq+dh", "fused+wq+rq+fq+dh"]
  return [("mixtral-like", 4096, 4096, 14336, 8, 2, ["bf16", "off", "fused", "wq", "fused+wq", "fused+wq+bwq",
                                                      "fused+wq+rq", *new]),
          ("mixtral-like", 16384, 4096, 14336, 8, 2, ["bf16", "off", "fused+wq", "fused+wq+rq", *new]),
          ("deepseek-like E_l=32", 4096, 7168, 2048, 32, 8, ["bf16", "off", "fused", "fused+wq", "fused+wq+rq",
                                                              *new]),
          ("training preset", 32768, 1024, 1024, 16, 4, ["bf16", "off", "fused+wq", "fused+wq+rq", *new])]


def _set(setting: str, shipped: dict):
  """The switches of `setting` on and the others off; for bf16, every switch as shipped."""
  for name in SWITCHES:
    setattr(module_of(name), name, shipped[name] if setting == "bf16" else name in SETTINGS.get(setting, ()))
  jax.clear_caches()


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _versus(got, base) -> str:
  if all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base))):
    return "bitwise"
  return f"max-rel {bench_layer.error_vs(base, got):.1e}"


def main(argv=None):
  ap = common.shape_parser("fp8_switches.jsonl")
  ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd")
  ap.add_argument("--budget", type=float, default=0.0, help="seconds; 0: no limit")
  ap.add_argument("--settings", default="", help="comma list: only these settings (bf16 and off always run)")
  args = ap.parse_args(argv)
  mesh = jax.make_mesh((1,), ("expert",))
  shipped = shipped_switches()
  table = common.Table(["shape", "pass", "setting", "ms", "speedup", "vs_off"])
  t0 = time.time()
  try:
    for name, T, D, F, E, k, settings in plan(args.quick):
      if not common.shape_selected(args, name):
        continue
      arg_sets = [common.layer_operands(T, D, F, E, k, seed=s) for s in range(2)]
      for pname in args.passes.split(","):
        bf16_ms, base = None, None
        for setting in settings:
          if args.settings and setting not in ("bf16", "off", *args.settings.split(",")):
            continue
          row = dict(shape=f"{name} T={T}", setting=setting, **{"pass": pname})
          if args.budget and time.time() - t0 > args.budget:
            table.add(**row, ms="skipped (budget spent)")
            continue
          _set(setting, shipped)
          q = None if setting == "bf16" else "fp8"
          fn = bench_layer.pass_fn(bench_fp8_layer.layer_fn(mesh, "collective", q), pname)
          try:
            got = jax.device_get(fn(*arg_sets[0]))
            if setting == "off":
              base = got
            elif q and base is not None:
              row["vs_off"] = _versus(got, base)
            ms = common.time_fn(fn, arg_sets) * 1e3
          except Exception as e:  # pylint: disable=broad-except
            table.add(**row, ms=f"error: {type(e).__name__}: {str(e)[:100]}")
            continue
          if setting == "bf16":
            bf16_ms = ms
          elif bf16_ms:
            row["speedup"] = f"{bf16_ms / ms:.2f}"
          table.add(**row, ms=f"{ms:.3f}")
  finally:
    for n, v in shipped.items():
      setattr(module_of(n), n, v)
    jax.clear_caches()
  table.finish(args.out)


if __name__ == "__main__":
  main()
