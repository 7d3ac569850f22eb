"""Train a small byte-level MoE transformer with jax_moe_overlap's expert-parallel MoE layers.

Runs on all local GPUs when present, else on 4 virtual CPU devices. Tokens (the batch) and experts are sharded over
one mesh axis, "expert" (or, with --mesh data=2,expert=2, tokens over both axes and experts over "expert"); the
train step is one jit-compiled function (forward, backward, AdamW update).

  python examples/train_moe.py --steps 100 --ckpt-dir /tmp/moe-ckpt --overwrite   # ~30 s on a 2-core CPU
  python examples/train_moe.py --steps 600 --ckpt-dir /tmp/moe-ckpt --overwrite --stop-at 300
  python examples/train_moe.py --steps 600 --ckpt-dir /tmp/moe-ckpt --resume       # the same curve, continued
  python examples/generate.py --ckpt-dir /tmp/moe-ckpt --prompt "This License " --temperature 0.8
  python examples/train_moe.py --preset gpu --impl overlap   # ~0.4 B params, 32 k tokens/step: GPUs
  python examples/train_moe.py --preset gpu --impl xla       # the same through XLA's collectives
  python examples/train_moe.py --preset gpu --impl xla --grad-accum 8   # that on one H200 (memory)
  python examples/train_moe.py --preset gpu --profile-steps 3   # and where its device time goes, by part
  python examples/train_moe.py --d-model 128 --impl xla --quantization fp8   # FP8 experts (DeepSeek-V3's recipe)
  python examples/train_moe.py --preset gpu --quantization fp8   # on the e4m3 kernel (Hopper), rows dispatched in FP8
  for i in 0 1 2 3; do python examples/train_moe.py --preset gpu --num-processes 4 --process-id $i \
    --local-device-ids $i --coordinator localhost:12345 & done; wait      # one process per GPU of a 4-GPU host

See examples/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Without a GPU, JAX gets 4 virtual CPU devices (a GPU backend, when present, is used instead).
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import optax  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position
from jax.experimental import multihost_utils  # pylint: disable=wrong-import-position

import model as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
import step_profile  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax_moe_overlap.checks import QUANTIZATIONS  # pylint: disable=g-import-not-at-top,wrong-import-position


def parse_args(argv=None):
  # No abbreviated flags: --preset keeps the flags given explicitly, recognised by their full names (_given_dests).
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=model_lib.HelpFormatter,
                              allow_abbrev=False)
  g = p.add_argument_group("model")
  g.add_argument("--d-model", type=int, default=64, help="model width")
  g.add_argument("--layers", type=int, default=4, help="transformer layers")
  g.add_argument("--heads", type=int, default=4, help="attention heads")
  g.add_argument("--d-ff", type=int, default=128, help="hidden width of each expert")
  g.add_argument("--experts", type=int, default=8, help="number of experts (divisible by the number of devices)")
  g.add_argument("--top-k", type=int, default=2, help="experts per token")
  g.add_argument("--capacity-factor", type=float, default=1.25,
                 help="expert capacity = ceil(cf * tokens * k / experts); 0 for dropless")
  g.add_argument("--moe-every", type=int, default=1, help="1: MoE in every layer, 2: in every other layer")
  g.add_argument("--impl", choices=("overlap", "collective", "xla", "reference"), default="overlap",
                 help="overlap: this library's custom calls; collective: XLA collectives for the exchange and this "
                      "library's grouped GEMMs (what overlap runs as when the expert axis spans hosts); xla: the "
                      "expert-parallel layer from XLA collectives and ragged_dot; reference: the same layer computed "
                      "densely in plain JAX")
  g.add_argument("--router", choices=("softmax", "sigmoid"), default="softmax", help="router scores")
  g.add_argument("--shared-experts", type=int, default=0, help="always-on experts of width --d-ff")
  g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
  g.add_argument("--quantization", choices=("none", *filter(None, QUANTIZATIONS)), default="none",
                 help="fp8: the routed experts' GEMMs in FP8 by DeepSeek-V3's recipe (MoEConfig.quantization; "
                      "--d-model and --d-ff multiples of 128, as the gpu preset's are): with --impl overlap (x "
                      "dispatched in FP8 by the custom calls) or collective on the e4m3 grouped "
                      "GEMM (Hopper GPUs; its emulation on CPU), with --impl xla or reference emulated in XLA; "
                      "fp8_bf16_wgrad: the same with the weight gradients on bfloat16 operands")
  g.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto",
                 help="jax.nn.dot_product_attention's implementation; auto: cudnn (fused flash attention) on GPUs "
                      "with a 16-bit compute dtype where cuDNN takes the shapes, else xla (materialized scores)")
  p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                 help="a named set of model and training sizes (flags given explicitly still win): " +
                      "; ".join(f"{k}: {v['help']}" for k, v in PRESETS.items()))
  g = p.add_argument_group("training")
  g.add_argument("--steps", type=int, default=200, help="total training steps (length of the LR schedule)")
  g.add_argument("--stop-at", type=int, default=None,
                 help="end this run after this step (the schedule still spans --steps); e.g. to test resuming")
  g.add_argument("--batch-size", type=int, default=16, help="sequences per step (divisible by the devices)")
  g.add_argument("--grad-accum", type=int, default=1,
                 help="microbatches per step: the step's batch is split into N, their gradients averaged before one "
                      "update, so activations take one microbatch's memory (batch / N divisible by the devices)")
  g.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
  g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  g.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
  g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on norm scales)")
  g.add_argument("--lb-weight", type=float, default=0.01, help="weight of the load-balancing loss")
  g.add_argument("--z-weight", type=float, default=1e-3, help="weight of the router z-loss")
  g.add_argument("--seed", type=int, default=0, help="parameter init and data order")
  g.add_argument("--devices", type=int, default=None, help="use only the first N local devices (default: all)")
  g.add_argument("--mesh-axis-type", choices=("auto", "explicit"), default="auto",
                 help="jax.sharding.AxisType of the mesh axes")
  g.add_argument("--mesh", default=None,
                 help="mesh axes and sizes, e.g. data=2,expert=2: tokens over all axes, experts over 'expert', each "
                      "data position its own expert-parallel group; an axis 'tensor' (expert=2,tensor=2) splits each "
                      "expert's hidden width over it (default: one 'expert' axis over all devices)")
  g.add_argument("--data", default=None, help=f"text file (default: examples/data/{model_lib.DATA_FILE.name})")
  g = p.add_argument_group("processes (a jax.distributed job: one process per GPU, or several CPU processes)")
  g.add_argument("--num-processes", type=int, default=1, help="processes of the job (1: no jax.distributed)")
  g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. --num-processes - 1")
  g.add_argument("--coordinator", default=None, help="host:port of process 0's coordination service")
  g.add_argument("--local-device-ids", default=None,
                 help="comma list of the local devices this process uses, e.g. its GPU (default: all of them)")
  g = p.add_argument_group("evaluation, checkpoints, output")
  g.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: only at the end)")
  g.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
  g.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory (none: no checkpoints)")
  g.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (and at the end)")
  g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
  g.add_argument("--overwrite", action="store_true", help="start afresh, deleting the checkpoints in --ckpt-dir")
  g.add_argument("--plot", default="loss_curve.png", help="loss-curve PNG to write ('' for none)")
  g.add_argument("--no-progress", action="store_true", help="no progress bar (print a line per --log-every)")
  g.add_argument("--skip-check", action="store_true",
                 help="skip the start-up comparison of the custom calls with impl=reference")
  g.add_argument("--log-every", type=int, default=0, help="with --no-progress: print every N steps")
  g.add_argument("--history-out", default=None,
                 help="write the per-step train losses, dropped fractions and the held-out loss here as JSON")
  g.add_argument("--profile-steps", type=int, default=0,
                 help="trace this many train steps (after the first) with jax.profiler and print where their device "
                      "time goes: this library's custom calls, the rest of the MoE layers, attention, the rest")
  g.add_argument("--peak-tflops", type=float, default=None,
                 help="peak dense TFLOP/s of one device in the compute dtype, for model FLOP utilisation (MFU) "
                      "(default: known GPUs' datasheet value, else no MFU)")
  g.add_argument("--peak-tflops-fp8", type=float, default=None,
                 help="peak dense FP8 TFLOP/s of one device, for the MFU of --quantization fp8 against it (default: "
                      "known GPUs' datasheet value)")
  args = p.parse_args(argv)
  if args.preset:
    given = _given_dests(p, sys.argv[1:] if argv is None else argv)
    for k, v in PRESETS[args.preset].items():
      if k != "help" and k not in given:
        setattr(args, k, v)
  return args


def _given_dests(parser, argv) -> set:
  """The destinations of the options that appear on the command line (as --opt or --opt=value)."""
  by_flag = {opt: a.dest for a in parser._actions for opt in a.option_strings}  # pylint: disable=protected-access
  return {by_flag[t.split("=", 1)[0]] for t in argv if t.split("=", 1)[0] in by_flag}


# Named sizes. "gpu": a ~0.4 B-parameter model (16 experts of which 4 active per token; ~70 M active parameters)
# at 32 k tokens per step in bfloat16, for one to eight GPUs.
PRESETS = {
    "gpu": dict(help="8 layers, d=1024, 16 experts (d_ff 1024) top-4, seq 1024 x batch 32, bf16 (~0.4 B params)",
                d_model=1024, layers=8, heads=16, d_ff=1024, experts=16, top_k=4, capacity_factor=1.25,
                seq_len=1024, batch_size=32, dtype="bfloat16", lr=1e-3, steps=200, eval_batches=2,
                no_progress=True, log_every=10, plot=""),
}

# Peak dense TFLOP/s per device from datasheets (SXM, without sparsity), by a substring of jax's device_kind: bf16,
# and FP8 (e4m3) where the tensor cores have it.
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
PEAK_TFLOPS_FP8 = {"H200": 1979.0, "H100": 1979.0}


# Flags that, besides the model config, determine the loss curve: a resumed run should keep them. grad_accum is one:
# expert capacity and the load-balancing loss (a product of two means over the tokens) are computed per microbatch,
# so the dropped tokens and the gradient change with it (only rounding changes with dropless routing, --lb-weight 0).
RESUME_ARGS = ("steps", "batch_size", "grad_accum", "lr", "warmup", "weight_decay", "lb_weight", "z_weight", "seed",
               "data")


def say(*args, **kwargs):
  """print, by process 0 of the job only (every process computes the same numbers)."""
  if jax.process_index() == 0:
    print(*args, **kwargs)


def start_processes(args):
  """Joins the jax.distributed job that --num-processes asks for (before anything touches a device). On CPU the
  processes' collectives run over gloo."""
  n = args.num_processes
  if n < 1:
    raise SystemExit(f"--num-processes {n}: at least 1")
  if n == 1:
    if args.process_id not in (None, 0) or args.coordinator:
      raise SystemExit("--process-id and --coordinator belong to a job of several processes (--num-processes)")
    return
  if args.process_id is None or not 0 <= args.process_id < n or not args.coordinator:
    raise SystemExit(f"--num-processes {n} needs --process-id in 0..{n - 1} and --coordinator host:port")
  if args.ckpt_dir:
    raise SystemExit("--ckpt-dir: this example checkpoints from one process only")
  ids = [int(i) for i in args.local_device_ids.split(",")] if args.local_device_ids else None
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=n, process_id=args.process_id,
                             local_device_ids=ids)


def model_config(args) -> model_lib.ModelConfig:
  return model_lib.ModelConfig(seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers,
                               num_heads=args.heads, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k,
                               capacity_factor=args.capacity_factor or None, moe_every=args.moe_every,
                               impl=args.impl, dtype=args.dtype, routed_score_func=args.router,
                               shared_experts=args.shared_experts,
                               quantization=None if args.quantization == "none" else args.quantization)


def warmup_steps(args) -> int:
  """The warm-up's steps: --warmup, else 10% of --steps (at least 1)."""
  return args.warmup if args.warmup is not None else max(1, args.steps // 10)


def warmup_note(args) -> str | None:
  """A line saying that the learning rate never reaches its peak, when the warm-up lasts the whole run: step s (from
  0) trains at lr * s / warmup, and the last step is --steps - 1; None otherwise."""
  warmup = warmup_steps(args)
  if args.steps < 1 or warmup < args.steps:
    return None
  steps = f"{warmup} step{'s' if warmup != 1 else ''}"
  return (f"the warm-up ({steps}) lasts the whole run (--steps {args.steps}): the learning rate never reaches its "
          f"peak --lr {args.lr:g} (the last step trains at {args.lr * (args.steps - 1) / warmup:.3g})")


def make_optimizer(model, args):
  tx, schedule = make_tx(args.lr, warmup_steps(args), args.steps, args.weight_decay)
  return nnx.Optimizer(model, tx, wrt=nnx.Param), schedule


@functools.lru_cache(maxsize=None)
def make_tx(lr: float, warmup: int, steps: int, weight_decay: float):
  """AdamW (no decay on norm scales) with linear warm-up and cosine decay to lr/10, after global-norm clipping.
  Cached: the same hyperparameters give the same object, so the jit-compiled steps below are reused."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
                                                end_value=lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                               mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
  return tx, schedule


def lm_loss(model, tokens, lb_weight, z_weight):
  """Next-token cross-entropy on tokens [B, L+1] plus the weighted router auxiliary losses."""
  logits, aux = model(tokens[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  total = ce + lb_weight * aux.load_balance_loss + z_weight * aux.router_z_loss
  return total, (ce, aux)


def loss_and_grads(model, tokens, loss_weights):
  """(gradients of the total loss w.r.t. the nnx.Params, metrics) of one batch or microbatch."""
  grad_fn = nnx.value_and_grad(lm_loss, has_aux=True)
  (total, (ce, aux)), grads = grad_fn(model, tokens, *loss_weights)
  metrics = {"loss": ce, "total_loss": total, "load_balance": aux.load_balance_loss, "z_loss": aux.router_z_loss,
             "dropped": aux.dropped_fraction}
  return grads, metrics


def accumulated_grads(model, tokens, loss_weights, grad_accum):
  """loss_and_grads of tokens [B, L+1] as the mean over grad_accum microbatches of B / grad_accum sequences: the
  gradients summed in float32 and divided by grad_accum, each metric averaged (the microbatches have equal numbers of
  tokens, so the cross-entropy and dropped fraction are the whole batch's). One lax.scan iteration per microbatch, so
  activations are live for one microbatch at a time. grad_accum 1 is loss_and_grads of the whole batch.

  Microbatch i holds sequences i, i + N, i + 2N, ... (N = grad_accum): the batch's rows lie on the devices in
  contiguous blocks of B / R, and with B / N divisible by R every device holds B / (N R) rows of each microbatch, so
  the split moves no data and each microbatch is spread over all devices like the whole batch.

  State that the model's forward mutates (nnx variables other than Params; the example's MoE layers have none, as
  they carry no routing bias) is carried from microbatch to microbatch in order: a routing bias would take
  grad_accum update steps per train step, each from one microbatch's load."""
  if grad_accum == 1:
    return loss_and_grads(model, tokens, loss_weights)
  B = tokens.shape[0]
  micro = jnp.swapaxes(tokens.reshape(B // grad_accum, grad_accum, *tokens.shape[1:]), 0, 1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def body(carry, mb):
    rest, grad_sum = carry
    m = nnx.merge(graphdef, params, rest, copy=True)   # new Variables: nnx.value_and_grad rejects the jit's
    grads, metrics = loss_and_grads(m, mb, loss_weights)
    grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
    return (nnx.state(m, nnx.Not(nnx.Param)), grad_sum), metrics

  zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
  (rest, grad_sum), metrics = jax.lax.scan(body, (rest, zeros), micro)
  nnx.update(model, rest)
  grads = jax.tree.map(lambda s, p: (s / grad_accum).astype(p.dtype), grad_sum, params)
  return grads, jax.tree.map(lambda m: m.mean(0), metrics)


# train_step's jit: the graph definition, loss weights and microbatch count are static, the state is donated.
TRAIN_STEP_JIT = {"static_argnums": (0, 1), "static_argnames": ("grad_accum",), "donate_argnums": (2,)}


@functools.partial(jax.jit, **TRAIN_STEP_JIT)
def train_step(graphdef, loss_weights, state, tokens, grad_accum=1):
  """One AdamW step on the split (model, optimizer) state from the (accumulated) gradients of tokens [B, L+1]; returns
  the new state and the step's metrics."""
  model, optimizer = nnx.merge(graphdef, state)
  grads, metrics = accumulated_grads(model, tokens, loss_weights, grad_accum)
  optimizer.update(model, grads)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return nnx.state((model, optimizer)), metrics


@functools.partial(jax.jit, static_argnums=(0,))
def eval_step(graphdef, state, tokens):
  model, _ = nnx.merge(graphdef, state)
  _, (ce, aux) = lm_loss(model, tokens, 0.0, 0.0)
  return ce, aux.dropped_fraction


def evaluate(graphdef, state, batches, sharding):
  losses = [eval_step(graphdef, state, model_lib.put_global(b, sharding))[0] for b in batches]
  return float(np.mean([float(l) for l in losses]))


def check_against_reference(model, tokens, num_devices):
  """The first MoE layer on the embedded first batch, through this library's custom calls and through
  impl="reference" (plain JAX), compared. One layer, not the whole model: later layers route on their inputs, and a
  rounding-level difference that flips a near-tie in a router is no error of the layer."""
  moe = next(m for _, m in nnx.iter_graph(model) if isinstance(m, jmo.MoE))
  x = (jax.nn.one_hot(tokens, model.cfg.vocab_size, dtype=jnp.float32) @ model.embed.embedding[...])
  config = moe.config
  dtype = config.dtype
  x = x.astype(dtype)
  forward = nnx.jit(lambda m, x: m(x)[0])
  host = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True), np.float32)  # every process's rows
  with jax.default_matmul_precision("highest"):    # no TF32 in the reference's float32 matmuls on GPUs
    y = host(forward(moe, x))
    # The oracle computes in float32 on the same (rounded) input.
    moe.impl, moe.config = "reference", dataclasses.replace(config, dtype=jnp.float32)
    try:
      y_ref = host(forward(moe, x.astype(jnp.float32)))
    finally:
      moe.impl, moe.config = "overlap", config
  rel = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
  tol = 1e-4 if jnp.dtype(dtype) == jnp.float32 else 1e-2
  say(f"check: an MoE layer through the custom calls on {num_devices} devices vs impl=reference: relative "
        f"difference {rel:.2e} over {y.size} values ({jnp.dtype(dtype).name} vs a float32 reference, tolerance "
        f"{tol:g})")
  if not rel < tol:
    raise SystemExit("the custom calls disagree with the reference implementation")


def check_counts(args):
  """SystemExit naming the first count flag below its least value, or a learning rate that is not a positive finite
  number (the model's sizes: ``ModelConfig.check``)."""
  least = {"batch_size": 1, "eval_batches": 1, "save_every": 1, "eval_every": 0, "log_every": 0, "steps": 0}
  for name, low in least.items():
    if getattr(args, name) < low:
      raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: at least {low}")
  if args.stop_at is not None and args.stop_at < 1:     # else 0 would read as "not given": every step
    raise SystemExit(f"--stop-at {args.stop_at}: at least 1")
  if args.warmup is not None and args.warmup < 0:       # a negative warm-up starts the schedule above 0
    raise SystemExit(f"--warmup {args.warmup}: at least 0")
  if not (math.isfinite(args.lr) and args.lr > 0):
    raise SystemExit(f"--lr {args.lr}: must be a positive finite number")


def check_outputs(args):
  """SystemExit naming an output path that cannot be written, before anything is trained: a --plot or --history-out
  whose directory does not exist or which is a directory, a --ckpt-dir that exists and is no directory. Only process
  0 of a job writes the plot and the history, so only it checks them."""
  if args.process_id in (None, 0):
    for flag, path in (("--plot", args.plot), ("--history-out", args.history_out)):
      if not path:
        continue
      parent = os.path.dirname(os.path.abspath(path))
      if os.path.isdir(path):
        raise SystemExit(f"{flag} {path}: is a directory, not a file")
      if not os.path.isdir(parent):
        raise SystemExit(f"{flag} {path}: no directory {parent}")
  if args.ckpt_dir and os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
    raise SystemExit(f"--ckpt-dir {args.ckpt_dir}: exists and is not a directory")


def check_batch_split(batch_size, grad_accum, num_devices):
  """SystemExit unless the step's batch splits into grad_accum microbatches of whole sequences, each divisible by
  the devices of the mesh (its sequences are sharded over them)."""
  if grad_accum < 1:
    raise SystemExit(f"--grad-accum {grad_accum}: the microbatches per step must be at least 1")
  if batch_size % grad_accum:
    raise SystemExit(f"--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}: a microbatch holds "
                     f"whole sequences")
  per_micro = batch_size // grad_accum
  if per_micro % num_devices:
    what = (f"--batch-size {batch_size}" if grad_accum == 1 else
            f"--batch-size {batch_size} / --grad-accum {grad_accum} = {per_micro} sequences per microbatch")
    raise SystemExit(f"{what} must be divisible by the {num_devices} devices of the mesh")


def _known_peak(table: dict[str, float]) -> float | None:
  kind = jax.devices()[0].device_kind
  return next((tflops for name, tflops in table.items() if name in kind), None)


def peak_tflops(args) -> float | None:
  """Peak dense TFLOP/s of one device: --peak-tflops, else a known GPU's bf16 datasheet value (bf16 runs only)."""
  if args.peak_tflops:
    return args.peak_tflops
  return _known_peak(PEAK_TFLOPS_BF16) if args.dtype == "bfloat16" else None


def peak_tflops_fp8(args) -> float | None:
  """Peak dense FP8 TFLOP/s of one device: --peak-tflops-fp8, else a known GPU's datasheet value."""
  return args.peak_tflops_fp8 or _known_peak(PEAK_TFLOPS_FP8)


def tokens_per_s(tok_s: float) -> str:
  """A step's tokens/s as the progress bar and the log lines show it: "-" where the step was not timed (the first,
  which compiles, and those after an evaluation)."""
  return f"{tok_s:,.0f}" if np.isfinite(tok_s) else "-"


def report_throughput(cfg, args, step_times, tokens_per_step, num_devices):
  """Prints the median training throughput of the timed steps and, when the device's peak is known, the model FLOP
  utilisation: model FLOPs per token (ModelConfig.flops_per_token) x tokens/s over the devices' summed peak. With the
  routed experts in FP8 (cfg.quantization) the same FLOPs also against the FP8 peak (every FLOP at FP8's rate: the
  bound no step reaches, as the rest of the model runs in the compute dtype) and against the mixed peak (the routed
  experts' FLOPs at the FP8 peak, the rest at the compute dtype's: the time the step would take at both peaks)."""
  if not step_times:
    say("throughput: no timed step (the first step compiles, and a step after an evaluation, --eval-every, "
        "includes that evaluation: neither is timed)")
    return
  tok_s = tokens_per_step / float(np.median(step_times))
  line = (f"throughput impl={cfg.impl}: {tok_s:,.0f} tokens/s (median of {len(step_times)} steps, "
          f"{tok_s / num_devices:,.0f} per device) | {cfg.flops_per_token() / 1e9:.3g} GFLOP/token")
  peak = peak_tflops(args)
  if peak:
    mfu = cfg.flops_per_token() * tok_s / (peak * 1e12 * num_devices)
    line += f" | MFU {100 * mfu:.1f}% of {peak:g} TFLOP/s x {num_devices}"
  peak8 = peak_tflops_fp8(args) if cfg.quantization == "fp8" else None
  if peak8:
    flops = cfg.flops_per_token_by_part()
    fp8_flops = flops.pop("routed_experts")
    mfu8 = cfg.flops_per_token() * tok_s / (peak8 * 1e12 * num_devices)
    line += f" | {100 * mfu8:.1f}% of the FP8 peak ({peak8:g} TFLOP/s)"
    if peak:
      ideal_s = (fp8_flops / peak8 + sum(flops.values()) / peak) / 1e12 / num_devices   # per token
      line += f", {100 * ideal_s * tok_s:.1f}% of the mixed peak (routed experts at FP8's)"
  say(line, flush=True)


def part_flops(cfg, tokens_per_device: float) -> dict[str, float]:
  """Model FLOPs per device and step of each part a step profile times (step_profile.PARTS). Without this library's
  custom calls (impl xla or reference) the routed experts run among the MoE layers' other ops."""
  flops = {part: f * tokens_per_device for part, f in cfg.flops_per_token_by_part().items()}
  if cfg.impl != "overlap":
    flops["moe_other"] += flops.pop("routed_experts")
  return flops


def plot_curve(path, history, title):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  steps = np.arange(1, len(history["loss"]) + 1)
  loss = np.asarray(history["loss"])
  fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
  ax.plot(steps, loss, color="tab:blue", alpha=0.35, lw=0.8, label="train (per step)")
  if len(loss) >= 10:
    w = max(5, len(loss) // 40)
    smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
    ax.plot(steps[w - 1:], smooth, color="tab:blue", lw=1.6, label=f"train ({w}-step mean)")
  if history["eval"]:
    es, el = zip(*history["eval"])
    ax.plot(es, el, "o-", color="tab:red", ms=4, lw=1.2, label="held-out")
  ax.axhline(np.log(256), color="gray", ls=":", lw=0.8, label="uniform over bytes (ln 256)")
  ax.set_xlabel("step")
  ax.set_ylabel("next-byte cross-entropy (nats)")
  ax.set_ylim(0, max(6.0, float(loss[:1].max()) + 0.3) if len(loss) else 6.0)
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  handles, labels = ax.get_legend_handles_labels()
  if history.get("dropped"):
    ax2 = ax.twinx()
    line, = ax2.plot(steps, history["dropped"], color="tab:green", alpha=0.5, lw=0.8)
    ax2.set_ylabel("dropped fraction (capacity)", color="tab:green", fontsize=8)
    ax2.set_ylim(0, max(0.5, max(history["dropped"]) * 1.1))
    ax2.tick_params(axis="y", labelcolor="tab:green", labelsize=8)
    handles.append(line)
    labels.append("dropped (token, expert) slots")
  ax.legend(handles, labels, fontsize=8, loc="upper right")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  check_counts(args)
  check_outputs(args)
  if (args.resume or args.overwrite) and not args.ckpt_dir:
    raise SystemExit("--resume and --overwrite need --ckpt-dir")
  start_processes(args)
  try:
    mesh = model_lib.make_mesh(args.devices, args.mesh_axis_type, args.mesh)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  R = mesh.size
  check_batch_split(args.batch_size, args.grad_accum, R)
  cfg = model_config(args)
  try:
    cfg.check(mesh)                                    # the model's and its MoE blocks' rules on this mesh
  except (ValueError, TypeError, NotImplementedError) as e:
    raise SystemExit(str(e)) from None
  try:
    attention, why = model_lib.choose_attention(cfg, mesh, args.batch_size // args.grad_accum, args.attention)
    try:
      train_text, held_text = model_lib.load_text(args.data)
    except OSError as e:
      raise ValueError(f"--data {args.data}: {e.strerror or e}") from None
    except ValueError as e:
      raise ValueError(f"--data {args.data or model_lib.DATA_FILE}: {e}") from None
    eval_set = model_lib.eval_batches(held_text, args.batch_size, args.seq_len, args.eval_batches, multiple_of=R)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  cfg = dataclasses.replace(cfg, attention=attention)
  sharding = model_lib.batch_sharding(mesh)
  stop = min(args.stop_at or args.steps, args.steps)
  history = {"loss": [], "eval": [], "dropped": []}
  start = 0

  with jax.set_mesh(mesh):
    model = model_lib.create_model(cfg, mesh, args.seed)
    optimizer, schedule = make_optimizer(model, args)

    mngr = None
    if args.ckpt_dir:
      import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
      mngr = model_lib.checkpoint_manager(args.ckpt_dir)
      if args.overwrite and not args.resume:
        for old in mngr.all_steps():
          mngr.delete(old)
      latest = mngr.latest_step()
      if latest is not None and not args.resume:
        raise SystemExit(f"{args.ckpt_dir} already holds a checkpoint (step {latest}); pass --resume to continue "
                         f"it, --overwrite to start afresh, or use a new --ckpt-dir")
      if latest is not None:
        # The config and the mesh are checked before the arrays are read: a restore into other shapes would fail
        # inside orbax with a message about shapes, not about the flag that differs.
        meta = mngr.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved_cfg = model_lib.ModelConfig.from_json(meta["config"])
        # Any impl and quantization continue a checkpoint: neither changes the parameters.
        saved_cfg = dataclasses.replace(saved_cfg, impl=cfg.impl, attention=cfg.attention,
                                        quantization=cfg.quantization)
        if saved_cfg != cfg:
          differ = [f.name for f in dataclasses.fields(cfg) if getattr(saved_cfg, f.name) != getattr(cfg, f.name)]
          raise SystemExit(f"the checkpoint in {args.ckpt_dir} has another model than the flags give: " + ", ".join(
              f"{n} {getattr(saved_cfg, n)} (checkpoint) -> {getattr(cfg, n)} (flags)" for n in differ))
        try:
          model_lib.check_checkpoint_mesh(meta, mesh, args.ckpt_dir)
        except ValueError as e:
          raise SystemExit(str(e)) from None
        if latest > stop:
          raise SystemExit(f"{args.ckpt_dir} holds step {latest}, past this run's last step {stop} (--steps "
                           f"{args.steps}" + (f", --stop-at {args.stop_at}" if args.stop_at else "") +
                           "): nothing to resume")
        restored = mngr.restore(latest, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(model_lib.abstract_like(nnx.state(model))),
            opt=ocp.args.StandardRestore(model_lib.abstract_like(nnx.state(optimizer)))))
        changed = {k: (v, vars(args).get(k)) for k, v in meta["args"].items()
                   if k in RESUME_ARGS and vars(args).get(k) != v}
        if changed:
          say("warning: these flags differ from the checkpointed run, so the loss curve will not continue as it "
                "would have: " + ", ".join(f"--{k.replace('_', '-')} {v[0]} -> {v[1]}" for k, v in changed.items()))
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["opt"])
        history = meta["history"]
        start = latest
        say(f"resumed from {args.ckpt_dir} at step {start}")

    if cfg.impl == "overlap" and not args.skip_check:
      check_against_reference(model, model_lib.put_global(eval_set[0], sharding)[:, :-1], R)

    graphdef, state = nnx.split((model, optimizer))   # the jitted steps take and return the state pytree
    del model, optimizer
    loss_weights = (args.lb_weight, args.z_weight)
    run_step = functools.partial(train_step, graphdef, loss_weights, grad_accum=args.grad_accum)
    profile = None
    if args.profile_steps:
      if args.profile_steps < 0 or args.profile_steps >= stop - start:
        raise SystemExit(f"--profile-steps {args.profile_steps}: this run has {stop - start} steps, and the first "
                         f"is not traced")
      # The traced steps run a jit of their own, compiled without CUDA graphs (step_profile.compiler_options) so
      # that each kernel carries its HLO op's name; the other steps keep train_step's executable. Its compiled HLO
      # text names the ops the trace times; jit's cache hands the traced steps this same executable. A jit, not the
      # Compiled object, runs them: the step takes an effect token, which jit's dispatch passes on every call and
      # a Compiled object's fast path (jax 0.11) not after the first.
      profiled_jit = jax.jit(train_step.__wrapped__, **TRAIN_STEP_JIT,
                             compiler_options=step_profile.compiler_options(mesh.devices.flat[0].platform))
      batch_type = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32, sharding=sharding)
      hlo = profiled_jit.lower(graphdef, loss_weights, state, batch_type, grad_accum=args.grad_accum).compile()
      profile = step_profile.StepProfile(hlo.as_text(), moe_scope=model_lib.MOE_SCOPE,
                                         attention_scope=model_lib.ATTENTION_SCOPE)
      profiled_step = functools.partial(profiled_jit, graphdef, loss_weights, grad_accum=args.grad_accum)
    traced = range(start + 1, start + 1 + args.profile_steps)   # the steps under the trace
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state[0]))
    tokens_per_step = args.batch_size * args.seq_len
    micro = f" in {args.grad_accum} microbatches" if args.grad_accum > 1 else ""
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"{jax.devices()[0].platform} x {R} devices{procs} {dict(mesh.shape)} | {n_params / 1e6:.2f}M parameters | "
        f"{cfg.num_experts} experts, top-{cfg.top_k}, capacity factor {cfg.capacity_factor} | impl={cfg.impl}"
        f"{' ' + cfg.quantization if cfg.quantization else ''} | "
        f"{tokens_per_step} tokens/step{micro} | train {len(train_text)} B, held-out {len(held_text)} B")
    say(f"attention: {cfg.attention} ({why}) | evaluation: {len(eval_set)} held-out batch(es) of "
        f"{len(eval_set[0])} x {args.seq_len + 1} bytes")
    if warmup_note(args):
      say(warmup_note(args))

    def save(step):
      if mngr is None:
        return
      meta = {"config": cfg.to_json(), "step": step, "history": history, "args": vars(args)}
      mngr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(state[0]),
                                              opt=ocp.args.StandardSave(state[1]),
                                              meta=ocp.args.JsonSave(meta)), force=True)
      mngr.wait_until_finished()   # the next step donates (reuses) these buffers

    bar = None
    if not args.no_progress and jax.process_index() == 0:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      bar = tqdm(total=stop, initial=start, desc="train", dynamic_ncols=True)
    # A step's metrics are read back (the host's wait for it) only once the next step has been dispatched, so that
    # the device runs step n + 1 while the host reads step n, logs it and prepares the next batch; the steps run in
    # the same order on the same inputs, so the losses are those of a loop that waits for every step. The wait is
    # synchronous around the traced steps, evaluations and checkpoints. A step's time is the interval between the
    # read-backs of its predecessor and its own: the device's time per step once the host keeps ahead.
    t_prev = None                                       # the last read-back's time (None: the next is not timed)
    step_times = []                                     # seconds of the timed steps (not the first: compilation)
    pending = None                                      # (step, metrics) dispatched and not yet read back

    def read_back():
      """The host's side of the pending step, if any: waits for it, times it, logs it."""
      nonlocal pending, t_prev
      if pending is None:
        return
      step, metrics = pending
      pending = None
      loss, dropped = float(metrics["loss"]), float(metrics["dropped"])   # waits for the step
      t_now = time.perf_counter()
      tok_s = float("nan")                              # an untimed step shows no rate, not its predecessor's
      if t_prev is not None:
        tok_s = tokens_per_step / (t_now - t_prev)
        if step not in traced:                          # the profiler's overhead is no training time
          step_times.append(t_now - t_prev)
      t_prev = t_now
      history["loss"].append(loss)
      history["dropped"].append(dropped)
      done = step + 1
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=tokens_per_s(tok_s),
                        dropped=f"{dropped:.3f}", lr=f"{float(schedule(step)):.1e}", refresh=False)
        bar.update(1)
      elif args.log_every and done % args.log_every == 0:
        say(f"step {done}: loss {loss:.4f}  tokens/s {tokens_per_s(tok_s)}  dropped {dropped:.4f}", flush=True)
      if not np.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {done}")

    for step in range(start, stop):
      batch = model_lib.put_global(model_lib.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len),
                                   sharding)
      if profile is not None and step == traced.start:
        read_back()
        profile.start()
      state, metrics = (profiled_step if step in traced else run_step)(state, batch)
      read_back()
      pending = (step, metrics)
      done = step + 1
      if profile is not None and step == traced[-1]:
        read_back()
        profile.stop(len(traced))
        t_prev = None                                   # nor is the trace's processing
      if args.eval_every and done % args.eval_every == 0 and done != stop:
        read_back()
        history["eval"].append((done, evaluate(graphdef, state, eval_set, sharding)))
        t_prev = None                                   # do not count the evaluation as training time
      if mngr is not None and done % args.save_every == 0 and done != stop:
        read_back()
        save(done)
    read_back()
    if bar is not None:
      bar.close()

    eval_loss = evaluate(graphdef, state, eval_set, sharding)
    if not history["eval"] or history["eval"][-1][0] != stop:
      history["eval"].append((stop, eval_loss))
    if mngr is not None:
      if mngr.latest_step() != stop:
        save(stop)
      mngr.wait_until_finished()
      mngr.close()

  if stop > start:                                      # else no step ran: nothing to time
    report_throughput(cfg, args, step_times, tokens_per_step, R)
  profile_result = None
  if profile is not None:
    profile_result = profile.result(sum(d.process_index == jax.process_index() for d in mesh.devices.flat))
    say(step_profile.format_table(profile_result, part_flops(cfg, tokens_per_step / R)))
  held_out = f"held-out loss {eval_loss:.4f} nats/byte ({eval_loss / np.log(2):.3f} bits/byte)"
  if history["loss"]:
    say(f"step {stop}: train loss {np.mean(history['loss'][-10:]):.4f} (first step {history['loss'][0]:.4f}), "
        f"{held_out}, dropped {np.mean(history['dropped'][-10:]) if history['dropped'] else 0:.4f}")
  else:                                                 # --steps 0: the initial model's held-out loss
    say(f"step {stop}: no train step ran, {held_out}")
  if args.history_out and jax.process_index() == 0:
    with open(args.history_out, "w") as f:
      json.dump({"losses": history["loss"], "dropped": history["dropped"], "eval": history["eval"],
                 "eval_loss": eval_loss, "processes": jax.process_count(), "devices": R}, f)
  if args.plot and jax.process_index() == 0:
    plot_curve(args.plot, history, f"{cfg.num_layers} layers, d={cfg.d_model}, {cfg.num_experts} experts top-"
               f"{cfg.top_k}, cf={cfg.capacity_factor}, impl={cfg.impl}, {R} {jax.devices()[0].platform} devices")
    say(f"wrote {args.plot}")
  return {"losses": history["loss"], "eval": history["eval"], "eval_loss": eval_loss,
          "dropped": history["dropped"], "state": state, "attention": cfg.attention, "eval_set": eval_set,
          "profile": profile_result, "step_times": step_times}


if __name__ == "__main__":
  main()
