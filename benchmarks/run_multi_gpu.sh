#!/usr/bin/env bash
# The measurements of a machine with 2 or more GPUs (one process drives them all), in one device call of at most
# 10 minutes. Every step runs under its own `timeout`, so a hang costs that step's limit and not the call; every
# step's log goes under $OUT; a short table ends the output.
#
#   topo        nvidia-smi topo -m (how the GPUs are connected)
#   build       tests/gpu/build_gpu.sh, sourced: the package pip-installed into $JMO_SITE, the tools built. A later call
#               on the same warm machine reuses that build when the sources hash the same (REUSE_BUILD=0: rebuild).
#   links       benchmarks.bench_links: peer access of every GPU pair and the link bandwidth
#   ep_layer    benchmarks.bench_ep_layer on all GPUs, forward and forward+backward: ours, serialized, xla (the
#               library's impl="xla") and the ideal's probes (compute alone, comm alone with its wire bytes,
#               dispatch alone), then its summary (ours / ideal, hidden share, ours / serialized, ours / xla). One
#               process and one time limit per shape group (EP_GROUPS): a slow group cannot starve the next.
#   ep_combine  benchmarks.bench_ep_combine on all GPUs: expert_combine with the resource manager's consumer CTA count
#               C and with every pinned C of a sweep, on the real links; the table gives the manager's regret
#               (its time over the fastest pinned C's, minus 1).
# Not in the default --steps (name them to run them):
#   push_rate   tools/probes/row_push_probe --peer 1 (built from the tools build): GB/s per pushing CTA against its
#               bytes in flight, GPU 0's SMs storing rows into GPU 1's memory (16-byte warp stores as dispatch_gemm's
#               pushers, TMA bulk stores as the combine's consumer): the check of docs/design.md's "SMs the push
#               needs at 370 GB/s" prediction
#   tp_layer    benchmarks.bench_tp_layer on four GPUs as expert x tensor = 2 x 2 (TP_ARGS; skipped with fewer):
#               the layer with expert tensor parallelism, forward and forward+backward, at the Mixtral-like shape
#               and 4,096-16,384 tokens: overlap (the library's reduction), gather_rs (GEMM2 + GatherRS pinned),
#               serialized, collective, xla, and ep_only (the same GPUs as a 1-D expert mesh)
#   fp8_layer   benchmarks.bench_fp8_layer on all GPUs (--devices, FP8_ARGS): the layer under quantization="fp8"
#               against bf16, forward and forward+backward, impl collective, overlap (the library's default: the
#               returns fused by expert_combine on e4m3 operands), overlap+fused-all (the dispatches fused with
#               the GEMMs after them too) and overlap-serialized
#   resource    benchmarks.bench_resource --quick: the manager's regret sweep on the loopback harness (R ranks sharing
#               GPU 0, each with SMs / R and the link ceiling / R; the tools build of `build` and the shipped
#               calibration of this GPU). Not real links: ep_combine is the real-link sweep.
#   tests       pytest tests/gpu (TESTS_K: its -k)
#   train       examples/train_moe.py on all GPUs (TRAIN_ARGS: its GPU preset, briefly) with each of TRAIN_IMPLS
#               (overlap, xla; TRAIN_XLA_ARGS added to xla's), then overlap as one process per GPU
#               (benchmarks.launch_job); tokens/s and MFU of each
#
#   bash benchmarks/run_multi_gpu.sh                      # on the GPU machine, from the repository root
#   EP_GROUPS=deepseek bash benchmarks/run_multi_gpu.sh --steps build,ep_layer   # a later call, build reused
#   bash benchmarks/run_multi_gpu.sh --dry-run            # each step's command and limit (as if every step took
#                     # its whole limit) and the shapes of each group; runs nothing; exit 1 if a group selects none
#
# Options: --steps LIST (comma list, in the order of ALL_STEPS below; default topo,build,links,ep_layer,ep_combine),
# --budget S
# (the whole script's seconds, default 540: it ends by then, tar included), --dry-run.
# A call for the training runs alone: bash benchmarks/run_multi_gpu.sh --steps build,train
# The per-CTA push rate over the link: bash benchmarks/run_multi_gpu.sh --steps build,push_rate,tests
# Environment (defaults below): limits in seconds T_TOPO, T_BUILD, T_LINKS, T_EP_GROUP (at most, per group),
# T_PUSH, T_EP_COMBINE, T_TP, T_FP8, T_RESOURCE, T_TESTS, T_TRAIN; each step gets the least of its limit and what the budget has left,
# and the ep_layer groups share equally what is left after the limits of the steps after them. EP_GROUPS (names of
# ep_group_shapes below), EP_SHAPES (one regex on "name skew" instead of the groups), EP_IMPLS, EP_ARGS (more
# bench_ep_layer flags), EPC_ARGS (bench_ep_combine flags), TP_ARGS (bench_tp_layer flags), FP8_ARGS (bench_fp8_layer
# flags), RESOURCE_ARGS, TESTS_K,
# TRAIN_ARGS, TRAIN_IMPLS, TRAIN_XLA_ARGS. *_ARGS are split on spaces (flags and numbers only). NCCL_NVLS_ENABLE=0
# throughout: no NVLink multicast.
# A CPU run of the steps' plumbing (no build; python3 with jax and a built jax_moe_overlap/ on PYTHONPATH):
#   BENCH_PLATFORMS=cpu EP_GROUPS=quick EP_ARGS=--quick EPC_ARGS="--quick --ctas 4,8" \
#     bash benchmarks/run_multi_gpu.sh --steps links,ep_layer,ep_combine
# $OUT at the end (at most 8 files): summary.txt (what this prints), env.log, ep_layer.jsonl (every group's rows, each
# group's meta line first, its summary rows last), ep_layer.log, ep_combine.jsonl, links.jsonl, fp8_layer.jsonl,
# logs.tgz (the rest).
set -uo pipefail
export OUT=${OUT:-/tmp/jmo-multi-gpu-out}
cd "$(dirname "$0")/.."
root=$(pwd -P)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1

STEPS=topo,build,links,ep_layer,ep_combine
T_TOTAL=540
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --budget) T_TOTAL=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_multi_gpu.sh: unknown argument '$1' (--steps LIST, --budget S, --dry-run)" >&2; exit 2 ;;
  esac
done
ALL_STEPS="topo build links push_rate ep_layer ep_combine tp_layer fp8_layer resource tests train"
for s in ${STEPS//,/ }; do
  [[ " $ALL_STEPS " == *" $s "* ]] || { echo "run_multi_gpu.sh: unknown step '$s' (steps: $ALL_STEPS)" >&2; exit 2; }
done
wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

T_TOPO=${T_TOPO:-20} T_BUILD=${T_BUILD:-200} T_LINKS=${T_LINKS:-60} T_EP_GROUP=${T_EP_GROUP:-300}
T_PUSH=${T_PUSH:-60}
T_EP_COMBINE=${T_EP_COMBINE:-90} T_TP=${T_TP:-240} T_FP8=${T_FP8:-240} T_RESOURCE=${T_RESOURCE:-240} T_TESTS=${T_TESTS:-120}
T_TRAIN=${T_TRAIN:-120}
EP_GROUPS=${EP_GROUPS:-seed mixtral deepseek}
EP_IMPLS=${EP_IMPLS:-ours,serialized,xla,ideal,ours_dg}
EP_ARGS=${EP_ARGS:---max-call-s 5 --dispatch-pushers 16}
EPC_ARGS=${EPC_ARGS:---max-call-s 1}
TP_ARGS=${TP_ARGS:-}
FP8_ARGS=${FP8_ARGS:---impls collective,overlap,overlap+fused-all,overlap-serialized --no-xla}
RESOURCE_ARGS=${RESOURCE_ARGS:---quick --reps 3}
TESTS_K=${TESTS_K-not racecheck and not synccheck}
TRAIN_ARGS=${TRAIN_ARGS:---preset gpu --steps 30 --log-every 5 --eval-batches 1 --skip-check}
TRAIN_IMPLS=${TRAIN_IMPLS:-overlap xla}
# xla at the preset needs its microbatches on one H200 (ragged_dot's weight gradient is dense: performance.md), and
# XLA's loop unrolling off so that they run one at a time.
TRAIN_XLA_ARGS=${TRAIN_XLA_ARGS:---grad-accum 4}
END_RESERVE=15        # seconds kept for the final table and the tar

ep_group_shapes() {  # group name -> its bench_ep_layer --shapes regex (bench_ep_layer --list-shapes shows the names)
  case "$1" in
    seed) echo '^seed T=8192 N=4096 E=8 balanced$' ;;
    seed-stress) echo '^seed T=8192 N=4096 E=8 stress$' ;;
    mixtral) echo '^mixtral-like balanced$' ;;
    deepseek) echo '^deepseek-like E=64 balanced$' ;;      # DeepSeek-V3's D, F, top-8 with 64 experts: fits EP = 2
    deepseek-256) echo '^deepseek-like balanced$' ;;       # all 256 experts: 128 per GPU at EP = 2
    quick) echo '^quick' ;;
    *) return 1 ;;
  esac
}
if [ -n "${EP_SHAPES:-}" ]; then EP_GROUPS=custom; fi
group_regex() { if [ "$1" = custom ]; then echo "$EP_SHAPES"; else ep_group_shapes "$1"; fi; }
for g in $EP_GROUPS; do
  group_regex "$g" > /dev/null || { echo "run_multi_gpu.sh: unknown EP_GROUPS entry '$g'" >&2; exit 2; }
done

mkdir -p "$OUT"
[ $DRY_RUN = 1 ] || rm -f "$OUT/ep_layer.jsonl" "$OUT/ep_layer.log"     # the groups append to them
start=$(date +%s)
summary=$OUT/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
dry_spent=0         # --dry-run: the seconds the steps would take at worst (each its whole limit)
since() { echo $(( $(date +%s) - start + dry_spent )); }
steps_done=()       # "name|rc|seconds|limit|note" per step run (or skipped)
bad_groups=""       # --dry-run: the EP_GROUPS whose regex bench_ep_layer could not list shapes for

limit_for() {  # step-limit: the least of the step's limit and the budget left
  local left=$(( T_TOTAL - $(since) - END_RESERVE ))
  echo $(( left < $1 ? left : $1 ))
}
reserve_after() {  # step: the summed limits of the wanted steps after it (what the ep_layer groups leave them)
  local total=0 after=0 s lim
  for s in $ALL_STEPS; do
    if [ $after = 1 ] && wanted "$s"; then
      case "$s" in
        ep_combine) lim=$T_EP_COMBINE ;; tp_layer) lim=$T_TP ;; fp8_layer) lim=$T_FP8 ;; resource) lim=$T_RESOURCE ;;
        tests) lim=$T_TESTS ;;
        train) lim=$(( ($(wc -w <<< "$TRAIN_IMPLS") + 1) * T_TRAIN )) ;; *) lim=0 ;;
      esac
      total=$(( total + lim ))
    fi
    [ "$s" = "$1" ] && after=1
  done
  echo $total
}

# run_step name limit log command...: the command under `timeout` (SIGTERM at the limit, SIGKILL 10 s later; the
# benchmarks write their rows so far on SIGTERM), stdout and stderr to log; records rc and seconds.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [ "$limit" -lt 10 ]; then
    say "== $name: skipped, ${limit} s left of the budget"
    steps_done+=("$name|-|0|$limit|no time left")
    return 1
  fi
  if [ $DRY_RUN = 1 ]; then
    say "== $name (limit $limit s) at $(since) s: timeout -k 10 $limit $(printf '%q ' "$@")> $log"
    steps_done+=("$name|-|0|$limit|dry run")
    dry_spent=$(( dry_spent + limit ))
    return 0
  fi
  say "== $name (limit $limit s) at $(since) s"
  local t=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local note=""
  [ $rc = 124 ] || [ $rc = 137 ] && note="out of time (rows so far kept)"
  steps_done+=("$name|$rc|$(( $(date +%s) - t ))|$limit|$note")
  say "rc $rc $note"
  return 0
}
errors() {  # log: the lines that end a Python traceback, or say a process was stopped
  grep -E "^[A-Za-z_.]*(Error|Exception|Exit)\b|stopped by signal" "$1" | cut -c1-230 | tail -5 | tee -a "$summary"
}

# The benchmarks run on the GPUs alone (BENCH_PLATFORMS=cpu: the plumbing run on a CPU machine); the tests keep
# build_gpu.sh's cuda,cpu.
bench=(env JAX_PLATFORMS="${BENCH_PLATFORMS:-cuda}" python3)

if wanted topo; then
  run_step topo "$(limit_for "$T_TOPO")" "$OUT/topo.log" nvidia-smi topo -m &&
    [ $DRY_RUN = 0 ] && cut -c1-200 "$OUT/topo.log" | tee -a "$summary"
fi

# The tokamax wheels of .whl/ (when the call carries them) into /tmp/site, which build_gpu.sh puts on PYTHONPATH.
[ $DRY_RUN = 0 ] && { timeout 60 bash -c 'source benchmarks/tokamax_wheels.sh' || say "tokamax wheels: rc $?"; }

# build_gpu.sh is sourced in a subshell under the limit; its exports (PYTHONPATH with the installed package first,
# PYTHONSAFEPATH, JAX_PLATFORMS, ...) are captured and read back, all but OUT (this call's).
load_build_env() {
  local out=$OUT
  source "$build_env"
  export OUT=$out
}
if wanted build; then
  export JMO_SITE=${JMO_SITE:-/tmp/jmo-site}
  build_env=$JMO_SITE.env.sh
  src_hash=$(find ffi tools jax_moe_overlap CMakeLists.txt pyproject.toml -type f ! -name '*.so' \
               ! -path '*/__pycache__/*' -print0 2>/dev/null | sort -z | xargs -0 md5sum | md5sum | cut -c1-32)
  if [ "${REUSE_BUILD:-1}" = 1 ] && [ -s "$build_env" ] && [ -d "$JMO_SITE/jax_moe_overlap" ] &&
     [ "$(cat "$JMO_SITE.src-hash" 2>/dev/null)" = "$src_hash" ]; then
    say "== build: reused $JMO_SITE (same sources, hash $src_hash)"
    steps_done+=("build|0|0|0|reused")
    if [ $DRY_RUN = 0 ]; then
      load_build_env
      # The checkout may sit elsewhere than at the build: the repository root comes from this call.
      export PYTHONPATH="$JMO_SITE:$root:$root/examples:/tmp/site"
      cp build/tools/_jmo_loopback*.so tools/loopback/ 2>/dev/null
      { timeout 20 nvidia-smi -L
        timeout 60 python3 -c "import jax_moe_overlap as j; print('installed', j.__file__, j.build_info())"
      } > "$OUT/env.log" 2>&1
    fi
  else
    [ $DRY_RUN = 1 ] || rm -f "$build_env" "$JMO_SITE.src-hash"
    run_step build "$(limit_for "$T_BUILD")" "$OUT/build_step.log" \
      bash -c 'source tests/gpu/build_gpu.sh && export -p > "$1"' _ "$build_env"
    if [ $DRY_RUN = 0 ]; then
      if [ -s "$build_env" ]; then
        echo "$src_hash" > "$JMO_SITE.src-hash"
        load_build_env
        grep -E "^build:|^installed|^build_info" "$OUT/build_step.log" | cut -c1-230 | tee -a "$summary"
      else
        say "build failed or ran out of time: the end of its log:"
        tail -20 "$OUT/build_step.log" | cut -c1-230 | tee -a "$summary"
      fi
    fi
  fi
  export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
fi

if wanted links; then
  run_step links "$(limit_for "$T_LINKS")" "$OUT/links.log" \
    "${bench[@]}" -m benchmarks.bench_links --out "$OUT/links.jsonl"
  if [ $DRY_RUN = 0 ]; then
    errors "$OUT/links.log"
    sed -n '/^| kind/,$p' "$OUT/links.log" | tee -a "$summary"
  fi
fi

if wanted push_rate; then
  run_step push_rate "$(limit_for "$T_PUSH")" "$OUT/push_rate.log" \
    bash -c 'bash tools/build_tools.sh row_push_probe && build/tools/row_push_probe --peer 1 --mib 32 --reps 5'
  if [ $DRY_RUN = 0 ]; then
    # The curve per CTA: one pushing CTA per copy form and bytes in flight, 4 KiB rows (d_model 2048 in bf16).
    awk -F'|' '$4 + 0 == 1 && $2 + 0 == 4096' "$OUT/push_rate.log" | cut -c1-200 | tee -a "$summary"
    grep -E "WRONG|error|row_push_probe:" "$OUT/push_rate.log" | cut -c1-230 | head -5 | tee -a "$summary"
  fi
fi

if wanted ep_layer; then
  groups=($EP_GROUPS)
  for i in "${!groups[@]}"; do
    g=${groups[$i]}
    regex=$(group_regex "$g")
    # This group's share: what is left after the later steps' limits, split over the groups still to run.
    share=$(( (T_TOTAL - $(since) - END_RESERVE - $(reserve_after ep_layer)) / (${#groups[@]} - i) ))
    if [ $DRY_RUN = 1 ]; then
      say "   $g: --shapes '$regex' selects:"
      listed=$("${bench[@]}" -m benchmarks.bench_ep_layer --list-shapes --shapes "$regex" 2>&1) || bad_groups+=" $g"
      echo "$listed" | sed 's/^/     /' | cut -c1-200 | tee -a "$summary"
    fi
    run_step "ep_layer $g" "$(( share < T_EP_GROUP ? share : T_EP_GROUP ))" "$OUT/ep_layer_$g.log" \
      "${bench[@]}" -m benchmarks.bench_ep_layer --shapes "$regex" --impls "$EP_IMPLS" $EP_ARGS \
      --out "$OUT/ep_layer_$g.jsonl" || continue
    if [ $DRY_RUN = 0 ]; then
      grep -E "^mesh|EXCLUDED|not timed|error while timing|do not split" "$OUT/ep_layer_$g.log" | cut -c1-230 |
        tee -a "$summary"
      errors "$OUT/ep_layer_$g.log"
      cat "$OUT/ep_layer_$g.jsonl" >> "$OUT/ep_layer.jsonl" 2>/dev/null
      { echo "== ep_layer $g: --shapes '$regex'"; cat "$OUT/ep_layer_$g.log"; } >> "$OUT/ep_layer.log"
      rm -f "$OUT/ep_layer_$g.jsonl" "$OUT/ep_layer_$g.log"       # kept whole in the two files above
    fi
  done
fi

if wanted ep_combine; then
  run_step ep_combine "$(limit_for "$T_EP_COMBINE")" "$OUT/ep_combine.log" \
    "${bench[@]}" -m benchmarks.bench_ep_combine $EPC_ARGS --out "$OUT/ep_combine.jsonl"
  if [ $DRY_RUN = 0 ]; then
    grep -E "^mesh|EXCLUDED|consumer policy" "$OUT/ep_combine.log" | cut -c1-230 | tee -a "$summary"
    errors "$OUT/ep_combine.log"
  fi
fi

gpu_count() {  # n: the GPUs nvidia-smi lists, or n where it lists none (the dry run and the CPU plumbing run)
  local g
  g=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$g" -ge 1 ]; then echo "$g"; else echo "$1"; fi
}

if wanted tp_layer; then
  gpus=$(gpu_count 4)
  if [ "$gpus" -lt 4 ]; then
    say "== tp_layer: skipped, expert x tensor = 2 x 2 needs four GPUs ($gpus here)"
    steps_done+=("tp_layer|-|0|0|fewer than four GPUs")
  else
    run_step tp_layer "$(limit_for "$T_TP")" "$OUT/tp_layer.log" \
      "${bench[@]}" -m benchmarks.bench_tp_layer --ep 2 --tp 2 --devices 4 $TP_ARGS --out "$OUT/tp_layer.jsonl"
    if [ $DRY_RUN = 0 ]; then
      grep -E "^\||^mesh|not timed|FAIL" "$OUT/tp_layer.log" | cut -c1-230 | tee -a "$summary"
      errors "$OUT/tp_layer.log"
    fi
  fi
fi

if wanted fp8_layer; then
  gpus=$(gpu_count 2)
  run_step fp8_layer "$(limit_for "$T_FP8")" "$OUT/fp8_layer.log" \
    "${bench[@]}" -m benchmarks.bench_fp8_layer --devices "$gpus" $FP8_ARGS --out "$OUT/fp8_layer.jsonl"
  if [ $DRY_RUN = 0 ]; then
    grep -E "^\|" "$OUT/fp8_layer.log" | cut -c1-230 | tee -a "$summary"
    errors "$OUT/fp8_layer.log"
  fi
fi

if wanted resource; then
  run_step resource "$(limit_for "$T_RESOURCE")" "$OUT/resource.log" \
    "${bench[@]}" -m benchmarks.bench_resource $RESOURCE_ARGS --out "$OUT/resource.jsonl" --log "$OUT/loopback.log"
  if [ $DRY_RUN = 0 ]; then
    grep -E "^\||^mean regret" "$OUT/resource.log" | cut -c1-300 | tee -a "$summary"
    errors "$OUT/resource.log"
  fi
fi

if wanted tests; then
  run_step "pytest tests/gpu" "$(limit_for "$T_TESTS")" "$OUT/pytest.log" \
    python3 -m pytest -q -rs -p no:cacheprovider tests/gpu ${TESTS_K:+-k "$TESTS_K"}
  [ $DRY_RUN = 0 ] && grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | cut -c1-300 | tail -15 |
    tee -a "$summary"
fi

median_tok_s() {  # log: the median tokens/s of its per-step lines after the first 5 (compilation, warm-up)
  grep -o 'tokens/s [0-9,]*' "$1" | tail -n +6 | tr -d , | awk '{print $2}' | sort -n |
    awk '{v[NR] = $1} END {print NR ? v[int((NR + 1) / 2)] " (median of " NR " steps)" : "n/a"}'
}
if wanted train; then
  for impl in $TRAIN_IMPLS; do
    env_extra=() args_extra=""
    if [ "$impl" = xla ]; then
      env_extra=(env XLA_FLAGS=--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL)
      args_extra=$TRAIN_XLA_ARGS
    fi
    run_step "train $impl" "$(limit_for "$T_TRAIN")" "$OUT/train_$impl.log" \
      "${env_extra[@]}" "${bench[@]}" examples/train_moe.py --impl $impl $TRAIN_ARGS $args_extra || continue
    [ $DRY_RUN = 0 ] && { grep -E "^throughput" "$OUT/train_$impl.log" | cut -c1-230 | tee -a "$summary"
                          say "tokens/s $(median_tok_s "$OUT/train_$impl.log")"; errors "$OUT/train_$impl.log"; }
  done
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ $DRY_RUN = 1 ] && [ "$gpus" -lt 2 ] && gpus=2      # (the dry run shows the command of a 2-GPU machine)
  if [ "$gpus" -ge 2 ]; then
    lim=$(limit_for "$T_TRAIN")
    # launch_job's own deadline comes first, so that it kills the job's processes itself.
    run_step "train overlap, one process per GPU" "$lim" "$OUT/train_processes.log" \
      "${bench[@]}" -m benchmarks.launch_job --processes "$gpus" --limit-s "$(( lim - 10 ))" \
      --logs "$OUT/train_processes" -- python3 examples/train_moe.py --impl overlap $TRAIN_ARGS
    [ $DRY_RUN = 0 ] && { grep -E "^throughput|exit status" "$OUT/train_processes.log" | cut -c1-230 |
                            tee -a "$summary"; errors "$OUT/train_processes.log"; }
  else
    say "== train, one process per GPU: skipped ($gpus GPU)"
  fi
fi

# The short table: every step, then the EP layer's summary rows of all groups, the link pairs and the manager's
# regret on the real links (ours vs the fastest pinned C of bench_ep_combine).
say ""
say "== steps (rc 124: stopped at its limit; its rows so far are kept)"
say "| step | rc | s | limit s | note |"
say "|---|---|---|---|---|"
for r in "${steps_done[@]}"; do say "| ${r//|/ | } |"; done
if [ $DRY_RUN = 0 ]; then
  timeout 30 python3 - "$OUT" <<'EOF' 2>&1 | tee -a "$summary"
import json, os, sys
out = sys.argv[1]

def rows(name):
  path = os.path.join(out, name)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]

def table(title, cols, body):
  if body:
    print(f"\n{title}\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for b in body:
      print("| " + " | ".join(str(c) for c in b) + " |")

cols = ["shape", "skew", "pass", "ours_ms", "serialized_ms", "xla_ms", "compute_ms", "comm_ms", "comm_wire_MB",
        "comm_GBps", "ideal_ms", "ours/ideal", "hidden", "ours/serialized", "ours/xla"]
table("EP layer (bench_ep_layer; hidden = (compute + comm - ours) / comm; ratios < 1: ours faster)", cols,
      [[r.get(c, "") for c in cols] for r in rows("ep_layer.jsonl") if r.get("table") == "summary"])
links = ["kind", "src", "dst", "peer", "GBps", "reason"]
table("Links (bench_links)", links, [[r.get(c, "") for c in links] for r in rows("links.jsonl") if "meta" not in r])
combine, regret = {}, []
for r in rows("ep_combine.jsonl"):
  combine.setdefault((r.get("shape"), r.get("skew")), {})[r.get("impl")] = r
for (shape, skew), by in combine.items():
  try:
    ours, oracle = float(by["ours"]["ms"]), float(by["oracle"]["ms"])
  except (KeyError, ValueError):
    continue
  regret.append([shape, skew, by["ours"].get("C", ""), f"{ours:.3f}", by["oracle"].get("C", ""), f"{oracle:.3f}",
                 f"{100 * (ours / oracle - 1):.1f}%"])
table("Resource manager on the real links (bench_ep_combine: the manager's C vs the fastest pinned C)",
      ["shape", "skew", "manager C", "ms", "oracle C", "ms", "regret"], regret)
EOF
fi
say "== done at $(since) s"
if [ $DRY_RUN = 1 ]; then
  [ -z "$bad_groups" ] || { say "EP_GROUPS that select no shape (or could not be listed):$bad_groups"; exit 1; }
  exit 0
fi

keep="summary.txt env.log ep_layer.jsonl ep_layer.log ep_combine.jsonl links.jsonl fp8_layer.jsonl"
(
  cd "$OUT" || exit 1
  rest=$(ls -A | grep -v -x -F "$(printf '%s\n' $keep)")
  [ -z "$rest" ] || { tar czf logs.tgz $rest && rm -rf $rest; }
)
ls "$OUT"
