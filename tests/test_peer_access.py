"""workspace_cuda.check_peer_access against a fake CUDA runtime (CI has neither a GPU nor cuda-python): every ordered
pair of distinct GPUs of the expert axis is asked, the first pair without peer access is named in the error, and a
failing query is reported as such."""

import pytest

from jax_moe_overlap import workspace_cuda


class FakeRuntime:
  """What check_peer_access uses of cuda.bindings.runtime: (error, value) tuples, as cuda-python returns them."""

  class cudaError_t:  # pylint: disable=invalid-name
    cudaSuccess = 0
    cudaErrorInvalidDevice = 101

  def __init__(self, no_access=(), failing=None):
    self.no_access, self.failing, self.asked = set(no_access), failing, []

  def cudaDeviceCanAccessPeer(self, a, b):  # pylint: disable=invalid-name
    self.asked.append((a, b))
    if (a, b) == self.failing:
      return self.cudaError_t.cudaErrorInvalidDevice, 0
    return self.cudaError_t.cudaSuccess, 0 if (a, b) in self.no_access else 1


@pytest.fixture
def fake(monkeypatch):
  def install(**kw):
    rt = FakeRuntime(**kw)
    monkeypatch.setattr(workspace_cuda, "_runtime", lambda: rt)
    return rt
  return install


def test_full_peer_access_passes_and_asks_every_ordered_pair(fake):
  rt = fake()
  workspace_cuda.check_peer_access([2, 0, 1, 0])  # a device twice in the axis (groups share GPUs) is asked once
  assert sorted(rt.asked) == [(a, b) for a in range(3) for b in range(3) if a != b]


def test_one_gpu_needs_no_peer_access(fake):
  rt = fake()
  workspace_cuda.check_peer_access([3, 3])
  assert rt.asked == []


def test_missing_peer_access_names_the_pair(fake):
  fake(no_access={(1, 2)})
  with pytest.raises(RuntimeError, match=r"CUDA device 1 cannot access the memory of device 2 .*peer access"):
    workspace_cuda.check_peer_access([0, 1, 2, 3])


def test_a_failing_query_is_reported(fake):
  fake(failing=(0, 1))
  with pytest.raises(RuntimeError, match="cudaDeviceCanAccessPeer failed"):
    workspace_cuda.check_peer_access([0, 1])
