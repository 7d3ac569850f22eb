"""Run by test_eager.py in a fresh process with 8 virtual CPU devices (pytest's own process has 4): eager calls of
the layer on the meshes the tests use. Argument: "vjp" (the eager jax.vjp on a (data 2, expert 4) mesh, repeated) or
"all" (forward, jax.vjp and jax.grad of every impl on every mesh)."""

import sys

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(8)

import jax  # noqa: E402

from eager_checks import check_eager_calls  # noqa: E402

MESHES = ({"expert": 4}, {"data": 2, "expert": 2}, {"data": 2, "expert": 4})
IMPLS = ("overlap", "xla", "reference")


def main(which: str):
  assert jax.device_count() == 8
  if which == "vjp":
    check_eager_calls({"data": 2, "expert": 4}, "overlap", calls=("vjp",), repeats=10)
    print("{'data': 2, 'expert': 4} overlap vjp: match")
    return
  assert which == "all", which
  for shape in MESHES:
    for impl in IMPLS:
      check_eager_calls(shape, impl)
      print(f"{shape} {impl}: match", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
