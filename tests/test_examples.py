"""The examples: a short training run of a tiny MoE transformer on 4 CPU devices, overlap vs reference, checkpoint
resume, and generation from the checkpoint. The scripts run in this process (their main(argv)), so that runs of the
same model share compiled steps."""

import generate  # examples/generate.py (examples/ is on pytest's pythonpath, as a script's own folder is)
import jax
import model as model_lib  # examples/model.py
import numpy as np
import pytest
import step_profile  # examples/step_profile.py
import train_moe  # examples/train_moe.py

STEPS = 30
TINY = ["--steps", str(STEPS), "--layers", "2", "--d-model", "64", "--heads", "4", "--d-ff", "128",
        "--experts", "8", "--top-k", "2", "--capacity-factor", "1.25", "--seq-len", "32", "--batch-size", "8",
        "--lr", "3e-3", "--eval-batches", "4", "--seed", "0", "--no-progress"]


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
  """The uninterrupted 30-step run with impl=overlap; it leaves a checkpoint of step 30 and a loss-curve PNG, and
  profiles steps 2 and 3 (the resumed run, which does not, checks that this changes no loss)."""
  d = tmp_path_factory.mktemp("overlap")
  out = train_moe.main(TINY + ["--impl", "overlap", "--ckpt-dir", str(d / "ckpt"), "--plot", str(d / "loss.png"),
                               "--profile-steps", "2"])
  return out, d


def test_loss_falls_clearly(overlap_run):
  out, d = overlap_run
  losses = np.asarray(out["losses"])
  assert losses.shape == (STEPS,) and np.all(np.isfinite(losses))
  assert abs(losses[0] - np.log(256)) < 0.5, losses[0]          # starts near uniform over bytes
  assert losses[-5:].mean() < 0.8 * losses[0], losses            # ~5.5 -> ~3.1 in 30 steps
  assert out["eval_loss"] < 0.8 * losses[0], out["eval_loss"]    # and on the held-out text
  dropped = np.asarray(out["dropped"])
  assert np.all((dropped >= 0) & (dropped < 0.5)), dropped
  png = (d / "loss.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow  # a second 30-step run; tests/test_moe.py compares the two layers call by call
def test_overlap_and_reference_train_the_same(overlap_run):
  out, _ = overlap_run
  ref = train_moe.main(TINY + ["--impl", "reference", "--plot", ""])
  # Same init, data and routing; only float32 summation order differs between the custom calls and plain JAX.
  np.testing.assert_allclose(ref["losses"], out["losses"], rtol=0, atol=2e-3)
  np.testing.assert_allclose(ref["dropped"], out["dropped"], rtol=0, atol=1e-2)
  np.testing.assert_allclose(ref["eval_loss"], out["eval_loss"], rtol=0, atol=2e-3)


@pytest.mark.slow  # two more training runs (15 steps, then 15 resumed); the default pass keeps restoring the checkpoint
def test_resume_continues_the_same_curve(overlap_run, tmp_path):
  out, _ = overlap_run
  ckpt = str(tmp_path / "ckpt")
  first = train_moe.main(TINY + ["--ckpt-dir", ckpt, "--stop-at", "15", "--plot", ""])
  assert len(first["losses"]) == 15
  with pytest.raises(SystemExit):     # an existing checkpoint is never silently overwritten or ignored
    train_moe.main(TINY + ["--ckpt-dir", ckpt, "--plot", ""])
  resumed = train_moe.main(TINY + ["--ckpt-dir", ckpt, "--resume", "--plot", ""])
  # The history of the first 15 steps comes from the checkpoint; steps 16..30 are recomputed after the restore.
  assert len(resumed["losses"]) == STEPS
  np.testing.assert_allclose(resumed["losses"], out["losses"], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(resumed["eval_loss"], out["eval_loss"], rtol=1e-6)


def test_generate_from_checkpoint(overlap_run, capsys):
  _, d = overlap_run
  ckpt = str(d / "ckpt")
  greedy = generate.main(["--ckpt-dir", ckpt, "--prompt", "the ", "--max-new-tokens", "16"])
  assert len(greedy) == 1 and len(greedy[0]) == 16
  samples = generate.main(["--ckpt-dir", ckpt, "--prompt", "the ", "--max-new-tokens", "32", "--temperature", "1",
                           "--num-samples", "3", "--seed", "1"])
  assert len(samples) == 3 and all(len(s) == 32 for s in samples)
  assert len(set(samples)) > 1                                   # sampling, not greedy
  # The restored model has learned the byte distribution of English text: an untrained one samples about uniformly
  # from 256 bytes (~37% of them printable ASCII); this one almost only printable ASCII.
  text = b"".join(samples)
  printable = sum(32 <= b < 127 or b in (9, 10) for b in text) / len(text)
  assert printable > 0.9, text
  assert "the " in capsys.readouterr().out


@pytest.mark.slow
def test_training_script_runs_as_a_program(tmp_path):
  """The README's first command goes through the script's own argument parsing (sys.argv), which the in-process
  tests above bypass: run it as a program, briefly, and check it trains and reports its throughput."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_moe.py")
  proc = subprocess.run([sys.executable, script, "--steps", "3", "--no-progress", "--skip-check", "--plot", ""],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "throughput impl=overlap" in proc.stdout and "step 3: train loss" in proc.stdout, proc.stdout[-3000:]


def test_step_profile_attributes_the_device_time(overlap_run):
  """--profile-steps: every part of the model gets device time from the trace, this library's custom calls among
  them, and the parts add up to the busy time; the CPU run's attention is XLA's."""
  out, _ = overlap_run
  assert out["attention"] == "xla"
  prof = out["profile"]
  assert prof["steps"] == 2 and prof["devices"] == 4
  assert all(prof["ms"][part] > 0 for part in step_profile.PARTS), prof["ms"]
  assert all(op.startswith("jmo_") for op, _ in prof["top_ops"]["routed_experts"]), prof["top_ops"]
  assert np.isclose(prof["busy_ms"], sum(prof["ms"].values()))
  assert 0 < prof["busy_ms"] and 0 < prof["wall_ms"]
  text = step_profile.format_table(prof, train_moe.part_flops(model_lib.ModelConfig(), 64.0))
  assert "this library's custom calls" in text and "TFLOP/s" in text


def test_hlo_parts_follow_scopes_and_targets():
  """Ops are attributed by custom-call target first (this library's, cuDNN's attention), then by the named scope
  in their metadata, in the forward pass and under transpose/jvp in the backward pass."""
  hlo = "\n".join([
      "HloModule jit_train_step, is_scheduled=true",
      "ENTRY %main.1 (p: f32[8]) -> f32[8] {",
      '  %custom-call.3 = f32[8] custom-call(%p), custom_call_target="jmo_dispatch", metadata={op_name="jit(s)/moe/x"}',
      '  %fusion.1 = f32[8] fusion(%p), kind=kLoop, metadata={op_name="jit(s)/transpose(jvp(moe))/dot_general"}',
      '  %fusion.2 = f32[8] fusion(%p), kind=kLoop, metadata={op_name="jit(s)/jvp(attention)/exp"}',
      '  %custom-call.4 = f32[8] custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="p"}',
      '  %fusion.3 = f32[8] fusion(%p), kind=kLoop, metadata={op_name="jit(s)/moe_like/attention_free/add"}',
      "  ROOT %copy.1 = f32[8] copy(%p)",
      "}"])
  module, parts = step_profile.hlo_parts(hlo, moe_scope="moe", attention_scope="attention")
  assert module == "jit_train_step"
  assert parts == {"custom-call.3": "routed_experts", "fusion.1": "moe_other", "fusion.2": "attention",
                   "custom-call.4": "attention", "fusion.3": "rest", "copy.1": "rest"}


def test_profiled_step_turns_off_command_buffers_only_on_gpus():
  """The profiled step's executable compiles with XLA:GPU command buffers off on GPUs and with no option elsewhere;
  XLA's compile-option parser (the same DebugOptions on every backend) takes the GPU options by name and value."""
  for platform in ("gpu", "cuda", "rocm"):
    assert step_profile.compiler_options(platform) == {"xla_gpu_enable_command_buffer": ""}
  assert step_profile.compiler_options("cpu") == {}
  lowered = jax.jit(lambda x: x * 2.0).lower(jax.numpy.ones(4))
  assert lowered.compile(compiler_options=step_profile.GPU_COMPILER_OPTIONS) is not None
  with pytest.raises(Exception, match="not a valid"):   # the value is parsed as the list of op types it is
    lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": "NO_SUCH_OP_TYPE"})


class _Event:
  def __init__(self, start_ns, end_ns, **stats):
    self.start_ns, self.end_ns, self.duration_ns, self.stats = start_ns, end_ns, end_ns - start_ns, stats.items()


class _Named:
  def __init__(self, name, **kw):
    self.name = name
    self.__dict__.update(kw)


def test_device_time_of_ops_the_hlo_lacks_is_counted_as_unnamed():
  """GPU events are attributed through the HLO's instructions; an event of an op the HLO text lacks (a CUDA graph's
  kernels carry only the graph's name) or of no op counts as rest and as unnamed, so the table says how much of the
  device time no instruction explains. Events of other modules and the "XLA Ops" line are left out."""
  parts = {"custom-call.4": "attention", "ffi_call.1": "routed_experts", "fusion.2": "rest"}
  m = "jit_train_step"
  stream = [_Event(0, 100, hlo_module=m, hlo_op="custom-call.4"),      # a cuDNN kernel under its custom call
            _Event(100, 130, hlo_module=m, hlo_op="ffi_call.1"),
            _Event(130, 170, hlo_module=m, hlo_op="command_buffer_7"),   # a CUDA graph's kernel
            _Event(170, 175, hlo_module=m),                              # a copy without an op
            _Event(175, 185, hlo_module=m, hlo_op="fusion.2"),
            _Event(185, 999, hlo_module="jit_eval_step", hlo_op="fusion.2")]
  ops_line = [_Event(0, 185, hlo_module=m, hlo_op="custom-call.4")]
  data = _Named("data", planes=[_Named("/device:GPU:0", lines=[_Named("Stream #13", events=stream),
                                                               _Named("XLA Ops", events=ops_line)]),
                                _Named("/host:CPU", lines=[_Named("python", events=ops_line)])])
  got = step_profile.device_time_by_part(data, m, parts)
  assert got["ns"] == {"routed_experts": 30, "moe_other": 0, "attention": 100, "rest": 55}
  assert got["unnamed_ns"] == 45 and got["device_planes"] == 1
  assert got["ops"]["rest"] == {"command_buffer_7": 40, "fusion.2": 10}


def test_overlapping_kernel_times_on_a_stream_do_not_nest():
  """A stream's kernels whose recorded times overlap by a little each keep their own duration (nesting the second in
  the first took its whole time off the first: parts with negative times); host thunks still nest."""
  parts = {"ffi_call.1": "routed_experts", "fusion.2": "moe_other"}
  m = "jit_train_step"
  stream = [_Event(0, 100, hlo_module=m, hlo_op="ffi_call.1"), _Event(99, 400, hlo_module=m, hlo_op="fusion.2")]
  gpu = _Named("data", planes=[_Named("/device:GPU:0", lines=[_Named("Stream #14", events=stream)])])
  got = step_profile.device_time_by_part(gpu, m, parts)
  assert got["ns"]["routed_experts"] == 100 and got["ns"]["moe_other"] == 301, got
  host = _Named("data", planes=[_Named("/host:CPU", lines=[_Named("worker", events=[
      _Event(0, 100, hlo_module=m, hlo_op="fusion.2"), _Event(10, 40, hlo_module=m, hlo_op="ffi_call.1")])])])
  got = step_profile.device_time_by_part(host, m, parts)
  assert got["ns"]["moe_other"] == 70 and got["ns"]["routed_experts"] == 30, got


@pytest.mark.parametrize("flags, rule", [
    (["--mesh", "expert=1,tensor=4", "--d-ff", "130"],
     "the experts' hidden width F=130 cannot be split evenly over the 4 devices of tensor axis 'tensor'"),
    (["--mesh", "data=2,expert=2", "--experts", "7"], "7 experts cannot be split evenly over the 2 devices of mesh axis"),
    (["--heads", "5"], "d_model=64 is not divisible by num_heads=5"),
    (["--seq-len", "0"], "seq_len=0: at least 1"),
    (["--save-every", "0"], "--save-every 0: at least 1"),
    (["--stop-at", "0"], "--stop-at 0: at least 1"),
    (["--stop-at", "-1"], "--stop-at -1: at least 1"),
    (["--lr", "nan"], "--lr nan: must be a positive finite number"),
    (["--mesh", "expert=3"], "mesh 'expert=3' has 3 devices, but 4 are in use"),
    (["--mesh", "=1,expert=4"], "mesh '=1,expert=4': expected axis=size pairs separated by commas"),
    (["--mesh", "data=2,exprt=2"], "mesh 'data=2,exprt=2' has no axis named 'expert'"),
    (["--mesh", "expert=2,data=1,data=2"], "mesh 'expert=2,data=1,data=2' names axis 'data' more than once"),
    (["--data", "/nonexistent/text.txt"], "--data /nonexistent/text.txt: No such file or directory"),
    (["--mesh", "data=0,expert=4"], "mesh 'data=0,expert=4': data=0: every axis needs a size of at least 1"),
    (["--d-model", "12", "--heads", "4"], "d_model=12 / num_heads=4 = 3: the head width must be even"),
    (["--devices", "0"], "--devices 0: at least 1"),
    (["--devices", "-1"], "--devices -1: at least 1"),
    (["--warmup", "-5"], "--warmup -5: at least 0"),
    (["--history-out", "/nonexistent/h.json"], "--history-out /nonexistent/h.json: no directory /nonexistent"),
    (["--plot", "/nonexistent/p.png"], "--plot /nonexistent/p.png: no directory /nonexistent"),
])
def test_training_refuses_bad_flags_in_one_line(flags, rule):
  """Flags the model or the library's layer rules refuse end the script with one line naming the rule (the
  library's own message for its rules), before anything is built: no traceback."""
  with pytest.raises(SystemExit) as e:
    train_moe.main(TINY + ["--plot", ""] + flags)
  msg = str(e.value)
  assert rule in msg and "\n" not in msg, msg


def test_training_refuses_a_short_text_or_a_file_as_checkpoint_directory(tmp_path):
  """A --data text too short to hold out a block, and a --ckpt-dir that is a file, are refused in one line naming the
  rule, before the training (a file would fail only at the first checkpoint)."""
  short, empty, a_file = tmp_path / "short.txt", tmp_path / "empty.txt", tmp_path / "file"
  short.write_bytes(b"x" * 18432)
  empty.write_bytes(b"")
  a_file.write_text("")
  for flags, rule in [(["--data", str(short)], f"--data {short}: the text has 18432 bytes; it needs at least 18433: "
                                               "every 10th block of 2048 bytes is held out for evaluation"),
                      (["--data", str(empty)], "the text has 0 bytes; it needs at least 18433"),
                      (["--ckpt-dir", str(a_file)], f"--ckpt-dir {a_file}: exists and is not a directory")]:
    with pytest.raises(SystemExit) as e:
      train_moe.main(TINY + ["--plot", ""] + flags)
    assert rule in str(e.value) and "\n" not in str(e.value), (flags, str(e.value))
  with pytest.raises(SystemExit, match="--devices 0: at least 1"):   # generate.py's mesh too, before any checkpoint
    generate.main(["--ckpt-dir", str(tmp_path), "--devices", "0"])


def test_a_step_after_an_evaluation_shows_no_rate(capsys):
  """A step that follows an evaluation is not timed, so its log line shows "-" as tokens/s, not the rate of the
  step before the evaluation. (--steps 30 --stop-at 3: the schedule, and so the compiled step, of the other runs.)"""
  train_moe.main(TINY + ["--stop-at", "3", "--eval-every", "2", "--log-every", "1", "--skip-check", "--plot", ""])
  rate = {l.split(":")[0]: l.split("tokens/s ")[1].split()[0] for l in capsys.readouterr().out.splitlines()
          if l.startswith("step ") and "tokens/s" in l}
  assert rate["step 1"] == "-" and rate["step 2"] != "-", rate      # the first step compiles, the second is timed
  assert rate["step 3"] == "-", rate                                # after the evaluation at step 2


def test_zero_steps_report_the_initial_held_out_loss(capsys):
  """--steps 0 (allowed: the untrained model's held-out loss) says that no step ran: no NaN train loss, no numpy
  warning about an empty mean."""
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    out = train_moe.main(TINY + ["--steps", "0", "--skip-check", "--plot", ""])
  text = capsys.readouterr().out
  assert out["losses"] == [] and np.isfinite(out["eval_loss"])
  assert "step 0: no train step ran, held-out loss" in text and "nan" not in text, text


def test_generation_refuses_bad_flags_in_one_line(overlap_run, tmp_path):
  _, d = overlap_run
  ckpt = str(d / "ckpt")
  for flags, rule in [(["--devices", "3"], "8 experts cannot be split evenly over the 3 devices of mesh axis"),
                      (["--mesh", "expert=2"], "mesh 'expert=2' has 2 devices, but 4 are in use"),
                      (["--num-samples", "0"], "--num-samples 0: at least 1"),
                      (["--top-p", "0"], "--top-p 0.0: in (0, 1]"),
                      (["--mesh", "expert=2,tensor=2"], "without a 'tensor' axis, so its w1 are stored as [E, D, 2F]")]:
    with pytest.raises(SystemExit) as e:
      generate.main(["--ckpt-dir", ckpt] + flags)
    assert rule in str(e.value) and "\n" not in str(e.value), (flags, str(e.value))
  with pytest.raises(SystemExit, match="no checkpoint directory"):
    generate.main(["--ckpt-dir", str(tmp_path / "none")])


def test_resume_refuses_another_model_or_layout_in_one_line(overlap_run):
  """A resume whose flags give the experts other shapes is refused naming what differs, before orbax reads an
  array (whose own error would speak of shapes only), and so is one whose run ends before the checkpoint's step;
  each leaves the checkpoint as it was."""
  _, d = overlap_run
  ckpt = str(d / "ckpt")
  for flags, rule in [(["--experts", "4"], "num_experts 8 (checkpoint) -> 4 (flags)"),
                      (["--mesh", "expert=2,tensor=2"], "without a 'tensor' axis, so its w1 are stored as [E, D, 2F]"),
                      (["--stop-at", "10"], f"holds step {STEPS}, past this run's last step 10 (--steps {STEPS}, "
                                            "--stop-at 10): nothing to resume")]:
    with pytest.raises(SystemExit) as e:
      train_moe.main(TINY + ["--ckpt-dir", ckpt, "--resume", "--plot", ""] + flags)
    assert rule in str(e.value) and "\n" not in str(e.value), (flags, str(e.value))
  assert model_lib.read_meta(ckpt)[0] == STEPS


def test_checkpoint_layout_follows_the_tensor_axis():
  """w1 is stored as [E, D, 2, F] by a run with a 'tensor' axis and as [E, D, 2F] without: a checkpoint restores
  onto a mesh with a tensor axis exactly when it was trained on one."""
  flat, split = jax.make_mesh((4,), ("expert",)), jax.make_mesh((2, 2), ("expert", "tensor"))
  for trained in (None, "expert=4", "data=2,expert=2"):
    model_lib.check_checkpoint_mesh({"args": {"mesh": trained}}, flat, "ck")
    with pytest.raises(ValueError, match="without a 'tensor' axis"):
      model_lib.check_checkpoint_mesh({"args": {"mesh": trained}}, split, "ck")
  model_lib.check_checkpoint_mesh({"args": {"mesh": "expert=2,tensor=2"}}, split, "ck")
  with pytest.raises(ValueError, match="with a 'tensor' axis, so its w1 are stored as \\[E, D, 2, F\\]"):
    model_lib.check_checkpoint_mesh({"args": {"mesh": "expert=2,tensor=2"}}, flat, "ck")


def test_throughput_line_states_the_flops_per_token(capsys):
  """The model FLOPs per token keep three significant digits: the CPU default's few MFLOP do not print as 0.00."""
  args = train_moe.parse_args(["--plot", ""])
  cfg = train_moe.model_config(args)
  train_moe.report_throughput(cfg, args, [0.5], 1024, 4)
  out = capsys.readouterr().out
  got = float(out.split(" GFLOP/token")[0].rsplit(" ", 1)[-1])
  assert got == pytest.approx(cfg.flops_per_token() / 1e9, rel=5e-3), out
  train_moe.report_throughput(cfg, args, [], 1024, 4)   # --eval-every 1: every step follows an evaluation
  assert "--eval-every" in capsys.readouterr().out
  # With FP8 experts the MFU is also stated against the FP8 peak and against the mixed peak (the routed experts'
  # FLOPs at the FP8 peak, the rest at the bf16 one).
  args = train_moe.parse_args(["--plot", "", "--d-model", "128", "--d-ff", "128", "--quantization", "fp8",
                               "--peak-tflops", "0.01", "--peak-tflops-fp8", "0.02"])
  cfg = train_moe.model_config(args)
  train_moe.report_throughput(cfg, args, [0.5], 1024, 4)
  out = capsys.readouterr().out
  flops, tok_s = cfg.flops_per_token_by_part(), 1024 / 0.5
  mfu = lambda text: float(out.split(text)[0].rsplit(" ", 1)[-1].rstrip("%")) / 100
  assert mfu(" of 0.01 TFLOP/s x 4") == pytest.approx(sum(flops.values()) * tok_s / 0.04e12, abs=5e-4), out
  fp8_peak = sum(flops.values()) * tok_s / 0.08e12
  assert mfu(" of the FP8 peak (0.02 TFLOP/s)") == pytest.approx(fp8_peak, abs=5e-4), out
  mixed = (flops.pop("routed_experts") / 0.02 + sum(flops.values()) / 0.01) * tok_s / 4e12
  assert mfu(" of the mixed peak") == pytest.approx(mixed, abs=5e-4), out
  # An untimed step's rate reads "-" in the log lines as in the progress bar, not "nan".
  assert train_moe.tokens_per_s(float("nan")) == "-" and train_moe.tokens_per_s(12345.6) == "12,346"


@pytest.mark.slow
def test_bad_flags_exit_nonzero_as_a_program(tmp_path):
  """As a program, a refused flag is one line on stderr and exit status 1."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_moe.py")
  proc = subprocess.run([sys.executable, script, "--mesh", "expert=2,tensor=2", "--d-ff", "33", "--plot", ""],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "F=33" in proc.stderr, proc.stderr[-3000:]


def test_gpu_preset_evaluates_on_the_shipped_text():
  """The README's GPU line (--preset gpu, no --data): the held-out text of the shipped data holds fewer than 32
  windows of 1025 bytes, so the evaluation takes one batch of as many whole windows as divide by the devices; a
  text too short for one window per device is refused with the rule."""
  _, held = model_lib.load_text()
  preset = train_moe.PRESETS["gpu"]
  windows = (len(held) - 1) // preset["seq_len"]
  assert windows < preset["batch_size"]
  for devices in (1, 2, 4, 8):
    batches = model_lib.eval_batches(held, preset["batch_size"], preset["seq_len"], preset["eval_batches"],
                                     multiple_of=devices)
    assert len(batches) == 1 and len(batches[0]) == windows - windows % devices
    assert batches[0].shape[1] == preset["seq_len"] + 1
    np.testing.assert_array_equal(batches[0][1, :-1], held[preset["seq_len"]:2 * preset["seq_len"]])
  full = model_lib.eval_batches(held, 8, 32, 4, multiple_of=4)      # long enough: whole batches, as many as asked
  assert [b.shape for b in full] == [(8, 33)] * 4
  with pytest.raises(ValueError, match="needs at least 16"):
    model_lib.eval_batches(held[:3000], 32, 1024, 2, multiple_of=16)


def test_attention_is_chosen_once_xla_on_cpu():
  cfg = model_lib.ModelConfig(dtype="bfloat16")
  mesh = model_lib.make_mesh()
  assert model_lib.choose_attention(cfg, mesh, 8) == ("xla", "cuDNN attention needs a GPU, the backend is cpu")
  assert model_lib.choose_attention(cfg, mesh, 8, "xla")[0] == "xla"
  with pytest.raises(ValueError, match="--attention cudnn does not apply: cuDNN attention needs a GPU"):
    model_lib.choose_attention(cfg, mesh, 8, "cudnn")
  assert jax.default_backend() == "cpu"
