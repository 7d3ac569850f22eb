"""The MoE expert layer at EP = 1 (one GPU; --devices N: an expert axis of N devices, issue 34's multi-GPU rows),
forward and forward+backward, with quantization="fp8" against bf16, per impl (--impls, default collective and
overlap; also "overlap+fused": impl="overlap" with its returns fused under fp8 (call_site.FP8_FUSED_COMBINE_ON_GPU
set while it is traced, the default: GEMM2 and the way back, dx and its way back as expert_combine on e4m3 operands;
at one rank the same as overlap), "overlap+fused-dispatch" (FP8_FUSED_DISPATCH_ON_GPU, off by default:
x's dispatch with GEMM1 and dy's with dh = dy W2^T as dispatch_gemm on packed rows; d_model a multiple of 512),
"overlap+fused-all" (both), and "overlap-serialized" (CallConfig(serialize=True))):
``moe_experts(impl="collective")`` (the exchange in XLA, the experts
in this library's grouped GEMMs: bf16 ``grouped_matmul_swiglu`` / ``grouped_matmul`` / ``grouped_outer``, or under
fp8 the e4m3 grouped GEMM for GEMM1, GEMM2, the two dgrads and the two wgrads, fp8_experts.KERNELS) and
``impl="overlap"`` (the rows moved by the workspace's custom calls; under fp8 dispatched as packed e4m3 rows, the
recipe's GEMMs unfused from the dispatches, and the returns fused where call_site.fp8_fused_combine says so: on CPU,
and on GPUs in the overlap+fused row: fp8_overlap.py), and the FP8 recipe emulated in XLA (``impl="xla"``,
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
--devices devices (at 1, no rows cross an exchange). Empty where the host has one CPU device
(XLA_FLAGS=--xla_force_host_platform_device_count=2 gives it two).
Nothing is timed before it agrees with the float32 reference (references.layer_reference) on the first input set:
bf16 within err_bf16 <= 2e-2 (max-relative error, the largest over the pass's outputs); fp8, output by output, within
FP8_MARGIN times the fp8 emulation's own error against that reference (err_fp8 and err_emulation: the largest over
the outputs). The kernels and the emulation quantize the same values, but a float32 sum that differs in its last bit
(the tensor core's order, or XLA:GPU's) can move a value across an e4m3 rounding boundary, and the downstream
quantizations carry that one step (up to 1/16 of the value) on: at Mixtral-like sizes the two FP8 computations part
by up to 6% of max |dW| while each is 6-10% from the float32 layer (docs/performance.md), so the emulation's error
sizes the bound. fp8_vs_emulation: their largest max-relative difference, reported.

  python3 -m benchmarks.bench_fp8_layer --out /tmp/fp8_layer.jsonl
  python3 -m benchmarks.bench_fp8_layer --devices 8 --impls collective,overlap,overlap+fused,overlap+fused-all,overlap-serialized
  python3 -m benchmarks.bench_fp8_layer --quick --out /tmp/fp8_layer_quick.jsonl
  JMO_TIMEOUT_MS=120000 python3 -m benchmarks.bench_fp8_layer --quick --passes fwd   # a CPU try-out: the CPU
      # emulations take seconds per call at the quick shape (well over 15 minutes for both passes on 2 cores), and
      # impl="overlap"'s combine waits for its producer's tiles longer than the default 10 s bound there
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from jax_moe_overlap import call_site
from benchmarks import bench_layer
from benchmarks import common
from benchmarks import references

MAX_ERR = 2e-2
FP8_MARGIN = 1.1  # an fp8 output's error against the float32 reference, at most this times the emulation's


def shapes(quick: bool, tokens: int = 0):
  """(name, tokens, D, F, E, k): bench_layer's Mixtral-like and DeepSeek-like layers (--quick: a small one), at 4096
  tokens or ``tokens``."""
  if quick:
    return [("small", tokens or 2048, 1024, 1024, 8, 2)]
  T = tokens or 4096
  return [("mixtral-like", T, 4096, 14336, 8, 2), ("deepseek-like E_l=32", T, 7168, 2048, 32, 8)]


def _speedup(bf16_ms: str, fp8_ms: str) -> str:
  try:
    return f"{float(bf16_ms) / float(fp8_ms):.2f}"
  except ValueError:  # either one a message
    return ""


# The rows that switch on FP8 fusions GPUs do not take yet, and the call_site switches each sets while it is traced.
FUSIONS = {"overlap+fused": ("FP8_FUSED_COMBINE_ON_GPU",),
           "overlap+fused-dispatch": ("FP8_FUSED_DISPATCH_ON_GPU",),
           "overlap+fused-all": ("FP8_FUSED_COMBINE_ON_GPU", "FP8_FUSED_DISPATCH_ON_GPU")}
IMPLS = ("collective", "overlap", *FUSIONS, "overlap-serialized")


def layer_fn(mesh, impl: str, quantization: str | None):
  """The layer of a row's impl (IMPLS, or "xla") on global arrays (x, ids, gates, w1, w2) -> y."""
  config = jmo.CallConfig(serialize=True) if impl == "overlap-serialized" else jmo.CallConfig()
  name = impl.split("+")[0].split("-")[0]
  layer = lambda *a: jmo.moe_experts(*a, mesh=mesh, impl=name, quantization=quantization, config=config)[0]
  if impl not in FUSIONS:
    return layer

  def fused(*a):  # (read where the layer is traced: jit traces this call)
    saved = {k: getattr(call_site, k) for k in FUSIONS[impl]}
    try:  # (the call site built in the call carries them: RankInfo.fp8_fused_combine, fp8_fused_dispatch)
      for k in saved:
        setattr(call_site, k, True)
      return layer(*a)
    finally:
      for k, v in saved.items():
        setattr(call_site, k, v)
  return fused


def output_errors(got, ref_outs) -> list[float]:
  """Each output's max-relative error against the reference's."""
  return [references.max_rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref_outs))]


def _checked_ms(fn, arg_sets, ref_outs, bounds, what: str, also=None):
  """(ms, errors, difference) of fn after checking each output against ref_outs within its bound on the first input
  set, ms a message when one is out of bounds or fn fails (errors [nan] then); difference: the largest max-relative
  difference of those outputs from ``also``'s (nan without it)."""
  try:
    got = fn(*arg_sets[0])
    errs = output_errors(got, ref_outs)
    diff = float("nan") if also is None else bench_layer.error_vs(also, got)
    del got
    if not all(e <= b for e, b in zip(errs, bounds)):  # (NaN too)
      return f"wrong result ({what}), not timed", errs, diff
    return f"{common.time_fn(fn, arg_sets) * 1e3:.3f}", errs, diff
  except Exception as e:  # pylint: disable=broad-except
    return f"error: {type(e).__name__}: {str(e)[:100]}", [float("nan")], float("nan")


def main(argv=None):
  common.virtual_cpu_devices(sys.argv if argv is None else argv, default=1)  # a CPU try-out of --devices N
  ap = common.shape_parser("fp8_layer.jsonl")
  ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd")
  ap.add_argument("--impls", default="collective,overlap", help=f"comma list of {', '.join(IMPLS)}")
  ap.add_argument("--devices", type=int, default=1, help="the expert axis' devices (tokens and experts over them)")
  ap.add_argument("--no-xla", action="store_true", help="leave out the fp8 emulation's timing (impl='xla')")
  ap.add_argument("--tokens", type=int, default=0, help="tokens per layer call (default: each shape's)")
  args = ap.parse_args(argv)
  if set(args.impls.split(",")) - set(IMPLS):
    ap.error(f"--impls: unknown {sorted(set(args.impls.split(',')) - set(IMPLS))}; known: {list(IMPLS)}")
  mesh = common.expert_mesh(args.devices, "expert")
  cpus = jax.devices("cpu")
  count_mesh = jax.sharding.Mesh(np.array(cpus[:2]), ("expert",)) if len(cpus) >= 2 else None
  table = common.Table(["shape", "pass", "impl", "bf16_ms", "fp8_ms", "speedup", "err_bf16", "err_fp8",
                        "err_emulation", "fp8_vs_emulation", "dispatch_B_row_bf16", "dispatch_B_row_fp8"])
  for name, T, D, F, E, k in shapes(args.quick, args.tokens):
    if not common.shape_selected(args, name):
      continue
    arg_sets = [common.layer_operands(T, D, F, E, k, seed=s) for s in range(2)]
    dispatch_bytes = {f"dispatch_B_row_{q or 'bf16'}": common.exchanged_rows(layer_fn(count_mesh, "collective", q),
                                                                            *arg_sets[0])[0][2] if count_mesh else ""
                      for q in (None, "fp8")}
    for pname in args.passes.split(","):
      base = dict(shape=f"{name} T={T}" + (f" R={mesh.size}" if mesh.size > 1 else ""), **{"pass": pname},
                  **dispatch_bytes)
      ref = bench_layer.pass_fn(references.layer_reference(np.asarray(arg_sets[0][1]), E), pname)(*arg_sets[0])
      emulation = bench_layer.pass_fn(layer_fn(mesh, "xla", "fp8"), pname)
      n_out = len(jax.tree.leaves(ref))
      try:
        fp8_ref, why = emulation(*arg_sets[0]), ""
        emulation_errs = output_errors(fp8_ref, ref)
      except Exception as e:  # pylint: disable=broad-except
        fp8_ref, why = None, f"not checked (the fp8 emulation failed: {type(e).__name__}: {str(e)[:100]})"
      for impl in args.impls.split(","):
        row = dict(base, impl=impl)
        bf16_ms, errs, _ = _checked_ms(bench_layer.pass_fn(layer_fn(mesh, impl, None), pname), arg_sets, ref,
                                       [MAX_ERR] * n_out, "vs the float32 reference")
        row.update(bf16_ms=bf16_ms, err_bf16=f"{max(errs):.1e}")
        if fp8_ref is None:
          row.update(fp8_ms=why)
        else:
          fp8_fn = bench_layer.pass_fn(layer_fn(mesh, impl, "fp8"), pname)
          bounds = [FP8_MARGIN * e for e in emulation_errs]
          what = f"vs the float32 reference, beyond {FP8_MARGIN} x the fp8 emulation's error"
          fp8_ms, errs, vs_emulation = _checked_ms(fp8_fn, arg_sets, ref, bounds, what, also=fp8_ref)
          row.update(fp8_ms=fp8_ms, speedup=_speedup(bf16_ms, fp8_ms), err_fp8=f"{max(errs):.1e}",
                     err_emulation=f"{max(emulation_errs):.1e}", fp8_vs_emulation=f"{vs_emulation:.1e}")
        table.add(**row)
        if pname == "fwd" and fp8_ref is not None:
          # Inference: the weights quantized once (jmo.quantize_weights, untimed), so a call reads only FP8 weights.
          pre_sets = [(*a[:3], *jmo.quantize_weights(a[3], a[4])) for a in arg_sets]
          fp8_ms, errs, _ = _checked_ms(jax.jit(layer_fn(mesh, impl, "fp8")), pre_sets, ref, bounds, what)
          table.add(**dict(base, impl=f"{impl}, weights pre-quantized"), bf16_ms=bf16_ms, fp8_ms=fp8_ms,
                    speedup=_speedup(bf16_ms, fp8_ms), err_bf16=row["err_bf16"], err_fp8=f"{max(errs):.1e}",
                    err_emulation=row["err_emulation"])
          del pre_sets
        jax.clear_caches()
      if fp8_ref is not None and not args.no_xla:
        table.add(**base, impl="xla (fp8 emulation)", fp8_ms=f"{common.time_fn(emulation, arg_sets) * 1e3:.3f}")
      del ref, fp8_ref
      jax.clear_caches()
  table.finish(args.out)


if __name__ == "__main__":
  main()
