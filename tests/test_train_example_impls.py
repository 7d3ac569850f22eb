"""examples/train_moe.py with impl="xla" and the model-scale preset's argument handling (the preset's run itself
needs GPUs)."""

import numpy as np
import pytest
import train_moe  # examples/train_moe.py (examples/ is on pytest's pythonpath)

TINY = ["--steps", "12", "--layers", "2", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--experts", "8",
        "--top-k", "2", "--capacity-factor", "1.25", "--seq-len", "32", "--batch-size", "8", "--eval-batches", "2",
        "--no-progress", "--plot", "", "--skip-check"]


# Two training runs; impl="xla" with the sigmoid router and shared experts agrees with the reference in
# tests/test_moe_block.py, and trains in the example in tests/test_grad_accum.py.
@pytest.mark.slow
def test_xla_trains_like_reference():
  xla = train_moe.main(TINY + ["--impl", "xla", "--router", "sigmoid", "--shared-experts", "1"])
  ref = train_moe.main(TINY + ["--impl", "reference", "--router", "sigmoid", "--shared-experts", "1"])
  np.testing.assert_allclose(xla["losses"], ref["losses"], rtol=2e-4)
  assert xla["losses"][-1] < xla["losses"][0] - 0.3


def test_preset_sizes_and_overrides():
  args = train_moe.parse_args(["--preset", "gpu", "--impl", "xla", "--batch-size=16"])
  assert (args.d_model, args.layers, args.experts, args.top_k, args.seq_len) == (1024, 8, 16, 4, 1024)
  assert args.batch_size == 16 and args.impl == "xla" and args.dtype == "bfloat16"
  cfg = train_moe.model_config(args)
  assert 0.5e9 < cfg.flops_per_token() < 2e9
  assert train_moe.parse_args([]).d_model == 64     # no preset: the CPU defaults


@pytest.mark.slow  # two training runs; tests/test_batch_axes.py has the layer and the module on a (data, expert) mesh
def test_data_expert_mesh_trains_like_the_expert_mesh():
  """--mesh data=2,expert=2: two expert-parallel groups of 2 ranks (tokens over both axes, batch_axes=("data",)).
  Dropless, so each token meets the same experts as on the 1-D mesh of 4 ranks and the losses agree."""
  dropless = ["--capacity-factor", "0", "--steps", "6"]
  two_d = train_moe.main(TINY + dropless + ["--mesh", "data=2,expert=2"])
  one_d = train_moe.main(TINY + dropless)
  np.testing.assert_allclose(two_d["losses"], one_d["losses"], rtol=2e-4)


@pytest.mark.slow  # two training runs; tests/test_tensor_parallel.py has the layer and the module with a tensor axis
def test_expert_tensor_mesh_trains_like_the_expert_mesh():
  """--mesh expert=2,tensor=2: each expert's hidden width split over "tensor", one expert-parallel group of the 4
  devices (tokens over both axes). Dropless, so each token meets the same experts as on the 1-D mesh of 4 ranks and
  the losses agree."""
  dropless = ["--capacity-factor", "0", "--steps", "6"]
  two_d = train_moe.main(TINY + dropless + ["--mesh", "expert=2,tensor=2"])
  one_d = train_moe.main(TINY + dropless)
  np.testing.assert_allclose(two_d["losses"], one_d["losses"], rtol=2e-4)


def test_mesh_flag_errors():
  import model  # examples/model.py  pylint: disable=g-import-not-at-top
  assert model.parse_mesh_shape(None, 4) == (("expert",), (4,))
  assert model.parse_mesh_shape("data=2,expert=2", 4) == (("data", "expert"), (2, 2))
  for bad in ("data=2,expert=4", "data=4", "data=2,data=2", "expert"):
    with pytest.raises(ValueError):
      model.parse_mesh_shape(bad, 4)


FP8_TINY = ["--d-model", "128", "--d-ff", "128", "--heads", "4", "--impl", "xla", "--dtype", "bfloat16"]


@pytest.mark.slow  # two training runs
def test_fp8_trains_like_bfloat16():
  """--quantization fp8 (the recipe emulated in XLA) follows the unquantized run's loss curve to within FP8's
  rounding: a few percent per step here, falling as fast."""
  bf16 = train_moe.main(TINY + FP8_TINY)
  fp8 = train_moe.main(TINY + FP8_TINY + ["--quantization", "fp8"])
  np.testing.assert_allclose(fp8["losses"], bf16["losses"], rtol=3e-2)
  assert fp8["losses"] != bf16["losses"]
  assert fp8["losses"][-1] < fp8["losses"][0] - 0.3


def test_fp8_flag_errors():
  with pytest.raises(SystemExit, match=r"d_model \(emb_dim\) and d_ff \(moe_mlp_dim\) must be multiples of 128"):
    train_moe.main(TINY + ["--quantization", "fp8", "--impl", "xla"])


@pytest.mark.slow  # a training run (tests/test_fp8_overlap.py has the layer and the module)
def test_fp8_trains_on_the_default_impl():
  """--quantization fp8 with the default impl (overlap: FP8 rows through the dispatch custom call, the FP8 grouped
  GEMM's CPU emulation), with its start-up check of a layer against impl=reference: a few steps, the loss
  falling."""
  steps = ["--steps", "4"]
  base = [a for a in TINY if a != "--skip-check"] + FP8_TINY[:6] + ["--dtype", "bfloat16", "--quantization", "fp8"]
  overlap = train_moe.main(base + steps)
  assert np.all(np.isfinite(overlap["losses"])) and overlap["losses"][-1] < overlap["losses"][0]
