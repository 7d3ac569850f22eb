"""jax_moe_overlap.build_info() reports what the loaded extension was compiled with."""

import jax

import jax_moe_overlap as jmo
from jax_moe_overlap import _ffi


def test_build_info_describes_the_loaded_extension():
  info = jmo.build_info()
  assert set(info) >= {"cuda", "cuda_version", "cuda_archs", "cuda_compiler", "cxx_compiler", "build_type",
                       "jax_version", "xla_ffi_api", "extension"}, info
  assert info["cuda"] is _ffi.with_cuda()
  assert info["extension"] == _ffi._jmo.__file__
  assert info["cxx_compiler"], info
  major, minor = (int(v) for v in info["xla_ffi_api"].split("."))
  assert major >= 0 and minor >= 0, info
  if info["cuda"]:
    assert info["cuda_version"].split(".")[0].isdigit() and info["cuda_compiler"], info
    assert info["cuda_archs"] and all(a.startswith(("sm_", "compute_", "-gencode")) for a in info["cuda_archs"]), info
  else:
    assert info["cuda_version"] == "" and info["cuda_archs"] == [], info
  # The extension compiles against the FFI headers of the jax it is built with (here: the environment's).
  assert info["jax_version"].split(".")[:2] == jax.__version__.split(".")[:2], (info, jax.__version__)
