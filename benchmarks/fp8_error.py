"""The error of the whole FP8 layer against the unquantized layer in float64, forward and gradients, per shape
(issue 33), beside the same layer in bfloat16 without quantization; runs on a CPU.

For each shape: fresh random normal operands at a fixed seed (``common.layer_operands``: x, w1 and w2 in bfloat16,
the weights scaled by 1/sqrt(fan-in), softmax gates in float32; expert ids from ``common.topk_routing``, uniform
over the experts and distinct within a token, as a router gives) and a random normal output gradient. The layer is
``jmo.moe_experts(..., impl=IMPL, capacity_factor=None)`` (dropless) on a one-device mesh, once with
``quantization="fp8"`` (the bfloat16 weights are its master weights) and once with ``quantization=None``, both on
the same operands; its output y and the gradients dx, dgates, dw1, dw2 of sum(y * cotangent) (``references.grads_fn``)
are compared with the unquantized layer's in float64 on the same values (``references.float64_layer``, the dense
reference's formula), so the error is the computation's alone, not the inputs' rounding. The metric is
tests/test_fp8_layer.py::test_oracle_error_against_float64's: the Frobenius relative error ||got - want|| / ||want||
of each output (``references.rel_err``; that test holds the FP8 oracle within ``references.FP8_ERROR_BOUND``).

Shapes: scaled-down forms of the seed sweep's (D = F, 8 experts, top-2), Mixtral-like (F / D = 3.5, 8 experts,
top-2) and DeepSeek-like (F / D = 0.5, 32 experts, top-8) layers at D = 1024 (F = 14336 / 4 for Mixtral-like), which
keep each shape's ratios and run on a 2-core CPU within a minute each: 512 tokens (128 rows per expert), 384 for the
Mixtral-like (its F makes it the slowest: with impl="overlap" most of the time is the CPU's emulation of the FP8
grouped GEMM). Prints the command line, the jax version and one markdown table, each cell "fp8 error / bf16 error".

  python3 -m benchmarks.fp8_error                          # the three shapes, impl="overlap"
  python3 -m benchmarks.fp8_error --shapes mixtral --tokens 1024
  python3 -m benchmarks.fp8_error --custom 128,128,8,2 --tokens 64 --impl xla
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import common, references

# (name, tokens, D, F, E, k)
SHAPES = [("seed-like", 512, 1024, 1024, 8, 2),
          ("mixtral-like", 384, 1024, 3584, 8, 2),
          ("deepseek-like", 512, 1024, 512, 32, 8)]
OUTPUTS = ("y", "dx", "dgates", "dw1", "dw2")
COLUMNS = ["shape", "T", "D", "F", "E", "k", *(f"{n} fp8 / bf16" for n in OUTPUTS)]
IMPLS = ("overlap", "collective", "xla", "reference")
# impl="overlap" on a CPU: its combine waits for GEMM2's tiles, which the CPU's FP8 grouped GEMM emulation takes
# longer to produce than the default 10 s bound (CallConfig.timeout_ms) at these shapes.
CONFIG = jmo.CallConfig(timeout_ms=600_000)


def shape_errors(mesh, impl: str, T: int, D: int, F: int, E: int, k: int, seed: int) -> dict:
  """{quantization: [the relative error of y, dx, dgates, dw1, dw2]} against the float64 layer, for "fp8" and
  None (bfloat16), on one set of random operands."""
  x, _, gates, w1, w2 = common.layer_operands(T, D, F, E, k, seed)
  ids = jnp.asarray(common.topk_routing(T, E, k, "balanced", seed))
  cot = np.random.default_rng(seed).standard_normal((T, D)).astype(np.float32)
  want = references.float64_layer(x, ids, gates, w1, w2, cot, T * k)
  errs = {}
  for q in ("fp8", None):
    (_, y), grads = references.grads_fn(mesh, ids, jnp.asarray(cot), impl, quantization=q, config=CONFIG)(
        x, gates, w1, w2)
    errs[q] = [references.rel_err(a, b) for a, b in zip((y, *grads), want)]
  return errs


def main(argv=None) -> str:
  """Runs the shapes, prints the command line, the jax version and the table; returns the table."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="", help="comma-separated substrings: only shapes whose name holds one")
  ap.add_argument("--tokens", type=int, default=0, help="tokens per layer call (default: each shape's)")
  ap.add_argument("--custom", default="", metavar="D,F,E,k", help="one shape of these sizes instead of the named")
  ap.add_argument("--impl", default="overlap", choices=IMPLS)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.custom:
    shapes = [("custom", 512, *(int(v) for v in args.custom.split(",")))]
  else:
    shapes = [s for s in SHAPES if common.shape_selected(args, s[0])]
  if not shapes:
    ap.error(f"--shapes {args.shapes!r} selects none of {[s[0] for s in SHAPES]}")
  mesh = common.expert_mesh(1, common.AXIS)
  table = common.Table(COLUMNS)
  for name, T, D, F, E, k in shapes:
    T = args.tokens or T
    t0 = time.perf_counter()
    errs = shape_errors(mesh, args.impl, T, D, F, E, k, args.seed)
    table.rows.append(dict(zip(COLUMNS, (name, T, D, F, E, k, *(f"{a:.2e} / {b:.2e}" for a, b in
                                                                   zip(errs["fp8"], errs[None]))))))
    print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    jax.clear_caches()
  text = table.render()
  print(f"command: {common.command_line()}\njax {jax.__version__}, {mesh.devices.flat[0].device_kind}, "
        f"impl={args.impl!r}, seed {args.seed}\n\n{text}", flush=True)
  return text


if __name__ == "__main__":
  main()
