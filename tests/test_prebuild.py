"""tests/gpu/source_hash.sh, by which build_gpu.sh takes tools/prebuild.sh's builds only for the sources they came
from: a copy of the tree hashes the same, a changed CUDA or C++ source or CMake file changes it, a Python file or a
shell script does not (the device takes those from the tree)."""

import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _hash(tree: pathlib.Path) -> str:
  out = subprocess.run(["bash", str(tree / "tests" / "gpu" / "source_hash.sh")], capture_output=True, text=True,
                       check=True, timeout=60).stdout.strip()
  assert len(out) == 32, out
  return out


def test_the_hash_follows_the_compiled_sources_only(tmp_path):
  tree = tmp_path / "tree"
  tracked = subprocess.run(["git", "ls-files", "ffi", "tools", "tests/gpu/source_hash.sh", "CMakeLists.txt",
                            "pyproject.toml"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  for rel in tracked:
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / rel, tree / rel)
  base = _hash(tree)
  assert base == _hash(ROOT)                                   # the same files elsewhere: the same hash
  (tree / "tools" / "loopback" / "run.py").write_text("# changed\n")
  (tree / "tools" / "prebuild.sh").write_text("# changed\n")
  (tree / "tools" / "loopback" / "_jmo_loopback.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\0")
  assert _hash(tree) == base
  cu = next(p for p in sorted((tree / "ffi").rglob("*.cu")))
  cu.write_text(cu.read_text() + "\n// changed\n")
  assert _hash(tree) != base
