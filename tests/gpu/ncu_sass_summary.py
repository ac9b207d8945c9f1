"""Summary of an Nsight Compute source page in SASS (`ncu --import R --page source --csv
--print-source sass`, from a report with the SourceCounters section): the warp-stall samples by
opcode (the share of all samples, and the instructions executed), then the 15 instructions with
the most samples. Used by profile_kernels.sh with NCU_SOURCE=1. The page's column names vary
between Nsight Compute versions, so they are found by substring; an unknown layout prints the
header and says so."""
import csv
import sys
from collections import defaultdict

path = sys.argv[1]
rows = [r for r in csv.reader(open(path, errors="replace")) if r]
# The page may start with ==PROF== or other lines before the CSV header: take the first row that
# names a stall-sampling column.
start = next((i for i, r in enumerate(rows) if any("Stall Sampling" in c for c in r)), None)
if start is None:
    print(f"ncu_sass_summary: no stall-sampling column in {path}; first line: {rows[0][:8] if rows else []}")
    sys.exit(0)
head, body = rows[start], rows[start + 1:]


def find(*keys):
    for i, c in enumerate(head):
        if all(k in c for k in keys):
            return i
    return None


src = find("Source")
samples = find("Stall Sampling", "All")
if samples is None:
    samples = find("Stall Sampling")
executed = find("Instructions Executed")
if src is None or samples is None:
    print(f"ncu_sass_summary: unknown layout in {path}: {head[:12]}")
    sys.exit(0)


def num(r, i):
    if i is None or i >= len(r):
        return 0.0
    try:
        return float(r[i].replace(",", ""))
    except ValueError:
        return 0.0


by_op = defaultdict(lambda: [0.0, 0.0])
insts = []
for r in body:
    if src >= len(r) or not r[src].strip():
        continue
    text = r[src].strip()
    words = text.split()
    # "@P0 BRA ..." -> BRA; "HMMA.16816.F32.BF16 R4, ..." -> HMMA.16816.F32.BF16
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    s, e = num(r, samples), num(r, executed)
    by_op[op][0] += s
    by_op[op][1] += e
    insts.append((s, text))
total = sum(v[0] for v in by_op.values()) or 1.0
print(f"stall samples {total:.0f} in {len(insts)} instructions; by opcode (share of samples, executed):")
for op, (s, e) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:15]:
    print(f"  {op:32s} {100 * s / total:5.1f}%  {e:14.0f}")
print("hottest instructions:")
for s, text in sorted(insts, key=lambda t: -t[0])[:15]:
    print(f"  {100 * s / total:5.1f}%  {text[:100]}")
