"""A kernel trace of decode_step.py's step, bfloat16 weights and FP8 weights quantized once, per token count: each
step traced 20 times after warm-up (``device_trace.trace_calls``) and its kernels, gaps and busy time printed. Run it
without CUDA graphs so that every kernel is named (in a graph they carry the graph's name):

  XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m benchmarks.decode_trace --tokens 32,256
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import bench_decode, decode_step, device_trace


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  bench_decode.add_model_args(ap, "32,256")
  ap.add_argument("--calls", type=int, default=20, help="traced steps")
  args = ap.parse_args(argv)
  mesh = jax.make_mesh((1,), (decode_step.AXIS,))
  model = decode_step.DecodeModel.from_args(args)
  params = decode_step.init_params(model, mesh)
  weights = {"bf16": params, "fp8": decode_step.quantize_params(params, mesh)}
  for T in (int(t) for t in args.tokens.split(",")):
    x = decode_step.first_tokens(model, T, mesh)
    for name, p in weights.items():
      step = decode_step.make_step(model, mesh, quantization=None if name == "bf16" else name)
      s = device_trace.trace_calls(step, (p, x), calls=args.calls, warmup=3)
      print(f"=== decode T={T} {name}")
      print(device_trace.format_summary(s, kernels=16, host=0), flush=True)


if __name__ == "__main__":
  main()
