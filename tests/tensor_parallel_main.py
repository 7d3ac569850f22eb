"""Run by test_tensor_parallel.py in a fresh process with 8 virtual CPU devices (pytest's own process has 4): every
impl with a tensor axis on the meshes (expert=2, tensor=4), (expert=4, tensor=2) and (data=2, expert=2, tensor=2)
against the float32 oracle, dropless and with dropped slots, and repeated calls bitwise equal; impl "overlap" with
each reduction of the shards' partials (the default picks GatherRS for these float32 layers: call_site.tensor_reduce;
the per-slot return pinned by CallConfig(tensor_reduce="per_slot"))."""

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(8)

import jax  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402

from tensor_parallel_checks import IMPLS, check_matches_oracle, check_repeatable  # noqa: E402

MESHES = (({"expert": 2, "tensor": 4}, ()), ({"expert": 4, "tensor": 2}, ()),
          ({"data": 2, "expert": 2, "tensor": 2}, ("data",)))


def main():
  assert jax.device_count() == 8
  for shape, batch_axes in MESHES:
    for impl in IMPLS:
      check_matches_oracle(shape, impl, batch_axes=batch_axes, tokens=128, seed=11)
      print(f"{shape} {impl}: match", flush=True)
    for impl in ("overlap", "xla"):
      dropped = check_matches_oracle(shape, impl, kinds=("skipped",), cf=0.5, batch_axes=batch_axes, tokens=128,
                                     seed=12)
      assert dropped[0] > 0, dropped
      print(f"{shape} {impl} cf=0.5: dropped {dropped[0]} as the oracle", flush=True)
    per_slot = jmo.CallConfig(tensor_reduce="per_slot")
    check_matches_oracle(shape, "overlap", batch_axes=batch_axes, tokens=128, seed=13, config=per_slot)
    dropped = check_matches_oracle(shape, "overlap", kinds=("skipped",), cf=0.5, batch_axes=batch_axes, tokens=128,
                                   seed=14, config=per_slot)
    assert dropped[0] > 0, dropped
    print(f"{shape} overlap per_slot: match, dropped {dropped[0]} as the oracle", flush=True)
  check_repeatable({"data": 2, "expert": 2, "tensor": 2}, "overlap", batch_axes=("data",), tokens=128)
  print("(data=2, expert=2, tensor=2) overlap: repeated calls bitwise equal", flush=True)
  check_repeatable({"data": 2, "expert": 2, "tensor": 2}, "overlap", batch_axes=("data",), tokens=128, calls=3,
                   config=jmo.CallConfig(tensor_reduce="per_slot"))
  print("(data=2, expert=2, tensor=2) overlap per_slot: repeated calls bitwise equal", flush=True)


if __name__ == "__main__":
  main()
