"""The training example's gradients computed several times on one batch from the same parameters, in one process: per
parameter, whether every repeat gave the same bits, and a digest of the first repeat's that another process's run
compares with (--out writes them, --against reads them). It tells nondeterminism inside a process (atomics, races)
from that between processes (such as XLA's autotuning picking another GEMM algorithm in each), and names the
parameters it reaches.

  python3 -m benchmarks.step_repeat --out /tmp/a.json -- --preset gpu --quantization fp8
  python3 -m benchmarks.step_repeat --against /tmp/a.json -- --preset gpu --quantization fp8
  XLA_FLAGS=--xla_gpu_deterministic_ops=true python3 -m benchmarks.step_repeat ...   (XLA's deterministic mode)

The arguments after -- are examples/train_moe.py's (model, batch, seed, data); the batch is its first step's.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys

from benchmarks import EXAMPLES  # pylint: disable=g-import-not-at-top  (os alone: jax is not imported yet)

sys.path.insert(0, EXAMPLES)

import train_moe  # pylint: disable=g-import-not-at-top,wrong-import-position  (sets the CPU device count first)
import model as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # pylint: disable=g-import-not-at-top,wrong-import-position


def digest(a: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def first_difference(a: np.ndarray, b: np.ndarray) -> str:
  """Where and by how much two arrays of one shape differ: the count of differing values and the largest relative
  difference among them."""
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  differ = a64 != b64
  rel = np.abs(a64 - b64)[differ] / np.maximum(np.abs(a64[differ]), 1e-30)
  return f"{int(differ.sum())} of {a64.size} values differ, max rel {rel.max():.1e}"


def repeat_differences(runs: list[dict[str, np.ndarray]]) -> dict[str, str]:
  """{name: how it differs} for each array of ``repeat_gradients``' runs whose bits are not the same in every run
  (first_difference against the first run, at the first run that differs); empty where every array repeats."""
  within = {}
  for n, first in runs[0].items():
    other = next((r[n] for r in runs[1:] if r[n].tobytes() != first.tobytes()), None)
    if other is not None:
      within[n] = first_difference(first, other)
  return within


def repeat_gradients(train_args: list[str], repeats: int) -> list[dict[str, np.ndarray]]:
  """The loss and the gradients of train_moe's first batch, `repeats` times from one set of parameters, each as
  {name: array} in the parameters' order."""
  targs = train_moe.parse_args(train_args)
  mesh = model_lib.make_mesh(targs.devices, targs.mesh_axis_type, targs.mesh)
  cfg = train_moe.model_config(targs)
  attention, _ = model_lib.choose_attention(cfg, mesh, targs.batch_size // targs.grad_accum, targs.attention)
  cfg = dataclasses.replace(cfg, attention=attention)
  train_text, _ = model_lib.load_text(targs.data)
  loss_weights = (targs.lb_weight, targs.z_weight)
  with jax.set_mesh(mesh):
    model = model_lib.create_model(cfg, mesh, targs.seed)
    batch = model_lib.put_global(model_lib.train_batch(train_text, 0, targs.seed, targs.batch_size, targs.seq_len),
                                 model_lib.batch_sharding(mesh))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def loss_and_grads(params, rest, tokens):
      grads, metrics = train_moe.loss_and_grads(nnx.merge(graphdef, params, rest), tokens, loss_weights)
      return metrics["loss"], grads

    runs = []
    for _ in range(repeats):
      loss, grads = jax.device_get(loss_and_grads(params, rest, batch))
      leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
      runs.append({"loss": np.asarray(loss), **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}})
  return runs


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--repeats", type=int, default=3, help="gradient computations in this process (at least 2)")
  ap.add_argument("--out", default=None, help="write the first repeat's digests here (JSON)")
  ap.add_argument("--against", default=None, help="compare the digests with those another run wrote")
  args = ap.parse_args(own)
  if args.repeats < 2:
    raise SystemExit(f"--repeats {args.repeats}: at least 2")
  other = None
  if args.against:
    with open(args.against, encoding="utf-8") as f:
      other = json.load(f)
  runs = repeat_gradients(train_args, args.repeats)
  names = list(runs[0])
  within = repeat_differences(runs)
  digests = {n: digest(runs[0][n]) for n in names}
  between = [n for n in names if other is not None and other.get(n) != digests[n]]
  for n in names:
    if n in within or n in between:
      print(f"  {n} {runs[0][n].dtype}{list(runs[0][n].shape)}: "
            + "; ".join(([f"repeats differ ({within[n]})"] if n in within else [])
                        + (["differs from --against"] if n in between else [])))
  print(f"step_repeat: {len(names) - len(within)} of {len(names)} arrays (the loss and each gradient) the same bits "
        f"in all {args.repeats} repeats" + (f"; {len(names) - len(between)} of {len(names)} the same as "
                                              f"{args.against}" if other is not None else ""), flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(digests, f, indent=0)
  return {"within": within, "between": between, "digests": digests}


if __name__ == "__main__":
  main()
