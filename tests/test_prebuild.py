"""tests/gpu/source_hash.sh, by which build_gpu.sh takes tools/prebuild.sh's builds only for the sources they came
from: a copy of the tree hashes the same, a changed CUDA or C++ source or CMake file changes it, a Python file or a
shell script does not (the device takes those from the tree)."""

import gzip
import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _hash(tree: pathlib.Path) -> str:
  out = subprocess.run(["bash", str(tree / "tests" / "gpu" / "source_hash.sh")], capture_output=True, text=True,
                       check=True, timeout=60).stdout.strip()
  assert len(out) == 32, out
  return out


def _tree_copy(tmp_path) -> pathlib.Path:
  """A copy of the tracked files the GPU build reads (the compiled sources, the package, tests/gpu's scripts)."""
  tree = tmp_path / "tree"
  tracked = subprocess.run(["git", "ls-files", "ffi", "tools", "tests/gpu", "jax_moe_overlap", "CMakeLists.txt",
                            "pyproject.toml"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  for rel in tracked:
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / rel, tree / rel)
  return tree


def test_the_hash_follows_the_compiled_sources_only(tmp_path):
  tree = _tree_copy(tmp_path)
  base = _hash(tree)
  assert base == _hash(ROOT)                                   # the same files elsewhere: the same hash
  (tree / "tools" / "loopback" / "run.py").write_text("# changed\n")
  (tree / "tools" / "prebuild.sh").write_text("# changed\n")
  (tree / "tools" / "loopback" / "_jmo_loopback.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\0")
  assert _hash(tree) == base
  cu = next(p for p in sorted((tree / "ffi").rglob("*.cu")))
  cu.write_text(cu.read_text() + "\n// changed\n")
  assert _hash(tree) != base


def test_build_gpu_takes_the_prebuilt_files_gzipped_or_not(tmp_path):
  """build_gpu.sh's prebuilt branch installs tools/prebuild.sh's gzipped extension and runner unzipped, and an older
  tree's uncompressed ones as they are; it builds nothing (a build would take minutes and fail here)."""
  tree = _tree_copy(tmp_path)
  ext, runner = "_jmo.cpython-312-x86_64-linux-gnu.so", "_jmo_loopback.cpython-312-x86_64-linux-gnu.so"
  for gz in (True, False):
    pre = tmp_path / f"prebuilt-{gz}"
    (pre / "site" / "jax_moe_overlap").mkdir(parents=True)
    blobs = {ext: b"extension " + bytes(range(256)) * 4 + str(gz).encode(), runner: b"runner " + str(gz).encode()}
    for name, path in ((ext, pre / "site" / "jax_moe_overlap" / ext), (runner, pre / runner)):
      if gz:
        pathlib.Path(f"{path}.gz").write_bytes(gzip.compress(blobs[name]))
      else:
        path.write_bytes(blobs[name])
    (pre / "src-hash").write_text(_hash(tree) + "\n")
    (pre / "archs").write_text("90a\n")
    site, out = tmp_path / f"site-{gz}", tmp_path / f"out-{gz}"
    out.mkdir()
    r = subprocess.run(["bash", "-c", "source tests/gpu/build_gpu.sh; echo rc=$?"], cwd=tree, capture_output=True,
                       text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(out), "JMO_SITE": str(site), "JMO_PREBUILT": str(pre)})
    assert "build: prebuilt for sm_90a" in r.stdout and "rc=0" in r.stdout, r.stdout + r.stderr
    assert (site / "jax_moe_overlap" / ext).read_bytes() == blobs[ext]
    assert (site / "jax_moe_overlap" / "__init__.py").exists()
    assert (tree / "tools" / "loopback" / runner).read_bytes() == blobs[runner]
    assert not list(site.rglob("*.gz"))
