"""exchange_counts, the routing counts through the workspace (the path of groups spanning processes), in one process:
every rank's counts as all_gather gives them, call after call; a late peer fails it within the timeout naming the
counts stage, and the next call works; gather_counts picks it only for a workspace spanning processes, and the layer
through it equals the one through all_gather bit for bit. (Across processes: test_multiprocess.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
import layer_checks as checks
from cases import mesh_of
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.workspace_calls import exchange_counts

R, E = 4, 8


def _exchanges(mesh, config, calls):
  """A program of `calls` exchanges per rank (their inputs differ), returning each next to all_gather's result."""
  ws = Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=64, recv_rows=64, ret_rows=64, num_segments=E))
  info = RankInfo(ws, config)

  def local(counts):  # [calls, R_dst, E_local] per rank
    got = [exchange_counts(counts[i], info) for i in range(calls)]
    want = [jax.lax.all_gather(counts[i], "expert") for i in range(calls)]
    return jnp.stack(got)[None], jnp.stack(want)[None]

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "expert"), out_specs=P("expert"),
                               check_vma=False))


def test_every_ranks_counts_call_after_call():
  mesh = mesh_of(R)
  calls = 5
  fn = _exchanges(mesh, CallConfig(timeout_ms=5000), calls)
  rng = np.random.default_rng(0)
  for _ in range(3):
    counts = jnp.asarray(rng.integers(0, 1000, (calls, R * R, E // R)).astype(np.int32))
    got, want = fn(counts)
    assert got.shape == (R, calls, R, R, E // R)
    np.testing.assert_array_equal(got, want)


def test_a_late_peer_fails_the_exchange_naming_the_counts_stage_then_the_next_call_works():
  mesh = mesh_of(R)
  late_rank, timeout_ms = 2, 300
  late = _exchanges(mesh, CallConfig(timeout_ms=timeout_ms, first_call_timeout_ms=0, delay_rank=late_rank,
                                      delay_us=2_000_000), 1)
  counts = jnp.arange(R * R * (E // R), dtype=jnp.int32).reshape(1, R * R, E // R)
  with pytest.raises(jax.errors.JaxRuntimeError) as err:
    jax.block_until_ready(late(counts))
  msg = str(err.value)
  assert "DEADLINE_EXCEEDED" in msg and "exchange_counts" in msg, msg
  assert f"timed out after {timeout_ms} ms" in msg and "stage counts" in msg, msg
  assert f"waiting for peer {late_rank}: observed " in msg, msg
  got, want = _exchanges(mesh, CallConfig(timeout_ms=5000), 1)(counts)
  np.testing.assert_array_equal(got, want)


def test_counts_larger_than_the_workspace_are_refused_then_the_next_call_works():
  mesh = mesh_of(R)
  # A workspace of exactly these sizes: Workspace.get hands back the mesh's cached one when it is large enough, and an
  # earlier test in this process may have left one with room for these counts.
  jmo.release_workspaces()
  ws = Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=64, recv_rows=64, ret_rows=64, num_segments=E))
  info = RankInfo(ws, CallConfig(timeout_ms=5000))
  fn = jax.jit(jax.shard_map(lambda c: exchange_counts(c, info)[None], mesh=mesh, in_specs=P("expert"),
                             out_specs=P("expert"), check_vma=False))
  # The error raised is some rank's: its own, or one that gave up naming the first rank's.
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"exchange_counts: counts_all \[4, 4, 4\] does not fit the workspace \(4 ranks, at most "
                           r"8 counts per rank\)|operands do not fit the workspace"):
    jax.block_until_ready(fn(jnp.ones((R * R, 2 * E // R), jnp.int32)))
  counts = jnp.arange(R * R * (E // R), dtype=jnp.int32).reshape(R * R, E // R)
  every = np.asarray(counts).reshape(R, R, E // R)  # [R_src, R_dst, E_local], the same on every rank
  np.testing.assert_array_equal(fn(counts), np.broadcast_to(every, (R, *every.shape)))


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_the_layer_gathers_the_counts_through_the_workspace_only_when_it_spans_processes(monkeypatch):
  checks.check_counts_through_the_workspace(mesh_of(R), monkeypatch, num_experts=E)
