import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, vi, gi, bi = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Grid Size"), hdr.index("Block Size")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
tot = 0
for r in rows[-n:]:
  us = float(r[vi].replace(",", "")) / 1e3
  tot += us
  print(f"{us:9.1f} us  grid {r[gi]:>14} blk {r[bi]:>12}  {r[ki][:90]}")
print(f"{tot:9.1f} us total of the last {n}")
