"""One process of a jax.distributed CUDA run on localhost (test_gpu_multiprocess.py starts them).

argv: process_id num_processes port placement case.
  placement "one_gpu": every process drives GPU 0 (local_device_ids=[0]): the ranks of the expert axis are processes
    sharing one GPU. "own_gpu": process i drives GPU i; "all_gpus": one process drives GPUs 0..n-1 (the oracle of a
    bitwise comparison, num_processes = 1, n = $JMO_GPUS).
Cases:
  equal: a 1-D expert mesh over every global device, impl="overlap", float32 and bfloat16: $JMO_CALLS calls of the
    layer's forward and backward (jax.vjp with a fixed cotangent) must be bitwise identical to each other and, per
    process, match the float32 reference (moe_experts_reference on this process's GPU, on the same rounded inputs,
    matmuls at "highest" precision) within 1e-2 relative, norm-wise; prints "process <i>: match". $JMO_OUT: saves
    this process's shards by rank (the oracle: one process holding every rank); $JMO_ORACLE: each process compares
    its shards bitwise with that file and prints "process <i>: bitwise". Then the processes release their
    workspaces together.
  fp8: as equal, with quantization="fp8" (bfloat16 only, D = F = 128) and GEMM2 with the way back (and in the
    backward dx = da W1^T with its way back) as expert_combine calls on e4m3 operands (call_site.FP8_FUSED_COMBINE_ON_GPU set here: the fused FP8 combine's kernel
    on CUDA, also where the library's default leaves it off); the reference is the FP8 recipe's oracle
    (impl="reference", quantization="fp8" on this process's GPU, whole experts) within 1e-2 relative; prints "fused
    combine" when the program holds that call.
  fp8_dispatch: as fp8, with D = 512 and the dispatches fused too (call_site.FP8_FUSED_DISPATCH_ON_GPU set here:
    x's packed rows dispatched and multiplied by GEMM1 in one dispatch_gemm call, dy's with dh = dy W2^T in another,
    dispatch_gemm's FP8 kernel); prints "fused dispatch" when the program holds those calls.
  scaled_dgrad: bfloat16, the layer's program twice: with the backward's dispatch of gates * dy fused with its dgrad
    GEMM as a [T k, D] array's rows, and with dispatch_gemm scaling dy's rows by the gates itself
    (expert_block.SCALE_IN_DISPATCH off, then on); both hold two dispatch_gemm calls, the second
    program one row_scale operand more; outputs and gradients bitwise the same (and matching the reference);
    prints "scaled dgrad bitwise".
  late_first_call: as equal, the last process sleeping $JMO_LATE_S seconds between compiling the step and its first
    call (as a process whose first batch comes later would): the others wait for it in the group's first call
    (CallConfig.first_call_timeout_ms, the bound the BeginKernel sets for epoch 1 on the device), though
    $JMO_TIMEOUT_MS is shorter.
  killed_between_calls: after one good call, the last process prints "losing rank <r> in process <p>" and kills
    itself (SIGKILL); the others then call again
    until a call fails (at most 3 calls) and print "failed after <seconds> s: <error>", then release the workspaces
    (bounded though the peer is dead) and print "released after <seconds> s".

No collective crosses the processes (NCCL refuses two processes on one GPU): the layer exchanges its routing counts
through the workspace, counts the dropped slots from them, and the test reads back only this process's shards.
"""

import os
import signal
import sys
import time

pid, nproc, port, placement, case = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                     sys.argv[5])
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
os.environ["JAX_PLATFORMS"] = "cuda"

import jax  # noqa: E402

if case == "killed_between_calls":
  jax.config.update("jax_enable_recoverability", True)
local_ids = {"one_gpu": [0], "own_gpu": [pid], "all_gpus": list(range(int(os.environ.get("JMO_GPUS", "2"))))}
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid,
                           local_device_ids=local_ids[placement], initialization_timeout=120)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402
from jax_moe_overlap.plan import expert_capacity  # noqa: E402
from jax_moe_overlap.reference import moe_experts_reference  # noqa: E402

# tests/gpu and tests/ come from PYTHONPATH (test_gpu_multiprocess.run_processes appends them).
from gpu_common import rel_err  # noqa: E402  pylint: disable=g-import-not-at-top
from multiprocess_inputs import global_inputs, put, save_or_compare  # noqa: E402  pylint: disable=g-import-not-at-top

QUANTIZATION = "fp8" if case in ("fp8", "fp8_dispatch") else None
E, K, TOKENS_PER_RANK = 4, 2, 32
D = F = 128 if QUANTIZATION else 64  # (FP8: whole 128-channel tiles)
if case == "fp8_dispatch":
  D = 512  # (dispatch_gemm's FP8 kernel: the packed rows' stride a multiple of 16 bytes)
TIMEOUT_MS = int(os.environ.get("JMO_TIMEOUT_MS", "10000"))
NAMES = ("y", "dx", "dgates", "dw1", "dw2")


def layer_inputs(tokens, dtype):
  """The global inputs (multiprocess_inputs.py) and a cotangent dy, x, w1, w2 and dy rounded to `dtype`."""
  x, ids, g, w1, w2 = global_inputs(tokens, E, D, F, K)
  dy = np.random.default_rng(1).standard_normal((tokens, D)).astype(np.float32)
  cast = lambda a: np.asarray(jnp.asarray(a, dtype))
  return cast(x), ids, g, cast(w1), cast(w2), cast(dy)


def local_shards(arrays, devices):
  """{name: [(rank, index, numpy data)]} of this process's shards, rank = the shard's device's place on the mesh."""
  order = list(devices.flat)
  return {n: sorted(((order.index(s.device), s.index, np.asarray(s.data)) for s in a.addressable_shards),
                    key=lambda t: t[0]) for n, a in zip(NAMES, arrays)}


def main():
  assert jax.process_count() == nproc, (jax.process_count(), nproc)
  devices = np.array(jax.devices())
  mesh = jax.sharding.Mesh(devices, ("expert",))
  R = devices.size
  tokens = TOKENS_PER_RANK * R
  config = jmo.CallConfig(timeout_ms=TIMEOUT_MS)
  tok, wsp = P("expert"), P("expert")
  results = {}
  if QUANTIZATION:
    from jax_moe_overlap import call_site  # pylint: disable=g-import-not-at-top
    call_site.FP8_FUSED_COMBINE_ON_GPU = True
    call_site.FP8_FUSED_DISPATCH_ON_GPU = case == "fp8_dispatch"
  if case == "scaled_dgrad":
    return scaled_dgrad(mesh, config, devices, R)
  for dtype in (jnp.bfloat16,) if QUANTIZATION else (jnp.float32, jnp.bfloat16):
    x, ids, g, w1, w2, dy = layer_inputs(tokens, dtype)
    args = [put(x, mesh, tok), put(g, mesh, tok), put(w1, mesh, wsp), put(w2, mesh, wsp), put(ids, mesh, tok),
            put(dy, mesh, tok)]

    def fwd_bwd(x, g, w1, w2, ids, dy):
      layer = lambda x, g, w1, w2: jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, impl="overlap", config=config,
                                                   quantization=QUANTIZATION)[0]
      y, vjp = jax.vjp(layer, x, g, w1, w2)
      return (y, *vjp(dy))

    step = jax.jit(fwd_bwd)
    hlo = step.lower(*args).as_text() if QUANTIZATION else ""
    if "@jmo_expert_combine(" in hlo:
      print(f"process {pid}: fused combine", flush=True)
    if hlo.count("@jmo_dispatch_gemm(") == 2:
      print(f"process {pid}: fused dispatch", flush=True)
    if case == "late_first_call":
      step = step.lower(*args).compile()
      if pid == nproc - 1 and not results:
        time.sleep(float(os.environ["JMO_LATE_S"]))
    first = jax.block_until_ready(step(*args))
    if case == "killed_between_calls":
      return lose_a_peer(step, args, devices)
    got = local_shards(first, devices)
    for call in range(1, int(os.environ.get("JMO_CALLS", "5"))):
      again = local_shards(jax.block_until_ready(step(*args)), devices)
      for n in NAMES:
        for (rank, _, a), (_, _, b) in zip(got[n], again[n]):
          assert a.tobytes() == b.tobytes(), f"{np.dtype(dtype).name} {n} rank {rank}: call {call} differs"
    check_reference(got, dtype, x, ids, g, w1, w2, dy, R)
    results.update({f"{np.dtype(dtype).name}_{n}_{rank}": a for n, shards in got.items() for rank, _, a in shards})
  for ws in jmo.workspace.Workspace.cached():
    print(f"shm {ws.shm_prefix}", flush=True)
  print(f"process {pid}: match (spans_processes={jmo.workspace.Workspace.cached()[0].spans_processes})", flush=True)
  save_or_compare(results, pid)
  # A shared workspace's release waits (bounded) for the peers' processes to close their mappings of this process's
  # blocks: release together.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  distributed.global_state.client.wait_at_barrier("test/release", 120_000)
  jmo.release_workspaces()


def scaled_dgrad(mesh, config, devices, R):
  from jax_moe_overlap import expert_block  # pylint: disable=g-import-not-at-top
  tok, wsp = P("expert"), P("expert")
  x, ids, g, w1, w2, dy = layer_inputs(TOKENS_PER_RANK * R, jnp.bfloat16)
  args = [put(x, mesh, tok), put(g, mesh, tok), put(w1, mesh, wsp), put(w2, mesh, wsp), put(ids, mesh, tok),
          put(dy, mesh, tok)]
  got, unscaled = {}, {}
  for scaled in (False, True):
    expert_block.SCALE_IN_DISPATCH = scaled
    jmo.api._programs.clear()  # pylint: disable=protected-access  (traced anew: the switch is read when tracing)

    def fwd_bwd(x, g, w1, w2, ids, dy):  # (a new function each time: jax.jit's trace cache keys on it)
      layer = lambda x, g, w1, w2: jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, impl="overlap", config=config)[0]
      y, vjp = jax.vjp(layer, x, g, w1, w2)
      return (y, *vjp(dy))

    step = jax.jit(fwd_bwd)
    calls = [l for l in step.lower(*args).as_text().splitlines() if "@jmo_dispatch_gemm(" in l]
    assert len(calls) == 2, f"{len(calls)} dispatch_gemm calls (scaled={scaled})"
    unscaled[scaled] = sum(l.count("tensor<0xf32>") for l in calls)
    got[scaled] = local_shards(jax.block_until_ready(step(*args)), devices)
  assert unscaled[True] == unscaled[False] - 1, unscaled  # the scaled program's row_scale operand holds the gates
  for n in NAMES:
    for (rank, _, a), (_, _, b) in zip(got[False][n], got[True][n]):
      assert a.tobytes() == b.tobytes(), f"{n} rank {rank}: the scaling dispatch_gemm differs from the array's rows"
  check_reference(got[True], jnp.bfloat16, x, ids, g, w1, w2, dy, R)
  print(f"process {pid}: scaled dgrad bitwise", flush=True)
  for ws in jmo.workspace.Workspace.cached():
    print(f"shm {ws.shm_prefix}", flush=True)
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  distributed.global_state.client.wait_at_barrier("test/release", 120_000)
  jmo.release_workspaces()


def check_reference(got, dtype, x, ids, g, w1, w2, dy, R):
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  cap_e = expert_capacity(TOKENS_PER_RANK, R, K, E, None)
  with jax.default_device(jax.local_devices()[0]), jax.default_matmul_precision("highest"):
    if QUANTIZATION:  # the recipe's oracle on this process's GPU: x and dy in the layer's dtype, as the layer had them
      one = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("expert",))
      ref = lambda x, g, w1, w2: jmo.moe_experts(x, jnp.asarray(ids), g, w1, w2, mesh=one, impl="reference",
                                                 quantization=QUANTIZATION)[0]
      y_ref, vjp = jax.vjp(ref, jnp.asarray(x), f32(g), f32(w1), f32(w2))
      want = dict(zip(NAMES, [np.asarray(f32(a)) for a in (y_ref, *vjp(jnp.asarray(dy)))]))
    else:
      ref = lambda x, g, w1, w2: moe_experts_reference(x, jnp.asarray(ids), g, w1, w2, cap_e, R)[0]
      y_ref, vjp = jax.vjp(ref, f32(x), f32(g), f32(w1), f32(w2))
      want = dict(zip(NAMES, [np.asarray(a) for a in (y_ref, *vjp(f32(dy)))]))
  for n in NAMES:
    for rank, index, a in got[n]:
      err = rel_err(np.asarray(a, np.float32), want[n][index])
      assert err < 1e-2, f"{np.dtype(dtype).name} {n} rank {rank}: relative error {err:.2e} vs the reference"


def lose_a_peer(step, args, devices):
  # The last process is lost, never process 0: it hosts the distributed runtime's coordination service, without
  # which the others' runtime clients terminate their processes. Its rank: where jax put its device on the mesh.
  lost = nproc - 1
  rank = next(i for i, d in enumerate(devices.flat) if d.process_index == lost)
  print(f"losing rank {rank} in process {lost}", flush=True)
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  distributed.global_state.client.wait_at_barrier("test/lose_a_peer", 60_000)
  if pid == lost:
    os.kill(os.getpid(), signal.SIGKILL)
  time.sleep(1.0)  # the kill lands before this process's next call: the peer is lost between calls
  start = time.monotonic()
  for _ in range(3):
    try:
      jax.block_until_ready(step(*args))
    except Exception as e:  # pylint: disable=broad-except
      print(f"failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
      break
  else:
    print("no failure", flush=True)
  print(f"shm {jmo.workspace.Workspace.cached()[0].shm_prefix}", flush=True)
  start = time.monotonic()
  jmo.release_workspaces()
  print(f"released after {time.monotonic() - start:.1f} s", flush=True)
  # The distributed runtime's shutdown with a dead task is not what this test is about: leave at once.
  sys.stdout.flush()
  os._exit(0)


if __name__ == "__main__":
  main()
  jax.distributed.shutdown()
