"""Expert tensor parallelism on GPUs: the overlap layer (CUDA kernels) with a tensor axis, meshes (expert, tensor) over
the visible GPUs (tensor = 2 and 4 where they divide the GPU count: at 2 GPUs (expert=1, tensor=2), at 4 also
(expert=2, tensor=2), at 8 (expert=4, tensor=2) and (expert=2, tensor=4)). The bodies are tests/
tensor_parallel_checks.py: bfloat16 forward and gradients against the float32 oracle on the same bf16-rounded inputs
(relative error below 1e-2, outputs computed into NaN-poisoned buffers) with skipped slots, empty experts and dropped
capacity, at d_model 256 and d_ff 384 (the wgmma engine's operands on Hopper), and repeated calls bitwise equal.
tests/test_tensor_parallel.py runs them on CPU devices. Skips where there is no GPU or fewer than 2."""

import pytest

from gpu_common import gpu_devices, requires_gpu
import tensor_parallel_checks as checks  # tests/ (on pytest's pythonpath)

pytestmark = requires_gpu


def _shapes():
  n = len(gpu_devices())
  return [{"expert": n // t, "tensor": t} for t in (2, 4) if n >= t and n % t == 0]


SHAPES = _shapes()
by_shape = pytest.mark.parametrize("shape", SHAPES or [None], ids=lambda s: "x".join(map(str, s.values())) if s
                                   else "none")


def _need(shape):
  if shape is None:
    pytest.skip("expert tensor parallelism needs at least 2 GPUs")


@pytest.mark.parametrize("kind,cf", [("skipped", None), ("empty_experts", None), ("skewed", 0.5)])
@by_shape
def test_bfloat16_forward_and_grads(shape, kind, cf):
  _need(shape)
  checks.check_bfloat16(shape, kind=kind, cf=cf, tokens=256, d=256, f=384, devices=gpu_devices())


@by_shape
def test_repeated_calls_bitwise_equal(shape):
  _need(shape)
  checks.check_repeatable(shape, "overlap", calls=50, tokens=256, devices=gpu_devices())
