"""tools/ab_outputs.py's comparison: differing elements counted, ulps across zero and in float8, identical dumps 0."""
import ml_dtypes
import numpy as np

from tools import ab_outputs


def _dump(path, **arrays):
  ab_outputs.save(path, arrays)


def test_compare_counts_elements_and_ulps(tmp_path, capsys):
  f = np.array([1.0, -1.0, 0.0, 2.0], np.float32)
  e = np.array([1.0, -2.0, 0.5], ml_dtypes.float8_e4m3fn)
  _dump(tmp_path / "a.npz", f=f, e=e)
  _dump(tmp_path / "same.npz", f=f.copy(), e=e.copy())
  g = f.copy()
  g[0] = np.nextafter(np.float32(1), np.float32(2))       # 1 ulp
  g[2] = -np.float32(1e-45)                                 # across zero: 0 -> -smallest subnormal, 1 ulp
  e2 = e.copy()
  e2[1] = ml_dtypes.float8_e4m3fn(-2.25)                    # the next e4m3 magnitude above 2: 1 ulp
  _dump(tmp_path / "b.npz", f=g, e=e2)
  assert ab_outputs.compare(tmp_path / "a.npz", tmp_path / "same.npz") == 0
  assert ab_outputs.compare(tmp_path / "a.npz", tmp_path / "b.npz") == 2
  lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[-2:]}
  assert "2 of         4 elements differ, at most 1 ulp" in lines["f"]
  assert "1 of         3 elements differ, at most 1 ulp" in lines["e"]


def test_an_output_only_one_dump_holds_is_named_and_a_failing_case_left_out(tmp_path, monkeypatch, capsys):
  def broken():
    raise AttributeError("module has no attribute 'new_kernel'")
  monkeypatch.setattr(ab_outputs, "cases", lambda: {"old": lambda: {"old": np.arange(4, dtype=np.float32)},
                                                    "new": broken})
  ab_outputs.dump(tmp_path / "base.npz")
  assert "new: not run: AttributeError" in capsys.readouterr().out
  _dump(tmp_path / "new.npz", old=np.arange(4, dtype=np.float32), new=np.ones(2, np.float32))
  assert ab_outputs.compare(tmp_path / "base.npz", tmp_path / "new.npz") == 3
  assert "not compared: new (only in" in capsys.readouterr().out
