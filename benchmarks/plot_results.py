"""PNG plots of benchmark results: grouped-GEMM TFLOP/s, layer speed-ups over the XLA path, the fused operator.

Reads the JSON lines a benchmark writes (``--out``), or, for a run stopped by its time limit before it wrote them,
the ``key=value`` rows it printed to its log:

  python3 -m benchmarks.plot_results OUT   # OUT: a folder of <bench>.jsonl / <bench>.log (run_device_suite.sh writes one)
"""

from __future__ import annotations

import argparse
import json
import os
import re

import matplotlib
import matplotlib.pyplot as plt


def read_rows(folder: str, name: str) -> list[dict]:
  """Rows of benchmark `name` from <name>.jsonl, else from the key=value lines of <name>.log."""
  jsonl, log = os.path.join(folder, f"{name}.jsonl"), os.path.join(folder, f"{name}.log")
  if os.path.exists(jsonl):
    with open(jsonl) as f:
      return [r for r in map(json.loads, f) if "meta" not in r]
  rows = []
  if os.path.exists(log):
    with open(log) as f:
      for line in f:
        if line.startswith("  ") and "=" in line:
          # values may hold spaces (shape names): split on the keys instead
          pairs = re.findall(r"(\w+)=(.*?)(?=\s{2}\w+=|$)", line.strip())
          rows.append({k: v.strip() for k, v in pairs})
  return rows


def grouped_bars(ax, rows, group_key, series_key, value_key, order=None):
  groups = list(dict.fromkeys(r[group_key] for r in rows))
  series = order or list(dict.fromkeys(r[series_key] for r in rows))
  width = 0.8 / max(1, len(series))
  for i, s in enumerate(series):
    vals = []
    for g in groups:
      v = [r.get(value_key) for r in rows if r[group_key] == g and r[series_key] == s]
      try:
        vals.append(float(v[0]) if v and v[0] else 0.0)
      except ValueError:
        vals.append(0.0)
    ax.bar([j + i * width for j in range(len(groups))], vals, width, label=s)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
  ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
  ax.legend(fontsize=8)


# (benchmark, PNG, the row fields naming a bar group, the series field, the value field, y label, title)
PLOTS = [
    ("gemm", "grouped_gemm.png", ("shape", "skew"), "method", "tflops", "TFLOP/s",
     "Grouped GEMM, bf16 (higher is better)"),
    ("layer", "layer_speedup.png", ("shape", "pass"), "impl", "vs_xla", "speed-up over the XLA path",
     "MoE expert layer at EP=1 (higher is better)"),
    ("fused", "fused.png", ("shape", "skew"), "impl", "ms", "ms (lower is better)",
     "expert_combine at EP=1 vs its parts and the XLA/tokamax paths"),
]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("folder")
  args = ap.parse_args()
  matplotlib.use("Agg")  # files only, no display
  for bench, png, case_keys, series, value, ylabel, title in PLOTS:
    rows = read_rows(args.folder, bench)
    if not rows:
      continue
    for r in rows:
      r["case"] = " ".join(r.get(k, "") for k in case_keys).strip()
    fig, ax = plt.subplots(figsize=(9, 4))
    grouped_bars(ax, rows, "case", series, value)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(args.folder, png), dpi=110)
    plt.close(fig)
    print("wrote", os.path.join(args.folder, png))


if __name__ == "__main__":
  main()
