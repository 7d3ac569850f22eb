"""The resource manager and the per-call consumer options: on one GPU the loopback harness' manager/serialized cases
and a timing sweep whose device-side choices must equal the host model's on the same segment tables; through JAX on
every visible GPU (and on one) the options (identical results, a clear error for a pinned C past the SM budget).
Skips where there is no GPU.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import gpu_mesh, rank_counts, requires_gpu, run_loopback

pytestmark = requires_gpu

# Plausible constants (not a calibration): they only need to make the choice depend on the routed counts.
PARAMS = [132, 1, 64, 128, 0.05, 0.0005, 2.0, 300.0, 0.5]


def _run(args, timeout=300):
  return run_loopback(args, timeout=timeout)


def test_loopback_resource_suite():
  proc = _run(["--suite", "resource"])
  m = re.search(r"loopback: (\d+) of (\d+) cases passed", proc.stdout)
  assert proc.returncode == 0 and m and m.group(1) == m.group(2) and int(m.group(2)) >= 8, proc.stdout[-4000:]
  assert "serialized" in proc.stdout and "consumers=model" in proc.stdout


@pytest.mark.parametrize("ranks,routing", [(2, 1), (4, 0), (4, 2)])
def test_device_choice_equals_the_host_model(ranks, routing):
  from benchmarks import bench_resource  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import resource as rm  # pylint: disable=g-import-not-at-top
  # K, N multiples of 8 but not of 64: the mma.sync producer, which the model describes (64 x 128 tiles).
  proc = _run(["--ranks", ranks, "--experts", 4 * ranks, "--tokens", 1024, "--k-dim", 520, "--n-dim", 1032,
               "--routing", routing, "--iters", 1, "--datasets", 1, "--time", "--reps", 3, "--warmup", 1,
               "--consumers", 0, "--sweep-consumers", "1,4", "--model", ",".join(map(str, PARAMS)),
               "--decision-cost", 100])
  assert proc.returncode == 0, proc.stdout[-4000:]
  res = [json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  timed = [r for r in res if r["kind"] == "timed"]
  assert [(r["consumers"], r["serialize"]) for r in timed] == [(1, 0), (4, 0), (0, 0), (0, 1)]
  assert all(r["identical"] for r in timed)
  budget = timed[0]["budget"]
  p = dataclasses.replace(rm.ModelParams(*PARAMS), sms=budget, ctas_per_sm=1)
  plans = sorted((r for r in res if r["kind"] == "plan"), key=lambda r: r["rank"])
  grids = [[plan["seg_rows"][e * ranks:(e + 1) * ranks] for e in range(len(plan["seg_rows"]) // ranks)]
           for plan in plans]
  for i, pinned in ((0, 1), (1, 4), (2, 0)):  # pinned C = 1, C = 4, then the manager (0 where nothing is pushed)
    want = [bench_resource.kernel_consumer_ctas(p, g, plan["rank"], 1032, 520, 2, min(32, budget - 1), pinned)
            for g, plan in zip(grids, plans)]
    assert timed[i]["chosen"] == want, (i, plans, timed[i])
  dec = [r for r in res if r["kind"] == "decision"][0]
  assert dec["choice"] == timed[2]["chosen"][0] and 0 < dec["decision_ns"] < 100000


def test_copy_ceiling_mode():
  proc = _run(["--copy-ceiling", "1048576,67108864", "--reps", 5])
  res = [json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and len(res) == 2 and all(r["gbps"] > 10 for r in res), proc.stdout


@pytest.mark.parametrize("R", rank_counts(), ids=lambda r: f"R{r}")
def test_options_through_jax_give_identical_results(R):
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.config import CallConfig  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.workspace import Workspace  # pylint: disable=g-import-not-at-top
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  T, D, F, E, k = 512, 256, 384, 8, 2
  x = jax.random.normal(ks[0], (T, D)).astype(jnp.bfloat16)
  gates = jax.nn.softmax(jax.random.normal(ks[1], (T, k)), axis=-1)
  w1 = (jax.random.normal(ks[2], (E, D, 2 * F)) / 16).astype(jnp.bfloat16)
  w2 = (jax.random.normal(ks[3], (E, F, D)) / 20).astype(jnp.bfloat16)
  ids = jnp.stack([jax.random.permutation(jax.random.fold_in(ks[4], t), E)[:k] for t in range(T)]).astype(jnp.int32)
  mesh = gpu_mesh(R)  # at R > 1 the consumer pushes bands to the other GPUs: pinned or serialized, the same bits
  outs = []
  for cfg in (CallConfig(), CallConfig(serialize=True), CallConfig(consumer_ctas=2),
              CallConfig(consumer_ctas=24, serialize=True)):
    y, _ = jax.jit(lambda *a, c=cfg: jmo.moe_experts(*a, mesh=mesh, config=c))(x, ids, gates, w1, w2)
    outs.append(np.asarray(y.astype(jnp.float32)))
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])
  wss = [w for w in Workspace.cached() if w.platform == "gpu" and w.mesh == mesh]
  assert wss and all(w.device.sm_budget and ("resource model" in w.device.consumer_policy or
                                             "fixed" in w.device.consumer_policy)
                     for w in wss), [w.device for w in wss]
  print("consumer policy:", wss[0].device.consumer_policy)
  with pytest.raises(ValueError, match=r"leaves no producer CTA"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, config=CallConfig(consumer_ctas=wss[0].device.sm_budget))
