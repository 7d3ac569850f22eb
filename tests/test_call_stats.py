"""Workspace.last_call_stats: the CUDA kernels' per-rank record of the last expert_combine as CallStats (the raw
%globaltimer records turned into spans here, on synthetic records: the device side runs in tests/gpu), and None on
CPU workspaces, whose handlers record no spans."""

import pytest

from jax_moe_overlap import workspace_cuda
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from cases import mesh_of

NO_START = 2**64 - 1


def record(consumers=8, pushed=0, prod=(NO_START, 0), cons=(NO_START, 0)):
  return dict(consumers=consumers, pushed_bytes=pushed, producer_start_ns=prod[0], producer_end_ns=prod[1],
              consumer_start_ns=cons[0], consumer_end_ns=cons[1])


def test_overlapped_call():
  # Producer 1000..401000 ns, consumer 3000..503000 ns pushing 40 MB: 100 us of the kernel's 502 us apart.
  s = workspace_cuda.call_stats(1, record(8, 40_000_000, (10**12 + 1000, 10**12 + 401000),
                                          (10**12 + 3000, 10**12 + 503000)))
  assert (s.rank, s.consumers, s.pushed_bytes, s.origin_ns) == (1, 8, 40_000_000, 10**12 + 1000)
  assert (s.producer_start_us, s.producer_end_us, s.consumer_start_us, s.consumer_end_us) == (0, 400, 2, 502)
  assert (s.producer_us, s.consumer_us, s.busy_us, s.overlap_us) == (400, 500, 502, 398)
  assert s.push_gbps == pytest.approx(80.0)  # 40 MB in 500 us


def test_serialized_call_has_a_gap():
  s = workspace_cuda.call_stats(0, record(4, 1_000_000, (5000, 105000), (110000, 120000)))
  assert s.overlap_us == pytest.approx(-5.0) and s.busy_us == pytest.approx(115.0)
  assert s.push_gbps == pytest.approx(100.0)


@pytest.mark.parametrize("cons", [(NO_START, 0), (0, 0)])  # nothing remote; a group reset (all words zero)
def test_a_side_that_did_nothing_is_none(cons):
  s = workspace_cuda.call_stats(0, record(8, 0, (2000, 9000), cons))
  assert (s.consumer_start_us, s.consumer_end_us, s.consumer_us, s.overlap_us, s.push_gbps) == (None,) * 5
  assert (s.origin_ns, s.producer_us, s.busy_us) == (2000, 7.0, 7.0)
  empty = workspace_cuda.call_stats(0, record(0, 0))
  assert (empty.origin_ns, empty.producer_us, empty.consumer_us, empty.busy_us) == (0, None, None, None)


def test_cpu_workspace_records_nothing():
  ws = Workspace.get(mesh_of(2), "expert", WorkspaceSizes(row_bytes=64, recv_rows=32, ret_rows=32, num_segments=4))
  assert ws.platform == "cpu" and ws.last_call_stats() is None


def test_the_whole_call_timeline():
  # Begin at 1000 ns, producer CTAs start 5000..5400 ns and end 405000, combine 406000..466000.
  r = record(0, 0, (5000, 405000))
  r.update(begin_ns=1000, last_producer_start_ns=5400, combine_start_ns=406000, combine_end_ns=466000,
           expert_kernel_start_ns=3000)
  s = workspace_cuda.call_stats(0, r)
  assert s.origin_ns == 1000 and (s.begin_us, s.producer_start_us, s.combine_end_us) == (0, 4, 465)
  assert s.kernel_start_us == 2  # the expert kernel's first CTA, 2 us before its first producer tile
  assert s.call_us == 465 and s.producer_start_spread_us == pytest.approx(0.4)
  assert s.combine_start_us == 405 and s.busy_us == 400  # busy_us: the expert kernel's recorded work alone
  # A record without them (an older extension, or a reset group) leaves them None.
  old = workspace_cuda.call_stats(0, record(0, 0, (5000, 405000)))
  assert (old.begin_us, old.call_us, old.producer_start_spread_us, old.combine_start_us, old.kernel_start_us) == (
      (None,) * 5)
  reset = dict(r, begin_ns=0, last_producer_start_ns=0, combine_start_ns=0, combine_end_ns=0)
  assert workspace_cuda.call_stats(0, reset).call_us is None
