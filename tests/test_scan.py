"""A stack of expert layers under lax.scan (how a transformer's layers are usually stacked), differentiated."""

import pytest

from child_process import run_script


@pytest.mark.slow  # a fresh process compiling the scanned gradient twice
@pytest.mark.parametrize("impl", [
    pytest.param("overlap", marks=pytest.mark.xfail(
        strict=True, reason="XLA's Shardy pass (ManualComputationUnusedInputsPattern) segfaults compiling it: the "
        "scan hoists the layer's rank-only residuals into a shard_map with no inputs")),
    "collective", "xla"])
def test_grad_through_scan_matches_reference(impl):
  out = run_script("scan_grad_main.py", impl, timeout=300)
  assert f"{impl}: match" in out, out
