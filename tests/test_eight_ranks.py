"""R = 8: the pytest process has 4 virtual devices, so this runs the comparison in a child process with 8."""

import pytest

from child_process import run_script


@pytest.mark.slow  # a second process with 8 devices, compiling every program again
def test_eight_ranks_match_reference():
  out = run_script("eight_ranks_main.py")
  assert out.count(": match") == 3, out


@pytest.mark.slow  # as above
def test_eight_ranks_dispatch_gemm_equals_two_calls():
  out = run_script("dispatch_gemm_eight_main.py")
  assert out.count(": match") == 2, out
