"""examples/train_moe.py with impl="xla" and the model-scale preset's argument handling (the preset's run itself
needs GPUs)."""

import numpy as np
import train_moe  # examples/train_moe.py (examples/ is on pytest's pythonpath)

TINY = ["--steps", "12", "--layers", "2", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--experts", "8",
        "--top-k", "2", "--capacity-factor", "1.25", "--seq-len", "32", "--batch-size", "8", "--eval-batches", "2",
        "--no-progress", "--plot", "", "--skip-check"]


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
