"""The FP8 expert layer against bf16 at one shape, output by output and kernel by kernel, on one device:

  * each output's max-relative error (y, dx, dgates, dW1, dW2) against the float32 reference
    (references.layer_reference) for impl="collective" in bf16 and fp8 and for the fp8 emulation (impl="xla"), then
    the fp8 kernels against the emulation;
  * a kernel trace (benchmarks/device_trace.py) of the forward and of forward + backward, bf16 and fp8.

  python3 -m benchmarks.fp8_layer_profile                 # Mixtral-like, 4096 tokens
  python3 -m benchmarks.fp8_layer_profile --tokens 16384
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import bench_layer, common, device_trace, references

OUTPUTS = ("dx", "dgates", "dw1", "dw2")  # bench_layer.pass_fn's gradients, in its order


def layer(mesh, impl: str, quantization: str | None):
  return lambda *a: jmo.moe_experts(*a, mesh=mesh, impl=impl, quantization=quantization)[0]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--shape", default="4096,14336,8,2", help="D,F,E,k (default Mixtral-like)")
  ap.add_argument("--calls", type=int, default=5, help="traced calls per pass")
  args = ap.parse_args(argv)
  D, F, E, k = (int(v) for v in args.shape.split(","))
  mesh = jax.make_mesh((1,), ("expert",))
  operands = common.layer_operands(args.tokens, D, F, E, k, seed=0)
  reference = references.layer_reference(np.asarray(operands[1]), E)
  ref_y = jax.jit(reference)(*operands)
  ref_g = bench_layer.pass_fn(reference, "fwd+bwd")(*operands)
  outs = {}
  for impl, q in (("collective", None), ("collective", "fp8"), ("xla", "fp8")):
    t = time.time()
    y = jax.jit(layer(mesh, impl, q))(*operands)
    g = bench_layer.pass_fn(layer(mesh, impl, q), "fwd+bwd")(*operands)
    outs[impl, q] = (y, g)
    errs = [references.max_rel_err(y, ref_y)] + [references.max_rel_err(a, b) for a, b in zip(g, ref_g)]
    print(f"error vs float32: {impl:10s} {q or 'bf16':5s} y {errs[0]:.2e} " +
          " ".join(f"{n} {e:.2e}" for n, e in zip(OUTPUTS, errs[1:])), f"({time.time() - t:.0f} s)", flush=True)
  (y1, g1), (y2, g2) = outs["collective", "fp8"], outs["xla", "fp8"]
  print("fp8 kernels vs the fp8 emulation: y %.2e " % references.max_rel_err(y1, y2) +
        " ".join(f"{n} {references.max_rel_err(a, b):.2e}" for n, a, b in zip(OUTPUTS, g1, g2)), flush=True)
  del outs, ref_y, ref_g
  for q in (None, "fp8"):
    for pname in ("fwd", "fwd+bwd"):
      summary = device_trace.trace_calls(bench_layer.pass_fn(layer(mesh, "collective", q), pname), operands,
                                         calls=args.calls, warmup=2)
      print(f"=== trace T={args.tokens} {q or 'bf16'} {pname}")
      print(device_trace.format_summary(summary, kernels=14, host=0), flush=True)


if __name__ == "__main__":
  main()
