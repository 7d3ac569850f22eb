"""PNG plots of benchmark results: grouped-GEMM TFLOP/s, layer speed-ups over the XLA path, the fused operator.

Reads the JSON lines a benchmark writes (``--out``), or, for a run stopped by its time limit before it wrote them,
the ``key=value`` rows it printed to its log:

  python3 benchmarks/plot_results.py benchmarks/results/2026-11-29-h200-wgmma
"""

from __future__ import annotations

import argparse
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top


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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("folder")
  args = ap.parse_args()
  made = []
  gemm = read_rows(args.folder, "gemm")
  if gemm:
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in gemm:
      r["case"] = f"{r['shape']} {r.get('skew', '')}".strip()
    grouped_bars(ax, gemm, "case", "method", "tflops")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Grouped GEMM, bf16 (higher is better)")
    made.append(("grouped_gemm.png", fig))
  layer = read_rows(args.folder, "layer")
  if layer:
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in layer:
      r["case"] = f"{r['shape']} {r['pass']}"
    grouped_bars(ax, layer, "case", "impl", "vs_xla")
    ax.set_ylabel("speed-up over the XLA path")
    ax.set_title("MoE expert layer at EP=1 (higher is better)")
    made.append(("layer_speedup.png", fig))
  fused = read_rows(args.folder, "fused")
  if fused:
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in fused:
      r["case"] = f"{r['shape']} {r.get('skew', '')}".strip()
    grouped_bars(ax, fused, "case", "impl", "ms")
    ax.set_ylabel("ms (lower is better)")
    ax.set_title("expert_combine at EP=1 vs its parts and the XLA/tokamax paths")
    made.append(("fused.png", fig))
  for name, fig in made:
    fig.tight_layout()
    fig.savefig(os.path.join(args.folder, name), dpi=110)
    print("wrote", os.path.join(args.folder, name))


if __name__ == "__main__":
  main()
