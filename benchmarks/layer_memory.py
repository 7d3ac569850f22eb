"""XLA's memory analysis of one MoE layer's forward + backward, per impl: temporaries and the largest buffers of the
optimized program (why a shape fits with one impl and not another).

  python -m benchmarks.layer_memory                      # the training preset's layer: T=32768 D=1024 E=16 k=4 F=1024
  python -m benchmarks.layer_memory --tokens 8192 --impls xla
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import common

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def largest_buffers(hlo_text: str, top: int) -> list[tuple[int, str]]:
  """(bytes, instruction) of the `top` largest array-valued instructions of an optimized HLO text."""
  found = []
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]", line)
    if m and m.group(1) in _BYTES:
      n = int(np.prod([int(d) for d in m.group(2).split(",") if d])) * _BYTES[m.group(1)]
      found.append((n, line.strip()[:160]))
  return sorted(found, reverse=True)[:top]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=32768)
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--d-ff", type=int, default=1024)
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--top-k", type=int, default=4)
  ap.add_argument("--capacity-factor", type=float, default=1.25)
  ap.add_argument("--impls", default="xla,overlap")
  ap.add_argument("--top", type=int, default=3)
  a = ap.parse_args(argv)
  T, D, F, E, k = a.tokens, a.d_model, a.d_ff, a.experts, a.top_k
  mesh = jax.make_mesh((1,), ("expert",))
  x, ids, gates, w1, w2 = common.layer_operands(T, D, F, E, k)
  print(f"one layer, forward + backward: T={T} D={D} F={F} E={E} k={k} cf={a.capacity_factor} bf16, "
        f"{jax.devices()[0].platform}")
  for impl in a.impls.split(","):
    def loss(x, w1, w2, impl=impl):
      y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, capacity_factor=a.capacity_factor)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).compile()
    m = compiled.memory_analysis()
    print(f"{impl}: temporaries {m.temp_size_in_bytes / 2**30:.2f} GiB")
    for n, line in largest_buffers(compiled.as_text(), a.top):
      print(f"  {n / 2**30:8.2f} GiB  {line}")


if __name__ == "__main__":
  main()
