"""Environment overrides of the library's defaults, read here and nowhere else.

Every value is read when the default is needed (a ``CallConfig`` or workspace being built), so a variable set by a
script before that point applies. The values travel on as ``CallConfig`` fields (custom-call attributes) or workspace
arguments; no launch code reads the environment.

  JMO_TIMEOUT_MS        CallConfig.timeout_ms (default 10000)
  JMO_FIRST_CALL_TIMEOUT_MS  CallConfig.first_call_timeout_ms (default 60000)
  JMO_CONSUMER_COPY     "plain": CallConfig.consumer_tuning.bulk_copy = False (ordinary loads and stores)
  JMO_PUSH_SLOTS        CallConfig.consumer_tuning.slots (default 12)
  JMO_PUSH_READ_LAG     CallConfig.consumer_tuning.read_lag (default 4)
  JMO_PUSH_ISSUERS      CallConfig.consumer_tuning.issuers (default 4)
  JMO_CONSUMER_CTAS     the CUDA workspace's fixed consumer CTA count (default: SMs / 8)
  JMO_CALIBRATION       a resource-model calibration file, or "none" (default: the shipped one of the GPU)
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
  value = os.environ.get(name, "")
  if not value:
    return default
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"jax_moe_overlap: ${name} must be an integer, got {value!r}") from None


def timeout_ms() -> int:
  return _int("JMO_TIMEOUT_MS", 10000)


def first_call_timeout_ms() -> int:
  return _int("JMO_FIRST_CALL_TIMEOUT_MS", 60000)


def consumer_bulk_copy() -> bool:
  # Any value but "plain" is refused rather than read as the default, so that a misspelt one is not ignored.
  value = os.environ.get("JMO_CONSUMER_COPY", "")
  if value not in ("", "plain"):
    raise ValueError(f"jax_moe_overlap: $JMO_CONSUMER_COPY must be 'plain' (16-byte loads and stores instead of "
                     f"TMA bulk copies) or unset, got {value!r}")
  return value != "plain"


def push_slots() -> int:
  return _int("JMO_PUSH_SLOTS", 12)


def push_read_lag() -> int:
  return _int("JMO_PUSH_READ_LAG", 4)


def push_issuers() -> int:
  return _int("JMO_PUSH_ISSUERS", 4)


def fixed_consumer_ctas() -> int | None:
  """The fixed consumer CTA count set by $JMO_CONSUMER_CTAS (at least 1), or None."""
  value = _int("JMO_CONSUMER_CTAS", 0)
  return max(1, value) if os.environ.get("JMO_CONSUMER_CTAS") else None


def calibration() -> str:
  """$JMO_CALIBRATION: a path, "none", or "" (the shipped calibration)."""
  return os.environ.get("JMO_CALIBRATION", "")
