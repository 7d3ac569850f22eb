"""Run by test_eight_ranks.py in a fresh process with 8 virtual CPU devices (pytest's own process has 4): the layer
with CallConfig(dispatch_pushers=2) (GEMM1's SwiGLU in the fused call's epilogue) against the two calls with the bare
grouped GEMM calls and the reference (test_dispatch_gemm's check) at R = 8."""

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import test_dispatch_gemm  # noqa: E402  (reuses its inputs and comparison)
from cases import mesh_of  # noqa: E402


def main():
  assert jax.device_count() == 8
  mesh = mesh_of(8)
  for dtype, cf, cases in ((jnp.bfloat16, None, [("skewed", True), ("balanced", False)]),
                           (jnp.float32, 0.5, [("skewed", False)])):
    test_dispatch_gemm.check_layer_equals_two_calls(mesh, cases, dtype, cf)
    print(f"R=8 dispatch_gemm {jnp.dtype(dtype).name} cf={cf} {cases}: match")


if __name__ == "__main__":
  main()
