"""One process of a jax.distributed CPU run (test_multiprocess.py starts several on localhost).

argv: process_id num_processes port local_devices case; $JMO_IMPL: the layer's impl (default "overlap"). Cases:
  data_across: mesh (data = processes, expert = local devices), tokens over both (batch_axes=("data",)); prints
    "match" when the output and gradients of the last of $JMO_CALLS consecutive calls (default 3) equal a
    single-process float32 oracle on the same global inputs.
  expert_across: the expert axis spans every device of every process (a shared-memory workspace); runs $JMO_CALLS
    calls, saves the last one's output and gradients to $JMO_OUT (process 0) or compares them bitwise with
    $JMO_ORACLE (the same case run as one process holding every device), and prints "bitwise" when equal, after
    checking them against the float32 oracle too. It prints the workspace's shared-memory name prefix ("shm <prefix>").
  killed_peer: expert_across; in the second call the last rank is held back 6 s at the start of its workspace calls
    (the first is the exchange of the routing counts) and its process kills itself (SIGKILL) 2 s into it; the others
    print "failed after <seconds> s: <error>" for that call and exit normally (jax_enable_recoverability lets the
    distributed runtime's shutdown survive a dead task).
  killed_between_calls: the last process kills itself (SIGKILL) between two calls; the others' next call fails in
    the layer's first workspace call, the exchange of the routing counts, reported the same way.
  stopped_between_calls: as killed_between_calls, but the last process stops itself (SIGSTOP): a hung peer, which
    the test kills once the others have exited.
  fp8_across: expert_across with quantization="fp8" (D = F = 128) and CallConfig(dispatch_pushers=2): the FP8 layer's
    packed rows dispatched and multiplied in one call (dispatch_gemm_fp8, forward and backward) and its fused
    returns (expert_combine on e4m3 operands) across the processes; against the float32 oracle within the recipe's
    error bound (2^-3 relative, norm-wise) instead of 1e-5. fp8_across_unfused: the same with the dispatches unfused
    (the packed rows moved by dispatch calls, GEMM1 and dh after them).
  tensor_across: expert_across on a mesh (expert = 2, tensor = the devices / 2) with tensor_axis="tensor": the
    workspace's group is every device of both axes (expert tensor parallelism), spanning the processes.
  late_first_call: expert_across, the last process sleeping $JMO_LATE_S seconds between compiling the step and its
    first call (as a process whose first batch comes later would): the others wait for it in the group's first call
    (CallConfig.first_call_timeout_ms), though $JMO_TIMEOUT_MS is shorter; prints "match".
  different_hosts: expert_across, but the last process reports another host name: the layer (impl="overlap", the
    default) runs as impl="collective" with no workspace ("no workspace"), matches the float32 oracle ("match"), and
    creating a workspace over the mesh is refused before anything is allocated ("refused: <error>").
"""

import functools
import os
import signal
import socket
import threading
import sys
import time

pid, nproc, port, local, case = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
from cpu_flags import set_cpu_flags  # noqa: E402  (tests/)

set_cpu_flags(local)

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
LOST_PEER_CASES = ("killed_peer", "killed_between_calls", "stopped_between_calls")
if case in LOST_PEER_CASES:
  jax.config.update("jax_enable_recoverability", True)
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=120)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402
from jax_moe_overlap.plan import expert_capacity  # noqa: E402
from jax_moe_overlap.reference import moe_experts_reference  # noqa: E402
from multiprocess_inputs import global_inputs, put, save_or_compare  # noqa: E402  (tests/)

QUANTIZATION = "fp8" if case in ("fp8_across", "fp8_across_unfused") else None
E, K = 8, 2
D, F = (128, 128) if QUANTIZATION else (16, 24)  # (FP8: whole 128-channel tiles)


def main():
  assert jax.process_count() == nproc and jax.local_device_count() == local
  devices = np.array(jax.devices())
  batch_axes, tensor_axis = (), None
  if case == "data_across":
    mesh = jax.sharding.Mesh(devices.reshape(nproc, local), ("data", "expert"))
    batch_axes = ("data",)
  elif case == "tensor_across":
    mesh = jax.sharding.Mesh(devices.reshape(2, devices.size // 2), ("expert", "tensor"))
    tensor_axis = "tensor"
  else:
    mesh = jax.sharding.Mesh(devices, ("expert",))
  tokens = 16 * devices.size
  x, ids, g, w1, w2 = global_inputs(tokens, E, D, F, K)
  if tensor_axis:  # w1 as its [E, D, 2, F] view, F over the tensor axis (so is w2's)
    tok, w1_spec, w2_spec = P(("expert", "tensor")), P("expert", None, None, "tensor"), P("expert", "tensor")
    w1_in = w1.reshape(E, D, 2, F)
  else:
    tok, w1_spec, w2_spec, w1_in = P((*batch_axes, "expert")), P("expert"), P("expert"), w1
  args = [put(x, mesh, tok), put(ids, mesh, tok), put(g, mesh, tok), put(w1_in, mesh, w1_spec),
          put(w2, mesh, w2_spec)]

  # fp8_across pins the fused dispatches (dispatch_gemm_fp8, forward and backward), which CPUs take only pinned.
  default = jmo.CallConfig(dispatch_pushers=2) if case == "fp8_across" else jmo.CallConfig()

  def loss(x, g, w1, w2, ids, config=default):
    y, dropped = jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, batch_axes=batch_axes, config=config,
                                 impl=os.environ.get("JMO_IMPL", "overlap"), tensor_axis=tensor_axis,
                                 quantization=QUANTIZATION)
    return jnp.sum(jnp.sin(y)), (y, dropped)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  if case == "different_hosts" and pid == nproc - 1:
    socket.gethostname = lambda: "another-host"
  if case == "late_first_call":
    step = step.lower(args[0], args[2], args[3], args[4], args[1]).compile()
    if pid == nproc - 1:
      time.sleep(float(os.environ["JMO_LATE_S"]))
  (_, (y, dropped)), grads = jax.block_until_ready(step(args[0], args[2], args[3], args[4], args[1]))
  for ws in jmo.workspace.Workspace.cached():
    print(f"shm {ws.shm_prefix}", flush=True)
  if case in LOST_PEER_CASES:
    held = jmo.CallConfig(delay_rank=mesh.size - 1, delay_us=6_000_000)
    if case == "killed_peer":
      step = jax.jit(jax.value_and_grad(functools.partial(loss, config=held), argnums=(0, 1, 2, 3),
                                        has_aux=True)).lower(args[0], args[2], args[3], args[4], args[1]).compile()
    # Every process gets here before any dispatches the call: the kill lands inside the held call (killed_peer), or
    # before the others' call starts (between calls).
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    distributed.global_state.client.wait_at_barrier("test/held_call", 60_000)
    if pid == nproc - 1:
      sig = signal.SIGSTOP if case == "stopped_between_calls" else signal.SIGKILL
      threading.Timer(2.0 if case == "killed_peer" else 0.0, os.kill, (os.getpid(), sig)).start()
      if case != "killed_peer":
        time.sleep(60)
    start = time.monotonic()
    try:
      jax.block_until_ready(step(args[0], args[2], args[3], args[4], args[1]))
    except Exception as e:  # pylint: disable=broad-except
      print(f"failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
    else:
      print("no failure", flush=True)
    return
  # Each call finishes before the next is dispatched: with two CPU devices per process, XLA:CPU's gloo collectives
  # of many programs in flight at once can deadlock, the layer or not (a plain shard_map with an all_gather and a
  # psum hangs the same way at 100 unblocked calls under JAX 0.11.2; blocked, it runs).
  for _ in range(int(os.environ.get("JMO_CALLS", "3")) - 1):
    (_, (y, dropped)), grads = jax.block_until_ready(step(args[0], args[2], args[3], args[4], args[1]))
  y, grads = multihost_utils.process_allgather((y, grads), tiled=True)
  if case in ("expert_across", "tensor_across", "fp8_across", "fp8_across_unfused"):
    got = dict(y=np.asarray(y), **{f"d{n}": np.asarray(a) for n, a in zip(("x", "gates", "w1", "w2"), grads)})
    save_or_compare(got, pid, save=pid == 0)

  R = mesh.shape["expert"] * (mesh.shape[tensor_axis] if tensor_axis else 1)  # the ranks of one group
  groups = mesh.size // R
  t = tokens // groups
  cap_e = expert_capacity(t // R, R, K, E, None)

  def ref_loss(x, g, w1, w2):
    ys = [moe_experts_reference(x[b * t:(b + 1) * t], jnp.asarray(ids[b * t:(b + 1) * t]), g[b * t:(b + 1) * t], w1,
                                w2, cap_e, R)[0] for b in range(groups)]
    y = jnp.concatenate(ys)
    return jnp.sum(jnp.sin(y)), y

  local_dev = jax.local_devices()[0]
  with jax.default_device(local_dev):
    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True))(x, g, w1, w2)
  assert int(dropped) == 0
  if QUANTIZATION:  # the recipe's error, norm-wise (tests/test_fp8_layer.py's bound)
    for name, a, b in zip(("y", "x", "gates", "w1", "w2"), (y, *grads), (y_ref, *grads_ref)):
      a, b = np.asarray(a, np.float64).reshape(b.shape), np.asarray(b, np.float64)
      err = np.linalg.norm(a - b) / np.linalg.norm(b)
      assert err < 2.0 ** -3, f"{name}: relative error {err:.3f} vs the float32 oracle"
  else:
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("x", "gates", "w1", "w2"), grads, grads_ref):
      np.testing.assert_allclose(np.asarray(a).reshape(b.shape), b, rtol=1e-4, atol=1e-5, err_msg=name)
  print(f"process {pid}: match", flush=True)
  if case == "different_hosts":
    if not jmo.workspace.Workspace.cached():
      print(f"process {pid}: no workspace", flush=True)
    try:
      jmo.workspace.Workspace.get(mesh, "expert", jmo.workspace.layer_sizes(t // R, R, K, E, D, 4, None))
    except NotImplementedError as e:
      print(f"refused: {e}", flush=True)


def leave_after_a_dead_peer():
  """With a dead or stopped task, the runtime's shutdown has no barrier (jax_enable_recoverability), and a task whose
  ShutdownTask RPC finds the leader (process 0, which hosts the coordination service) already gone is terminated
  (LOG(FATAL) in JAX's client, SIGABRT). So the leader leaves last: the others say they are leaving through the
  key-value store, and the leader waits (bounded) for them, then a moment for their RPCs."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if pid != 0:
    client.key_value_set(f"test/leaving/{pid}", "1")
  else:
    deadline = time.monotonic() + 20
    for p in range(1, nproc - 1):  # the last process is the lost one (dead or stopped)
      while time.monotonic() < deadline:
        try:
          client.key_value_try_get(f"test/leaving/{p}")
          break
        except Exception:  # pylint: disable=broad-except
          time.sleep(0.05)
    time.sleep(2)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
  if case in LOST_PEER_CASES:
    leave_after_a_dead_peer()
  else:
    jax.distributed.shutdown()
