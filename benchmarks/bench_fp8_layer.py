"""The MoE expert layer at EP = 1 (one GPU), forward and forward+backward, with quantization="fp8" against bf16, per
impl (--impls, default collective and overlap): ``moe_experts(impl="collective")`` (the exchange in XLA, the experts
in this library's grouped GEMMs: bf16 ``grouped_matmul_swiglu`` / ``grouped_matmul`` / ``grouped_outer``, or under
fp8 the e4m3 grouped GEMM for GEMM1, GEMM2, the two dgrads and the two wgrads, fp8_experts.KERNELS) and
``impl="overlap"`` (the rows moved by the workspace's custom calls; under fp8 dispatched as packed e4m3 rows, the
recipe's GEMMs unfused from the moves: fp8_overlap.py), and the FP8 recipe emulated in XLA (``impl="xla"``,
fp8_experts.RAGGED) as a row of its own.

Each fp8 timing includes everything the recipe does per call: the weights quantized from the bf16 master weights
(128 x 128 blocks), the activations and gradients quantized 1 x 128 and 128 x 1, the lhs scales transposed to the
kernel's layout, in the backward the two transposed weight copies (the dgrads' K-major B operands) and the wgrads'
token-contiguous operands.

Columns: impl, bf16_ms, fp8_ms, speedup = bf16_ms / fp8_ms (the emulation's row: fp8_ms alone; --no-xla leaves it
out: its ragged_dot is dense-masked on GPU, so it is slow at many experts); medians after warm-up (common.time_fn).
dispatch_B_row_bf16 / _fp8: the bytes per row the dispatch's exchange moves at EP >= 2 (the program's first exchange
of rows, counted on it by common.exchanged_rows on a two-rank mesh of the host's CPU devices with impl="collective",
traced only), 2D in bf16, D + D / 32 under fp8 (e4m3 values and a float32 scale per 128); the timed layer runs on
one device, where no rows cross an exchange. Empty where the host has one CPU device
(XLA_FLAGS=--xla_force_host_platform_device_count=2 gives it two).
Nothing is timed before it agrees: bf16 with the float32 reference (references.layer_reference, max-relative error
err_bf16 <= 2e-2), fp8 with the fp8 emulation on the same inputs (err_fp8, max |impl - xla| / max |xla| <= 2e-2:
the same quantized operands, different float32 summation orders).

  python3 -m benchmarks.bench_fp8_layer --out /tmp/fp8_layer.jsonl
  python3 -m benchmarks.bench_fp8_layer --quick --out /tmp/fp8_layer_quick.jsonl
  JMO_TIMEOUT_MS=120000 python3 -m benchmarks.bench_fp8_layer --quick --passes fwd   # a CPU try-out: the CPU
      # emulations take seconds per call at the quick shape (well over 15 minutes for both passes on 2 cores), and
      # impl="overlap"'s combine waits for its producer's tiles longer than the default 10 s bound there
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import bench_layer
from benchmarks import common
from benchmarks import references

MAX_ERR = 2e-2


def shapes(quick: bool):
  """(name, tokens, D, F, E, k): bench_layer's Mixtral-like and DeepSeek-like layers (--quick: a small one)."""
  if quick:
    return [("small", 2048, 1024, 1024, 8, 2)]
  return [("mixtral-like", 4096, 4096, 14336, 8, 2), ("deepseek-like E_l=32", 4096, 7168, 2048, 32, 8)]


def layer_fn(mesh, impl: str, quantization: str | None):
  return lambda *a: jmo.moe_experts(*a, mesh=mesh, impl=impl, quantization=quantization)[0]


def _checked_ms(fn, arg_sets, ref_outs, what: str):
  """(ms, err) of fn after checking it against ref_outs on the first input set; (message, err) when it is wrong."""
  try:
    err = bench_layer.error_vs(ref_outs, fn(*arg_sets[0]))
    if not err <= MAX_ERR:  # (NaN too)
      return f"wrong result ({what}), not timed", err
    return f"{common.time_fn(fn, arg_sets) * 1e3:.3f}", err
  except Exception as e:  # pylint: disable=broad-except
    return f"error: {type(e).__name__}: {str(e)[:100]}", float("nan")


def main(argv=None):
  ap = common.shape_parser("fp8_layer.jsonl")
  ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd")
  ap.add_argument("--impls", default="collective,overlap", help="comma list of collective, overlap")
  ap.add_argument("--no-xla", action="store_true", help="leave out the fp8 emulation's timing (impl='xla')")
  args = ap.parse_args(argv)
  mesh = jax.make_mesh((1,), ("expert",))
  cpus = jax.devices("cpu")
  count_mesh = jax.sharding.Mesh(np.array(cpus[:2]), ("expert",)) if len(cpus) >= 2 else None
  table = common.Table(["shape", "pass", "impl", "bf16_ms", "fp8_ms", "speedup", "err_bf16", "err_fp8",
                        "dispatch_B_row_bf16", "dispatch_B_row_fp8"])
  for name, T, D, F, E, k in shapes(args.quick):
    if not common.shape_selected(args, name):
      continue
    arg_sets = [common.layer_operands(T, D, F, E, k, seed=s) for s in range(2)]
    dispatch_bytes = {f"dispatch_B_row_{q or 'bf16'}": common.exchanged_rows(layer_fn(count_mesh, "collective", q),
                                                                            *arg_sets[0])[0][2] if count_mesh else ""
                      for q in (None, "fp8")}
    for pname in args.passes.split(","):
      base = dict(shape=name, **{"pass": pname}, **dispatch_bytes)
      ref = bench_layer.pass_fn(references.layer_reference(np.asarray(arg_sets[0][1]), E), pname)(*arg_sets[0])
      emulation = bench_layer.pass_fn(layer_fn(mesh, "xla", "fp8"), pname)
      try:
        fp8_ref, why = emulation(*arg_sets[0]), ""
      except Exception as e:  # pylint: disable=broad-except
        fp8_ref, why = None, f"not checked (the fp8 emulation failed: {type(e).__name__}: {str(e)[:100]})"
      for impl in args.impls.split(","):
        row = dict(base, impl=impl)
        bf16_ms, err = _checked_ms(bench_layer.pass_fn(layer_fn(mesh, impl, None), pname), arg_sets, ref,
                                   "vs the float32 reference")
        row.update(bf16_ms=bf16_ms, err_bf16=f"{err:.1e}")
        if fp8_ref is None:
          row.update(fp8_ms=why)
        else:
          fp8_ms, err = _checked_ms(bench_layer.pass_fn(layer_fn(mesh, impl, "fp8"), pname), arg_sets, fp8_ref,
                                    "vs the fp8 emulation")
          row.update(fp8_ms=fp8_ms, err_fp8=f"{err:.1e}")
          try:
            row["speedup"] = f"{float(bf16_ms) / float(fp8_ms):.2f}"
          except ValueError:
            pass
        table.add(**row)
        jax.clear_caches()
      if fp8_ref is not None and not args.no_xla:
        table.add(**base, impl="xla (fp8 emulation)", fp8_ms=f"{common.time_fn(emulation, arg_sets) * 1e3:.3f}")
      del ref, fp8_ref
      jax.clear_caches()
  table.finish(args.out)


if __name__ == "__main__":
  main()
