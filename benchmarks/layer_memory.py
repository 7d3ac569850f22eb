"""XLA's memory analysis of one MoE layer's forward + backward, per impl: temporaries and the largest buffers of the
optimized program (why a shape fits with one impl and not another), and with --time its median ms per call.

--switch MODULE.NAME runs each impl once per value of a library switch (--values, default "False,True", each read by
ast.literal_eval; set before the program is traced, caches cleared between settings), and says how far each
setting's gradients are from the first setting's (the largest max-relative difference over x, w1 and w2).

  python -m benchmarks.layer_memory                      # the training preset's layer: T=32768 D=1024 E=16 k=4 F=1024
  python -m benchmarks.layer_memory --tokens 8192 --impls xla
  python -m benchmarks.layer_memory --impls overlap --time \
      --switch jax_moe_overlap.expert_gemms.PREACTIVATION_IN_COMPUTE_DTYPE
  python -m benchmarks.layer_memory --impls overlap --quantizations none,fp8 --time   # bf16 against FP8's recipe

--quantizations runs each impl once per quantization (moe_experts' quantization: "none" is None, "fp8" DeepSeek-V3's
recipe, which quantizes the weights inside the program as training does; D and F multiples of 128).
"""

from __future__ import annotations

import argparse
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import common
from benchmarks import references
from benchmarks import set_switch, switch_values

_NO_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1}


def largest_buffers(hlo_text: str, top: int) -> list[tuple[int, str]]:
  """(bytes, instruction) of the `top` largest arrays that instructions of an optimized HLO text write: outside fused
  computations (an instruction inside a fusion's body is computed in registers, never stored), and not the
  parameters or the instructions that only name arrays (``_NO_BUFFER``)."""
  fused = set(re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", hlo_text))
  found, inside = [], False
  for line in hlo_text.splitlines():
    header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header and not line.startswith(" "):
      inside = header.group(1) in fused
      continue
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\(.*?\)|\w+\[[\d,]*\])(?:\{[\d,]*\})? ([\w\-]+)\(", line)
    if m and not inside and m.group(2) not in _NO_BUFFER:
      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):   # each array of a tuple result
        if dtype in _BYTES:
          found.append((int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES[dtype], line.strip()[:160]))
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
  ap.add_argument("--time", action="store_true", help="also time forward + backward (median ms per call)")
  ap.add_argument("--switch", default=None, help="MODULE.NAME of a library switch to run each impl under")
  ap.add_argument("--values", default="False,True", help="the switch's settings (with --switch)")
  ap.add_argument("--quantizations", default="none", help="comma-separated: none (the model's dtype), fp8")
  ap.add_argument("--hlo-dir", default=None, help="also write each program's optimized HLO text there")
  a = ap.parse_args(argv)
  T, D, F, E, k = a.tokens, a.d_model, a.d_ff, a.experts, a.top_k
  mesh = jax.make_mesh((1,), ("expert",))
  x, ids, gates, w1, w2 = common.layer_operands(T, D, F, E, k)
  print(f"one layer, forward + backward: T={T} D={D} F={F} E={E} k={k} cf={a.capacity_factor} bf16, "
        f"{jax.devices()[0].platform}")
  values = switch_values(a.values) if a.switch else [None]
  name = a.switch.rsplit(".", 1)[-1] if a.switch else None
  quantizations = a.quantizations.split(",")
  bad = [q for q in quantizations if q not in ("none", "fp8")]
  if bad:
    ap.error(f"--quantizations takes none and fp8, not {bad}")
  for impl, quant in ((i, q) for i in a.impls.split(",") for q in quantizations):
    first = None
    for value in values:
      if a.switch:
        set_switch(a.switch, value, "layer_memory")
        jax.clear_caches()

      def loss(x, w1, w2, impl=impl, quant=None if quant == "none" else quant):
        y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, capacity_factor=a.capacity_factor,
                               quantization=quant)
        return jnp.sum(y.astype(jnp.float32) ** 2)
      compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).compile()
      m = compiled.memory_analysis()
      label = impl + ("" if quant == "none" else f" {quant}") + (f", {name}={value}" if a.switch else "")
      print(f"{label}: temporaries {m.temp_size_in_bytes / 2**30:.2f} GiB", flush=True)
      if a.hlo_dir:
        os.makedirs(a.hlo_dir, exist_ok=True)
        with open(os.path.join(a.hlo_dir, re.sub(r"[^\w.-]+", "_", label) + ".hlo.txt"), "w") as f:
          f.write(compiled.as_text())
      for n, text in largest_buffers(compiled.as_text(), a.top):
        print(f"  {n / 2**30:8.2f} GiB  {text}")
      # The program runs only where asked (the analysis alone must also answer for shapes that do not fit).
      if len(values) > 1:
        grads = compiled(x, w1, w2)
        if first is None:
          first = grads
        else:
          diff = max(references.max_rel_err(g, f) for g, f in zip(grads, first))
          print(f"  gradients within {diff:.1e} (max-relative) of {name}={values[0]}'s", flush=True)
      if a.time:
        print(f"  {common.time_fn(compiled, [(x, w1, w2)]) * 1e3:.3f} ms forward + backward", flush=True)


if __name__ == "__main__":
  main()
