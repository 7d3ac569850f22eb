"""The routing plan against a brute-force model written with Python loops."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax_moe_overlap import plan as plan_lib

from cases import routing


def brute_force(all_ids, num_experts, expert_cap):
  """all_ids: list over ranks of [T, k]. Returns per-rank dicts of what every field of the plan must be."""
  R = len(all_ids)
  E_l = num_experts // R
  T, k = all_ids[0].shape
  taken = [0] * num_experts
  kept = {}  # (s, p) -> bool, first come first served in (source rank, slot) order
  for s in range(R):
    for p in range(T * k):
      g = int(all_ids[s].reshape(-1)[p])
      kept[s, p] = taken[g] < expert_cap
      taken[g] += 1
  out = []
  # Send order: slots of rank s sorted stably by global expert id.
  send_pos = []
  for s in range(R):
    flat = all_ids[s].reshape(-1)
    order = sorted(range(T * k), key=lambda p: (int(flat[p]), p))
    pos = [0] * (T * k)
    for i, p in enumerate(order):
      pos[p] = i
    send_pos.append(pos)
  for r in range(R):
    # recv rows of rank r: segments (e, s), rows of s in s's send order.
    recv = []  # list of (s, p)
    seg_rows = np.zeros((E_l, R), np.int64)
    seg_ret_off = np.zeros((E_l, R), np.int64)
    for e in range(E_l):
      g = r * E_l + e
      for s in range(R):
        flat = all_ids[s].reshape(-1)
        slots = sorted([p for p in range(T * k) if flat[p] == g], key=lambda p: send_pos[s][p])
        seg_ret_off[e, s] = min([send_pos[s][p] for p in slots], default=sum(
            1 for p in range(T * k) if flat[p] < g))
        for p in slots:
          if kept[s, p]:
            recv.append((s, p))
            seg_rows[e, s] += 1
    out.append(dict(recv=recv, seg_rows=seg_rows, seg_ret_off=seg_ret_off))
  for r in range(R):
    flat = all_ids[r].reshape(-1)
    dest_rank = np.array([int(g) // E_l for g in flat])
    dest_row = np.full(T * k, -1)
    ret_row = np.full(T * k, -1)
    for p in range(T * k):
      if kept[r, p]:
        dest_row[p] = out[dest_rank[p]]["recv"].index((r, p))
        ret_row[p] = send_pos[r][p]
    order = [0] * (T * k)  # the slot at each send position
    for p in range(T * k):
      order[send_pos[r][p]] = p
    send_start = [sum(1 for g in flat if 0 <= int(g) and int(g) // E_l < d) for d in range(R + 1)]
    # Send once: a kept slot routed to another rank takes the row of its token's kept slot for that rank that is first
    # in the send order; every other slot names itself.
    primary = list(range(T * k))
    for p in range(T * k):
      if kept[r, p] and dest_rank[p] != r:
        t = p // k
        same = [q for q in range(t * k, t * k + k) if kept[r, q] and dest_rank[q] == dest_rank[p]]
        primary[p] = min(same, key=lambda q: send_pos[r][q])
    out[r].update(dest_rank=dest_rank, dest_row=dest_row, ret_row=ret_row, send_order=order, send_start=send_start,
                  primary=np.array(primary), dropped=sum(not kept[r, p] for p in range(T * k)))
  return out


_local_counts = jax.jit(plan_lib.local_counts, static_argnums=1)
_make_plan = jax.jit(plan_lib.make_plan, static_argnums=3)


# Every routing and capacity factor on four (R, k) shapes in the default pass (each R and each k among them; the first
# case of a shape compiles its eager operations); the other five shapes in the slow pass.
DEFAULT_PLAN_SHAPES = ((1, 3), (2, 2), (4, 1), (4, 3))


@pytest.mark.parametrize("cf,kind,k,R", [
    pytest.param(cf, kind, k, R, marks=() if (R, k) in DEFAULT_PLAN_SHAPES else pytest.mark.slow)
    for cf in (None, 1.0, 0.5) for kind in ("balanced", "skewed", "all_to_one", "empty_experts") for k in (1, 2, 3)
    for R in (1, 2, 4)])
def test_plan_matches_brute_force(R, k, kind, cf):
  E, T = 8, 12
  if kind == "empty_experts" and k > E // 2:
    pytest.skip("needs k <= E/2")
  all_ids = [routing(kind, T, E, k, seed=100 * R + 10 * k + s) for s in range(R)]
  cap_e = plan_lib.expert_capacity(T, R, k, E, cf)
  counts = np.stack([np.asarray(_local_counts(jnp.asarray(i), E)).reshape(R, E // R) for i in all_ids])
  want = brute_force(all_ids, E, cap_e)
  total_dropped = 0
  for r in range(R):
    got = _make_plan(jnp.asarray(all_ids[r]), jnp.asarray(counts), jnp.int32(r), cap_e)
    w = want[r]
    np.testing.assert_array_equal(got.slot_dest_rank, w["dest_rank"])
    np.testing.assert_array_equal(got.slot_dest_row, w["dest_row"])
    np.testing.assert_array_equal(got.slot_ret_row, w["ret_row"])
    np.testing.assert_array_equal(got.send_order, w["send_order"])
    np.testing.assert_array_equal(got.send_start, w["send_start"])
    np.testing.assert_array_equal(got.slot_primary, w["primary"])
    np.testing.assert_array_equal(got.seg_rows, w["seg_rows"])
    # A segment's ret offset matters only where it has rows.
    np.testing.assert_array_equal(np.where(w["seg_rows"] > 0, got.seg_ret_off, 0),
                                  np.where(w["seg_rows"] > 0, w["seg_ret_off"], 0))
    assert int(got.recv_rows) == len(w["recv"])
    assert int(got.ret_rows) == int(np.sum(w["ret_row"] >= 0))
    assert int(got.dropped) == w["dropped"]
    np.testing.assert_array_equal(got.expert_rows, w["seg_rows"].sum(axis=1))
    assert int(got.recv_rows) <= plan_lib.recv_capacity(T, R, k, E // R, cap_e)
    total_dropped += int(got.dropped)
  if cf is None:
    assert total_dropped == 0


@pytest.mark.parametrize("R,E,k,saved", [(2, 8, 2, 3 / 14), (4, 8, 2, 1 / 14), (8, 8, 2, 0.0), (8, 256, 8, 0.338)])
def test_send_once_saves_the_repeated_rows(R, E, k, saved):
  # Rows one rank sends to the others, one per slot against one per (token, destination) (slot_primary): uniform
  # routing saves (E_l - 1) / (E - 1) x (R - 1) / R of a token's remote rows at k = 2 per remote slot (3/14 = 21% at
  # R = 2, E = 8; 1/14 at R = 4; none at one expert per rank), and for DeepSeek-like top-8 of 256 at EP = 8,
  # 1 - P(a rank gets a choice) x 7 / 7 = 33.8% (docs/design.md, "Send once").
  T = 4096 if E == 8 else 1024
  rng = np.random.default_rng(R + E)
  all_ids = [np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32) for _ in range(R)]
  counts = np.stack([np.asarray(plan_lib.local_counts(jnp.asarray(i), E)).reshape(R, E // R) for i in all_ids])
  slots = once = 0
  for r in range(R):
    got = plan_lib.make_plan(jnp.asarray(all_ids[r]), jnp.asarray(counts), jnp.int32(r), T * R)
    remote = (np.asarray(got.slot_dest_rank) != r) & (np.asarray(got.slot_dest_row) >= 0)
    slots += int(remote.sum())
    once += int((remote & (np.asarray(got.slot_primary) == np.arange(T * k))).sum())
  assert abs((1 - once / slots) - saved) < 0.02, (once, slots)


def test_capacity_rule_drops_when_overloaded():
  # All tokens choose expert 0 with capacity factor 1: exactly T*R*k/E rows survive at expert 0.
  R, T, E, k = 2, 8, 4, 1
  ids = [np.zeros((T, k), np.int32) for _ in range(R)]
  cap_e = plan_lib.expert_capacity(T, R, k, E, 1.0)
  assert cap_e == 4
  counts = np.stack([np.asarray(plan_lib.local_counts(jnp.asarray(i), E)).reshape(R, E // R) for i in ids])
  p0 = plan_lib.make_plan(jnp.asarray(ids[0]), jnp.asarray(counts), jnp.int32(0), cap_e)
  p1 = plan_lib.make_plan(jnp.asarray(ids[1]), jnp.asarray(counts), jnp.int32(1), cap_e)
  assert int(p0.dropped) == T - 4 and int(p1.dropped) == T  # rank 0's tokens come first
  assert int(p0.recv_rows) == 4 and int(p1.recv_rows) == 0


def test_bad_capacity_factor():
  with pytest.raises(ValueError, match="capacity_factor"):
    plan_lib.expert_capacity(8, 2, 2, 4, 0.0)
