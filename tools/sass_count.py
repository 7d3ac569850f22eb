"""A kernel's SASS instructions counted by region: the whole kernel, its k-loop (the loop around its wgmma
instructions) and its epilogue (from the k-loop's back-branch to the tile loop's), each by opcode, with the branch
regions (BSSY) and local-memory accesses (spills: LDL, STL) that a change can add. Static counts, not executed ones:
what compiles for a GPU can be compared before and after a change on a machine without one.

  nvcc ... -cubin -o /tmp/k.cubin ffi/cuda/ops/grouped_gemm.cu          # the library's flags (tools/ptxas_usage.sh)
  python3 -m tools.sass_count /tmp/k.cubin GroupedSwiGluFp8Kernel [--cuobjdump PATH]

cuobjdump comes with a CUDA toolkit; where the toolkit lacks it (nvcc alone), PyPI's `nvidia-cuda-cuobjdump` wheel
holds it (`pip download --no-deps nvidia-cuda-cuobjdump`, unzip, nvidia/cu*/bin/cuobjdump).
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_TARGET = re.compile(r"\bBRA(?:\.\w+)*\s+(?:[!A-Z0-9_]+,\s*)?0x([0-9a-f]+)")


def instructions(sass: str):
  """[(address, text)] of one function's SASS listing (cuobjdump -sass), in address order."""
  return [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(sass)]


def opcode(text: str) -> str:
  """The opcode without predicate or modifiers: '@!P0 BRA 0x10' -> 'BRA', 'FFMA.FTZ R1, ...' -> 'FFMA'."""
  return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def _back_branch(ins, after: int, before: int):
  """The first branch past `after` whose target lies at or before `before`: (its address, its target)."""
  for a, t in ins:
    m = _TARGET.search(t)
    if a > after and m and "BRA.DIV" not in t and int(m.group(1), 16) <= before:
      return a, int(m.group(1), 16)
  return None


def regions(ins):
  """{'kernel': [...], 'k-loop': [...], 'epilogue': [...]} of instruction texts. The k-loop: from the target of the
  first back-branch after the last wgmma instruction (GMMA) to that branch; the epilogue: from there to the next
  branch back to before the first wgmma. Without wgmma instructions only 'kernel'."""
  out = {"kernel": [t for _, t in ins]}
  gmma = [a for a, t in ins if "GMMA" in t]
  if not gmma:
    return out
  loop = _back_branch(ins, max(gmma), max(gmma))
  if loop is None:
    return out
  end, start = loop
  out["k-loop"] = [t for a, t in ins if start <= a <= end]
  tile = _back_branch(ins, end, min(gmma))
  if tile is not None:
    out["epilogue"] = [t for a, t in ins if end < a <= tile[0]]
  return out


def summary(texts, top: int = 12) -> str:
  ops = collections.Counter(opcode(t) for t in texts)
  local = ops["LDL"] + ops["STL"]
  common = " ".join(f"{k}:{v}" for k, v in ops.most_common(top))
  return f"{len(texts)} instructions, {ops['BSSY']} branch regions, {local} local (LDL/STL); {common}"


def functions(listing: str):
  """{mangled name: its SASS} of a whole cubin's listing (cuobjdump -sass): each "Function : name" line to the next."""
  parts = re.split(r"Function : (\S+)", listing)
  return dict(zip(parts[1::2], parts[2::2]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("cubin")
  ap.add_argument("kernel", help="a substring of the kernels' mangled names")
  ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
  ap.add_argument("--top", type=int, default=12, help="opcodes listed per region")
  args = ap.parse_args(argv)
  listing = subprocess.run([args.cuobjdump, "-sass", args.cubin], check=True, capture_output=True, text=True).stdout
  found = {n: sass for n, sass in functions(listing).items() if args.kernel in n}
  if not found:
    sys.exit(f"no kernel of {args.cubin} has {args.kernel!r} in its name")
  for name, sass in found.items():
    print(name)
    for region, texts in regions(instructions(sass)).items():
      print(f"  {region:8s} {summary(texts, args.top)}")


if __name__ == "__main__":
  main()
