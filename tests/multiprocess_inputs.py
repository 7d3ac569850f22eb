"""The global inputs of the multi-process layer runs (tests/multiprocess_main.py on CPU,
tests/gpu/multiprocess_gpu_main.py on CUDA): every process draws the same arrays from one seed and builds its shards
of the global arrays from them. Import after the script has configured jax."""

import os

import jax
import numpy as np
from jax.sharding import NamedSharding


def global_inputs(tokens: int, E: int, D: int, F: int, K: int):
  """x [T, D], expert ids [T, K] (distinct per token), gates [T, K] summing to 1, w1 [E, D, 2F], w2 [E, F, D]:
  float32 (ids int32), seed 0."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((tokens, D)).astype(np.float32)
  ids = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32)
  g = rng.random((tokens, K)).astype(np.float32) + 0.1
  w1 = (rng.standard_normal((E, D, 2 * F)) / np.sqrt(D)).astype(np.float32)
  w2 = (rng.standard_normal((E, F, D)) / np.sqrt(F)).astype(np.float32)
  return x, ids, g / g.sum(1, keepdims=True), w1, w2


def put(a, mesh, spec):
  """This process's shards of the global array ``a`` laid out as ``spec`` over ``mesh``."""
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


def save_or_compare(arrays: dict, pid: int, save: bool = True) -> None:
  """The bitwise check against a one-process run of the same mesh: with $JMO_OUT (the one-process run) saves
  ``arrays`` there when ``save``; with $JMO_ORACLE asserts every array equals the saved one bitwise and prints
  "process <pid>: bitwise"."""
  if os.environ.get("JMO_OUT") and save:
    np.savez(os.environ["JMO_OUT"], **arrays)
  if os.environ.get("JMO_ORACLE"):
    want = np.load(os.environ["JMO_ORACLE"])
    for name, a in arrays.items():
      assert a.tobytes() == want[name].tobytes(), f"{name} differs from the one-process run"
    print(f"process {pid}: bitwise", flush=True)
