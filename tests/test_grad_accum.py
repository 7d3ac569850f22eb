"""examples/train_moe.py --grad-accum: a step over N microbatches equals the step over the whole batch (dropless and
without the load-balancing loss, the two terms computed per microbatch), bad splits of the batch are refused, and under
FP8 the expert weights are quantized once per step, not once per microbatch."""

import collections
import contextlib
import re

import jax
import model as model_lib  # examples/model.py (examples/ is on pytest's pythonpath)
import numpy as np
import pytest
import train_moe  # examples/train_moe.py
from flax import nnx

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--experts", "8", "--top-k", "2",
        "--seq-len", "32", "--batch-size", "8", "--impl", "xla", "--capacity-factor", "0", "--lb-weight", "0",
        "--warmup", "1"]


@contextlib.contextmanager
def _example_step(args):
  """Under the example's mesh: (graphdef, state, batch) of train_moe.train_step for args, the batch step 0's."""
  mesh = model_lib.make_mesh()
  with jax.set_mesh(mesh):
    model = model_lib.create_model(train_moe.model_config(args), mesh, args.seed)
    optimizer, _ = train_moe.make_optimizer(model, args)
    graphdef, state = nnx.split((model, optimizer))
    train_text, _ = model_lib.load_text(args.data)
    batch = jax.device_put(model_lib.train_batch(train_text, 0, args.seed, args.batch_size, args.seq_len),
                           model_lib.batch_sharding(mesh))
    yield graphdef, state, batch


def _two_steps(args, grad_accum):
  """(metrics of two train steps on step 0's batch, parameters before them, parameters after them). The schedule's
  learning rate is 0 at the first step and the peak (--warmup 1) at the second, which moves the parameters."""
  with _example_step(args) as (graphdef, state, batch):
    before = [np.asarray(p) for p in jax.tree.leaves(state[0])]     # the step donates the state's buffers
    metrics = []
    for _ in range(2):
      state, m = train_moe.train_step(graphdef, (args.lb_weight, args.z_weight), state, batch,
                                      grad_accum=grad_accum)
      metrics.append(jax.tree.map(float, m))
    return metrics, before, [np.asarray(p) for p in jax.tree.leaves(state[0])]


@pytest.mark.slow  # trains the example model twice; the refusals stay in the default pass
def test_two_microbatches_step_like_the_whole_batch():
  args = train_moe.parse_args(TINY)
  whole, init, whole_params = _two_steps(args, 1)
  micro, _, micro_params = _two_steps(args, 2)
  for w, m in zip(whole, micro):
    assert w.keys() == m.keys()
    for k in ("loss", "total_loss", "z_loss", "grad_norm"):    # grad_norm: the mean of the gradients, not their sum
      np.testing.assert_allclose(m[k], w[k], rtol=1e-5, err_msg=k)
    assert m["dropped"] == w["dropped"] == 0.0                # dropless
  # The updates agree. AdamW scales each element's update to about lr whatever its gradient's size, so the rounding of
  # a gradient near 0 moves that element by a small fraction of lr: per element within 1% of lr, as a whole within
  # float32 rounding.
  whole_update = [b - i for b, i in zip(whole_params, init)]
  assert max(float(np.max(np.abs(u))) for u in whole_update) > 0.5 * args.lr
  for a, b, i in zip(micro_params, whole_params, init):
    np.testing.assert_allclose(a - i, b - i, rtol=0, atol=1e-2 * args.lr)
  diff = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(micro_params, whole_params)))
  assert diff < 1e-4 * np.sqrt(sum(float(np.sum(u ** 2)) for u in whole_update))


@pytest.mark.parametrize("grad_accum, problem", [
    ("3", "--batch-size 8 is not divisible by --grad-accum 3"),
    ("0", "--grad-accum 0: the microbatches per step must be at least 1"),
    ("4", "--batch-size 8 / --grad-accum 4 = 2 sequences per microbatch must be divisible by the 4 devices"),
])
def test_bad_grad_accum_is_refused(grad_accum, problem):
  with pytest.raises(SystemExit, match=problem):
    train_moe.main(TINY + ["--grad-accum", grad_accum, "--steps", "1", "--no-progress", "--plot", ""])


def test_preset_keeps_one_microbatch():
  assert train_moe.parse_args(["--preset", "gpu"]).grad_accum == 1
  assert "grad_accum" in train_moe.RESUME_ARGS


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLED = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations|called_computations)=\{?([^}\s]+)")


def library_calls_in_loops(hlo: str) -> tuple[collections.Counter, collections.Counter]:
  """(the library's custom calls, by target, in the computations a while loop runs: its bodies and conditions and
  everything they call; those elsewhere) of an optimized HLO text."""
  calls, refs, name = collections.defaultdict(list), collections.defaultdict(set), None
  loop_roots = set()
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      name = m.group(1)
      continue
    calls[name] += re.findall(r'custom_call_target="(jmo_\w+)"', line)
    for group in _CALLED.findall(line):
      refs[name].update(c.lstrip("%") for c in group.split(","))
    if " while(" in line:
      loop_roots.update(c.lstrip("%") for c in re.findall(r"\b(?:body|condition)=(%?[\w.\-]+)", line))
  inside, todo = set(), list(loop_roots)
  while todo:
    c = todo.pop()
    if c not in inside:
      inside.add(c)
      todo += refs[c]
  loops = collections.Counter(t for c in inside for t in calls[c])
  return loops, collections.Counter(t for c in calls if c not in inside for t in calls[c])


@pytest.mark.parametrize("impl", ["collective", pytest.param("overlap", marks=pytest.mark.slow)])
def test_fp8_weights_are_quantized_once_per_step(impl):
  """The step over 2 microbatches (one lax.scan iteration each) under --quantization fp8: each MoE layer quantizes
  its master weights inside the layer, on every call, but they do not change within a step, and XLA's loop-invariant
  code motion takes the weight quantizer's calls out of the microbatch loop: in the compiled step they run before
  it, once per step, while the layer's GEMMs run in it."""
  args = train_moe.parse_args(TINY + ["--d-model", "128", "--d-ff", "128", "--quantization", "fp8",
                                      "--impl", impl])
  with _example_step(args) as (graphdef, state, batch):
    hlo = train_moe.train_step.lower(graphdef, (args.lb_weight, args.z_weight), state, batch,
                                     grad_accum=2).compile().as_text()
  in_loops, outside = library_calls_in_loops(hlo)
  assert in_loops["jmo_grouped_matmul_swiglu_fp8"] >= 1, (in_loops, outside)   # the layer runs per microbatch
  assert outside["jmo_quantize_weight_fp8"] >= 1 and in_loops["jmo_quantize_weight_fp8"] == 0, (in_loops, outside)
