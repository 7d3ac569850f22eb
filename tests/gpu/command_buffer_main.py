"""One process of a CUDA-graph check (test_gpu_command_buffers.py starts it through gpu_common.run_processes).

argv: process_id num_processes port placement case, as multiprocess_gpu_main.py takes them ("one_gpu": every process
drives GPU 0; "all_gpus" with num_processes 1 and $JMO_GPUS=1: one process on GPU 0). The parent sets XLA_FLAGS
(command buffers on or off: benchmarks/decode_step.GRAPH_FLAGS) and:
  JMO_OUT     where "steps" saves this process's output shards of every step (npz, step<i>_rank<r>, their bits);
              "{pid}" in it becomes the process id
  JMO_STEPS   steps of the "steps" case (default 100)
  JMO_TIMEOUT_MS  the calls' wait bound (default 10000; the "timeout" case's delay is three of them)
Cases:
  steps        the decode step (benchmarks/decode_step.py: 3 layers, d_model 256, bf16, 8 tokens per rank), each
               step's output the next one's input, $JMO_STEPS steps after a first one; prints the host runs of the
               CUDA handlers during those steps ("handler calls: {...}" JSON: target -> [runs, of which captured]),
               and with one process the relative error of the first layer's experts against the float32 reference
               ("reference: relative error ...").
  bad_input    (one process) two layers of moe_experts fed expert ids: 5 calls with valid ids, then one with an id out
               of range, then two valid ones; prints how each ended ("bad call: returned" or "bad call: failed after
               <s> s: <error>", "next call: ...", "third call: ..."), the recorded failures ("recorded: ...") and the
               handler runs. Outside a graph the failure is reported by the next workspace call, which may be the
               bad call's own second layer.
  aborted_at_record  (one process, graphs on) an executable with command buffers on is run twice (its first run is
               XLA's, outside the graph; the second replays it); one layer compiled with command buffers off makes the
               bad call (its failure is left for the next call), then the first executable runs on inputs at new
               addresses, so XLA traces its calls again while the group is aborted ("graph call: ..." with the runs
               captured during it), then two calls of the one-layer executable ("off call 1/2: ...").
  timeout      (two processes) 5 steps, then process 1 stops calling while process 0 runs the step again: rank 0's
               wait for its peer expires inside the replayed graph ("stalled call: ..."), and the recorded failures;
               then both meet at a barrier.
Failure cases end with os._exit(0): after a call inside a CUDA graph stopped the device, the process's CUDA context
is unusable and the runtime's teardown is not what they check.
"""

import json
import os
import sys
import time

pid, nproc, port, placement, case = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                     sys.argv[5])
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
os.environ["JAX_PLATFORMS"] = "cuda"

import jax  # noqa: E402

local_ids = {"one_gpu": [0], "all_gpus": list(range(int(os.environ.get("JMO_GPUS", "1"))))}
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid,
                           local_device_ids=local_ids[placement], initialization_timeout=120)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402
from benchmarks import decode_step as ds  # noqa: E402  (the repository root is on PYTHONPATH)
from gpu_common import rel_err  # noqa: E402  pylint: disable=g-import-not-at-top
from jax_moe_overlap.command_buffers import handler_calls  # noqa: E402

MODEL = ds.DecodeModel(layers=3, d_model=256, d_ff=256, experts=8, top_k=2)
TOKENS_PER_RANK = 8
TIMEOUT_MS = int(os.environ.get("JMO_TIMEOUT_MS", "10000"))


def say(*a):
  print(*a, flush=True)


def calls_since(before):
  now = handler_calls()
  return {t: [now[t][0] - before[t][0], now[t][1] - before[t][1]] for t in now}


def local(x, devices) -> dict:
  """{rank: numpy} of this process's shards of x, rank = the shard's device's place on the mesh."""
  order = list(devices.flat)
  return {order.index(s.device): np.asarray(s.data) for s in x.addressable_shards}


def bits(a):
  """a's bits as unsigned integers of its width (what np.savez keeps whatever the dtype)."""
  return a.view(f"u{a.dtype.itemsize}")


def outcome(what, fn):
  """Runs fn() to completion; prints "<what>: returned" or "<what>: failed after <s> s: <first line of the error>"."""
  t0 = time.monotonic()
  try:
    jax.block_until_ready(fn())
    say(f"{what}: returned")
    return True
  except Exception as e:  # pylint: disable=broad-except
    say(f"{what}: failed after {time.monotonic() - t0:.1f} s: {str(e).splitlines()[0] if str(e) else type(e)}")
    say(f"{what}: error text: {' '.join(str(e).split())[:1500]}")
    return False


def print_recorded():
  for text in jmo.recorded_failures():
    say(f"recorded: {text}")


def setup():
  devices = np.array(jax.devices())
  mesh = jax.sharding.Mesh(devices, (ds.AXIS,))
  params = ds.init_params(MODEL, mesh)
  x0 = ds.first_tokens(MODEL, TOKENS_PER_RANK * devices.size, mesh)
  return devices, mesh, params, x0


def steps_case():
  devices, mesh, params, x0 = setup()
  step = ds.make_step(MODEL, mesh, config=jmo.CallConfig(timeout_ms=TIMEOUT_MS))
  x = jax.block_until_ready(step(params, x0))  # compiles, and records where command buffers are on
  n = int(os.environ.get("JMO_STEPS", "100"))
  before = handler_calls()
  outs, finite = {}, True
  for i in range(n):
    x = step(params, x)
    for rank, a in local(x, devices).items():  # reading each step back frees its buffers, as a decoding loop does
      finite = finite and bool(np.isfinite(a.astype(np.float32)).all())
      outs[f"step{i}_rank{rank}"] = bits(a)
  say(f"steps: {n}")
  say(f"handler calls: {json.dumps(calls_since(before))}")
  say(f"finite outputs: {finite}")
  np.savez(os.environ["JMO_OUT"].format(pid=pid), **outs)
  if nproc == 1:
    check_reference(mesh, params, x0)
  if nproc > 1:
    # A shared workspace's release waits (bounded) for the peers to close their mappings: release together.
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    distributed.global_state.client.wait_at_barrier("test/release", 120_000)
  jmo.release_workspaces()
  say(f"process {pid}: done")


def check_reference(mesh, params, x0):
  """The first layer's experts, bfloat16 overlap vs float32 reference on the same (bf16-rounded) values."""
  p = params[0]
  y = jax.jit(lambda x, p: ds.moe(x, p, MODEL, mesh))(x0, p)
  f32 = {k: v.astype(jnp.float32) for k, v in p.items()}
  with jax.default_matmul_precision("highest"):
    y_ref = jax.jit(lambda x, p: ds.moe(x, p, MODEL, mesh, impl="reference"))(x0.astype(jnp.float32), f32)
  say(f"reference: relative error {rel_err(np.asarray(y, np.float32), np.asarray(y_ref)):.3e}")


def two_layers(mesh, layers=2, **jit_options):
  """jit of (x, ids, gates, params) -> `layers` moe_experts layers on the same routing (ids given, not routed)."""

  def f(x, ids, gates, params):
    for p in params[:layers]:
      y, _ = jmo.moe_experts(x, ids, gates, p["w1"], p["w2"], mesh=mesh, config=jmo.CallConfig(timeout_ms=TIMEOUT_MS))
      x = ds.rms_norm(x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
    return x

  return jax.jit(f, **jit_options)


def routed(x0, params):
  ids, gates = jax.jit(lambda x, r: ds.route(x, r, MODEL.top_k))(x0, params[0]["router"])
  bad = ids.at[0, 0].set(MODEL.experts)  # an expert id out of range: found by the kernels
  return ids, bad, gates


def bad_input_case():
  _, mesh, params, x0 = setup()
  f = two_layers(mesh)
  ids, bad, gates = routed(x0, params)
  before = handler_calls()
  for i in range(5):
    outcome(f"good call {i}", lambda: f(x0, ids, gates, params))
  outcome("bad call", lambda: f(x0, bad, gates, params))
  print_recorded()
  outcome("next call", lambda: f(x0, ids, gates, params))
  outcome("third call", lambda: f(x0, ids, gates, params))
  say(f"handler calls: {json.dumps(calls_since(before))}")
  os._exit(0)


def aborted_at_record_case():
  _, mesh, params, x0 = setup()
  ids, bad, gates = routed(x0, params)
  # Command buffers off for this executable alone (an empty list of command kinds).
  off = two_layers(mesh, layers=1, compiler_options={"xla_gpu_enable_command_buffer": ""})
  on = two_layers(mesh)
  outcome("on warm-up 1", lambda: on(x0, ids, gates, params))
  outcome("on warm-up 2", lambda: on(x0, ids, gates, params))
  outcome("off bad call", lambda: off(x0, bad, gates, params))
  x1 = jax.block_until_ready(x0 + 0)  # buffers at other addresses: XLA traces the graph's calls again
  before = handler_calls()
  outcome("graph call", lambda: on(x1, ids, gates, params))
  say(f"graph call handler calls: {json.dumps(calls_since(before))}")
  outcome("off call 1", lambda: off(x0, ids, gates, params))
  outcome("off call 2", lambda: off(x0, ids, gates, params))
  os._exit(0)


def timeout_case():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  _, mesh, params, x0 = setup()
  good = ds.make_step(MODEL, mesh, config=jmo.CallConfig(timeout_ms=TIMEOUT_MS))
  x = x0
  for _ in range(5):
    x = jax.block_until_ready(good(params, x))
  say("good steps: returned")
  client = distributed.global_state.client
  client.wait_at_barrier("test/good", 60_000)
  if pid == 0:
    outcome("stalled call", lambda: good(params, x))
    print_recorded()
  client.wait_at_barrier("test/stalled", 120_000)
  os._exit(0)


if __name__ == "__main__":
  {"steps": steps_case, "bad_input": bad_input_case, "aborted_at_record": aborted_at_record_case,
   "timeout": timeout_case}[case]()
  jax.distributed.shutdown()
