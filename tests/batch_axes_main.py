"""Run by test_batch_axes.py in a fresh process with 8 virtual CPU devices (pytest's own process has 4)."""

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(8)

import jax  # noqa: E402

from batch_axes_checks import check_matches_reference  # noqa: E402


def main():
  assert jax.device_count() == 8
  for shape, batch_axes, cf in (({"data": 2, "fsdp": 2, "expert": 2}, ("data", "fsdp"), None),
                                ({"data": 2, "fsdp": 2, "expert": 2}, ("data", "fsdp"), 0.5),
                                ({"data": 2, "expert": 4}, ("data",), None)):
    dropped = check_matches_reference(shape, batch_axes, cf=cf, tokens=128, seed=5)
    print(f"{shape} batch_axes={batch_axes} cf={cf}: match (dropped {dropped})")


if __name__ == "__main__":
  main()
