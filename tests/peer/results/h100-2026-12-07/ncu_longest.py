"""Prints the key lines of the longest kernel launch in an Nsight Compute details page (text)."""
import re
import sys

blocks, cur = [], None
for line in open(sys.argv[1], errors="replace"):
    if re.match(r"^  \S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line):
        cur = [line.rstrip()]
        blocks.append(cur)
    elif cur is not None:
        cur.append(line.rstrip())


def duration_us(block):
    for line in block:
        m = re.search(r"Duration\s+(\S+)\s+([\d.,]+)", line)
        if m:
            scale = {"ms": 1000.0, "msecond": 1000.0, "us": 1.0, "usecond": 1.0, "ns": 1e-3, "nsecond": 1e-3}
            return float(m.group(2).replace(",", "")) * scale.get(m.group(1), 1.0)
    return 0.0


KEYS = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
        "Issue Slots Busy", "Issued Ipc", "No Eligible", "Achieved Occupancy", "Registers Per", "Warp Cycles Per Issued",
        "Stall", "stall")
if not blocks:
    print("ncu: no launch found in", sys.argv[1])
else:
    b = max(blocks, key=duration_us)
    print(b[0][:110])
    for line in [l for l in b if any(k in l for k in KEYS)][:30]:
        print(line[:150])
