#!/usr/bin/env bash
# Prints the ptxas resource usage of every kernel of the CUDA library, one sorted line per (arch, kernel):
#
#   arch  registers  spill_stores  spill_loads  stack  smem  kernel
#
# so that two trees (before and after a change) can be compared with diff:
#
#   bash tools/ptxas_usage.sh ffi > new.txt
#   bash tools/ptxas_usage.sh /path/to/old/tree/ffi > old.txt && diff old.txt new.txt
#
# The argument is the C++/CUDA source root (the folder that holds cuda/ and include/); every .cu under its cuda/ is
# compiled with the library's flags (ffi/cuda/CMakeLists.txt: -O3, -lineinfo, --expt-relaxed-constexpr, C++17) plus
# -Xptxas -v. Kernels with internal linkage (an anonymous namespace) carry a per-file prefix in their mangled name
# (<len>_GLOBAL__N__<hash>_<len>_<file>_cu_<hash>, or _INTERNAL_<hash>_...): it is cut to _GLOBAL__N_ (_INTERNAL_) so
# that moving or renaming a file does not read as a change. A kernel that several files instantiate is listed once per
# file. JMO_CUDA_ARCHS picks the targets as for the
# build (default "80;90a": machine code for each); NVCC the compiler (default nvcc); JOBS the parallel compiles.
set -euo pipefail

root=${1:?usage: ptxas_usage.sh <source root holding cuda/ and include/>}
root=$(cd "$root" && pwd)
nvcc=${NVCC:-nvcc}
jobs=${JOBS:-$(nproc)}
gencode=()
IFS=';, ' read -r -a archs <<< "${JMO_CUDA_ARCHS:-80;90a}"
for a in "${archs[@]}"; do
  [[ -z $a ]] && continue
  a=${a#sm_}
  gencode+=("-gencode=arch=compute_${a},code=sm_${a}")
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export nvcc root tmp
export gencode_flags="${gencode[*]}"
compile_one() {
  local src=$1 log
  log="$tmp/$(echo "${src#$root/}" | tr '/' '_').log"
  # shellcheck disable=SC2086
  "$nvcc" -std=c++17 -O3 -DNDEBUG -lineinfo --expt-relaxed-constexpr -Xcompiler=-fPIC $gencode_flags \
    -I"$root" -I"$root/include" -Xptxas -v -c "$src" -o "$tmp/$(basename "$src").o" > "$log" 2>&1 ||
    { cat "$log" >&2; echo "ptxas_usage.sh: compiling $src failed" >&2; return 1; }
}
export -f compile_one
find "$root/cuda" -name '*.cu' -print0 | sort -z | xargs -0 -n 1 -P "$jobs" bash -c 'compile_one "$0"'

# ptxas -v prints, per function: "Compiling entry function 'NAME' for 'sm_XX'", then (optionally) "Function
# properties for NAME", "N bytes stack frame, N bytes spill stores, N bytes spill loads", then "Used N registers, ...
# N bytes smem, ...". Only entry functions (kernels) are reported.
cat "$tmp"/*.log | awk '
  /Compiling entry function/ {
    match($0, /function \x27[^\x27]*\x27/); name = substr($0, RSTART + 10, RLENGTH - 11)
    match($0, /for \x27[^\x27]*\x27/); arch = substr($0, RSTART + 5, RLENGTH - 6)
    gsub(/[0-9]+_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+/, "_GLOBAL__N_", name)
    gsub(/_INTERNAL_[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+/, "_INTERNAL_", name)
    stack = 0; st = 0; ld = 0; pending = 1; next
  }
  pending && /bytes stack frame/ {
    for (i = 1; i <= NF; ++i) {
      if ($(i + 1) == "bytes" && $(i + 2) == "stack") stack = $i
      if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) ~ /^stores/) st = $i
      if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) ~ /^loads/) ld = $i
    }
    next
  }
  pending && /Used [0-9]+ registers/ {
    regs = 0; smem = 0
    for (i = 1; i <= NF; ++i) {
      if ($i == "Used") regs = $(i + 1)
      if ($(i + 1) == "bytes" && $(i + 2) ~ /^smem/) smem = $i
    }
    printf "%s %s %s %s %s %s %s\n", arch, regs, st, ld, stack, smem, name
    pending = 0
  }' | sort -k7,7 -k1,1
