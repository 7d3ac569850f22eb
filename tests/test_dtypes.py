"""The handlers' dtype table (ffi/common/dtype.h): a custom call whose operands have a dtype the table does not hold
is refused by the shape check every handler shares (common/call_signature.h's DTypeOf), naming the table's dtypes,
instead of being computed as another dtype. Called through jax.ffi directly: the Python wrappers refuse such dtypes
before the handler sees them."""

import jax
import jax.numpy as jnp
import pytest

from jax_moe_overlap import _ffi
from jax_moe_overlap import grouped_gemm

REFUSED = r"must share one dtype, float32 or bfloat16"


def _call(target, outs, *operands, **attrs):
  _ffi.register()
  return jax.block_until_ready(jax.ffi.ffi_call(target, outs, vmap_method="sequential")(*operands, **attrs))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.int16])
def test_grouped_gemm_handlers_refuse_a_dtype_outside_the_table(dtype):
  lhs, sizes = jnp.ones((4, 8), dtype), jnp.array([3, 1], jnp.int32)
  with pytest.raises(Exception, match=r"grouped_matmul: lhs and rhs " + REFUSED):
    _call(grouped_gemm.GROUPED_MATMUL, jax.ShapeDtypeStruct((4, 8), dtype), lhs, jnp.ones((2, 8, 8), dtype), sizes,
          transpose_rhs=False)
  with pytest.raises(Exception, match=r"grouped_outer: lhs and rhs " + REFUSED):
    _call(grouped_gemm.GROUPED_OUTER, jax.ShapeDtypeStruct((2, 8, 8), dtype), lhs, jnp.ones((4, 8), dtype), sizes)
  with pytest.raises(Exception, match=r"grouped_matmul_swiglu: lhs, rhs and h " + REFUSED):
    _call(grouped_gemm.GROUPED_MATMUL_SWIGLU,
          (jax.ShapeDtypeStruct((4, 4), dtype), jax.ShapeDtypeStruct((4, 8), jnp.float32)), lhs,
          jnp.ones((2, 8, 8), dtype), sizes)


def test_grouped_matmul_handler_takes_the_table_dtypes():
  # The same call in each dtype of the table runs (the refusal above is the dtype's, not the call's).
  sizes = jnp.array([3, 1], jnp.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    lhs, rhs = jnp.ones((4, 8), dtype), jnp.ones((2, 8, 8), dtype)
    out = _call(grouped_gemm.GROUPED_MATMUL, jax.ShapeDtypeStruct((4, 8), dtype), lhs, rhs, sizes,
                transpose_rhs=False)
    assert float(out.astype(jnp.float32).sum()) == 4 * 8 * 8
