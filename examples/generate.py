"""Generate text from a checkpoint of train_moe.py, through the same expert-parallel MoE layers.

  python examples/generate.py --ckpt-dir /tmp/moe --prompt "The licensee" --max-new-tokens 200
  python examples/generate.py --ckpt-dir /tmp/moe --temperature 0.8 --num-samples 4 --seed 1

Greedy decoding by default (--temperature 0); with --temperature T > 0 it samples from softmax(logits / T),
optionally restricted to the --top-p nucleus. Each new byte runs the model on the last seq_len bytes (no KV cache:
this is a demonstration of the layer, not a serving stack). The MoE layers run dropless here by default, so that
the padding after the text cannot take expert capacity from real tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

import model as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position


def parse_args(argv=None):
  # Flags by their full names only, like train_moe.py's.
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=model_lib.HelpFormatter,
                              allow_abbrev=False)
  p.add_argument("--ckpt-dir", required=True, help="checkpoint directory written by train_moe.py")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--prompt", default="This License ")
  p.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate")
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample at this temperature")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature > 0)")
  p.add_argument("--num-samples", type=int, default=1, help="independent continuations, generated as one batch")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--impl", choices=("overlap", "collective", "xla", "reference"), default=None,
                 help="MoE implementation (default: the one the checkpoint was trained with)")
  p.add_argument("--capacity-factor", type=float, default=0.0,
                 help="expert capacity factor at inference (0: dropless)")
  p.add_argument("--devices", type=int, default=None, help="use only the first N local devices (default: all)")
  p.add_argument("--mesh-axis-type", choices=("auto", "explicit"), default="auto")
  p.add_argument("--mesh", default=None,
                 help="mesh axes and sizes as train_moe.py takes them; a checkpoint trained with a 'tensor' axis "
                      "(its w1 kept as [E, D, 2, F]) restores onto a mesh with one (default: one 'expert' axis)")
  return p.parse_args(argv)


def checkpoint_config(ckpt_dir, step, mesh, impl=None, capacity_factor=None):
  """(config, step) of a train_moe.py checkpoint as it runs here on ``mesh``, checked against the mesh
  (``ModelConfig.check``): FileNotFoundError or ValueError (the library's TypeError or NotImplementedError) naming
  what does not fit."""
  step, meta = model_lib.read_meta(ckpt_dir, step)
  model_lib.check_checkpoint_mesh(meta, mesh, ckpt_dir)
  cfg = model_lib.ModelConfig.from_json(meta["config"])
  cfg = dataclasses.replace(cfg, impl=impl or cfg.impl, capacity_factor=capacity_factor or None)
  cfg.check(mesh)
  return dataclasses.replace(cfg, attention=model_lib.choose_attention(cfg, mesh, mesh.size)[0]), step  # this machine's


def load(ckpt_dir, step, mesh, impl=None, capacity_factor=None):
  """(model, config, step) restored from a train_moe.py checkpoint (parameters only) onto ``mesh``."""
  cfg, step = checkpoint_config(ckpt_dir, step, mesh, impl, capacity_factor)
  return restore(ckpt_dir, step, cfg, mesh), cfg, step


def restore(ckpt_dir, step, cfg, mesh):
  """The model of ``cfg`` with the parameters of checkpoint ``step`` (``checkpoint_config``'s), placed on ``mesh``."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  graphdef, abstract = model_lib.abstract_model(cfg, mesh)     # nothing to initialize: all comes from the file
  mngr = model_lib.checkpoint_manager(ckpt_dir, create=False)
  restored = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract)))
  mngr.close()
  return nnx.merge(graphdef, restored["model"])


@functools.partial(jax.jit, static_argnums=(0,))
def next_byte(graphdef, state, window, pos, key, temperature, top_p):
  """window [B, L] int32 (the text left-aligned, padding after it); pos: index of each row's last real byte.
  Returns the next byte of each row [B]."""
  model = nnx.merge(graphdef, state)
  logits, _ = model(window)
  logits = jnp.take_along_axis(logits, pos[:, None, None], axis=1)[:, 0].astype(jnp.float32)   # [B, V]
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  # Nucleus: keep the smallest set of most likely bytes whose probability reaches top_p.
  probs = jax.nn.softmax(scaled, axis=-1)
  sorted_p = jnp.sort(probs, axis=-1)[:, ::-1]
  cutoff_index = jnp.sum(jnp.cumsum(sorted_p, axis=-1) < top_p, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_p, jnp.minimum(cutoff_index, sorted_p.shape[-1] - 1), axis=-1)
  scaled = jnp.where(probs >= cutoff, scaled, -jnp.inf)
  sampled = jax.random.categorical(key, scaled, axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def generate(model, cfg, mesh, prompt: bytes, max_new_tokens: int, temperature=0.0, top_p=1.0, num_samples=1,
             seed=0) -> list[bytes]:
  """Continues ``prompt`` by ``max_new_tokens`` bytes, ``num_samples`` times (one batch)."""
  R = mesh.size
  B = -(-num_samples // R) * R                  # the batch is sharded over the devices: pad it to a multiple
  L = cfg.seq_len
  graphdef, state = nnx.split(model)
  sharding = model_lib.batch_sharding(mesh)
  texts = [list(prompt) or [ord("\n")] for _ in range(B)]
  key = jax.random.key(seed)
  for i in range(max_new_tokens):
    window = np.zeros((B, L), np.int32)
    pos = np.zeros((B,), np.int32)
    for b, t in enumerate(texts):
      ctx = t[-L:]
      window[b, :len(ctx)] = ctx
      pos[b] = len(ctx) - 1
    nxt = next_byte(graphdef, state, jax.device_put(window, sharding), jnp.asarray(pos),
                    jax.random.fold_in(key, i), jnp.float32(temperature), jnp.float32(top_p))
    for b, v in enumerate(np.asarray(nxt)):
      texts[b].append(int(v))
  start = len(prompt) or 1
  return [bytes(t[start:]) for t in texts[:num_samples]]


def check_args(args) -> None:
  """SystemExit naming the rule a sampling flag breaks."""
  if args.max_new_tokens < 0:
    raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: at least 0")
  if args.num_samples < 1:
    raise SystemExit(f"--num-samples {args.num_samples}: at least 1")
  if not args.temperature >= 0:
    raise SystemExit(f"--temperature {args.temperature}: 0 (greedy) or more")
  if not 0 < args.top_p <= 1:
    raise SystemExit(f"--top-p {args.top_p}: in (0, 1]")


def main(argv=None):
  args = parse_args(argv)
  check_args(args)
  try:
    mesh = model_lib.make_mesh(args.devices, args.mesh_axis_type, args.mesh)
    cfg, step = checkpoint_config(args.ckpt_dir, args.step, mesh, args.impl, args.capacity_factor)
  except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
    raise SystemExit(str(e)) from None
  with jax.set_mesh(mesh):
    model = restore(args.ckpt_dir, step, cfg, mesh)
    print(f"loaded step {step} from {args.ckpt_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts top-"
          f"{cfg.top_k}, impl={cfg.impl}, on {mesh.size} {jax.devices()[0].platform} devices {dict(mesh.shape)}",
          file=sys.stderr)
    prompt = args.prompt.encode("utf-8")
    outs = generate(model, cfg, mesh, prompt, args.max_new_tokens, args.temperature, args.top_p,
                    args.num_samples, args.seed)
  for i, out in enumerate(outs):
    if len(outs) > 1:
      print(f"--- sample {i}")
    print((prompt + out).decode("utf-8", errors="replace"))
  return outs


if __name__ == "__main__":
  main()
