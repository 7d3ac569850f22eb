"""Run by test_eight_ranks.py in a fresh process with 8 virtual CPU devices (pytest's own process has 4)."""

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import test_moe  # noqa: E402  (reuses its input generators and comparison)


def main():
  assert jax.device_count() == 8
  for kind, cf in (("skewed", None), ("balanced", None), ("skewed", 0.5)):
    out = test_moe.run_both(8, 2, kind, cf=cf, seed=8)
    (y, dropped, grads), (y_ref, dropped_ref, grads_ref) = out["overlap"], out["reference"]
    assert int(dropped) == int(dropped_ref), (dropped, dropped_ref)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
      np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
    print(f"R=8 {kind} cf={cf}: match (dropped {int(dropped)})")


if __name__ == "__main__":
  main()
