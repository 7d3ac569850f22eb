"""The training example's step on one GPU, repeated in one process (benchmarks/step_repeat.py): with XLA's attention
(cuDNN's fused attention backward is not deterministic) the loss and every parameter's gradient are the same bits in
each of three repeats, bf16 and (Hopper) FP8: this library's layers and the model around them repeat bit for bit
(docs/performance.md, "The training step's repeatability on a GPU")."""

import numpy as np
import pytest

from gpu_common import is_hopper, requires_gpu

pytestmark = requires_gpu

SMALL = ["--devices", "1", "--d-model", "256", "--d-ff", "256", "--layers", "2", "--heads", "4", "--experts", "8",
         "--top-k", "2", "--seq-len", "256", "--batch-size", "8", "--attention", "xla", "--dtype", "bfloat16"]


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_the_example_step_repeats_bit_for_bit_with_xla_attention(quantization):
  if quantization == "fp8" and not is_hopper():
    pytest.skip("the FP8 kernels need Hopper (sm_90a)")
  from benchmarks import step_repeat  # pylint: disable=import-outside-toplevel  (imports the examples)
  runs = step_repeat.repeat_gradients([*SMALL, "--quantization", quantization], 3)
  names = list(runs[0])
  assert names[0] == "loss" and np.isfinite(runs[0]["loss"]) and any("w1" in n for n in names), names
  assert all(np.any(runs[0][n] != 0) for n in names if "w1" in n or "w2" in n), "an expert gradient is all zeros"
  differ = step_repeat.repeat_differences(runs)
  assert not differ, differ
