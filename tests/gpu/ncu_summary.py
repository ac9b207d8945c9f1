"""One line per launch of an Nsight Compute raw CSV page (`ncu --import R --page raw --csv
--print-units base`): kernel name, grid, duration, DRAM, L2 and L1 throughput (% of peak), issue
slots busy, achieved occupancy, instructions executed per cycle per SM, then the four largest
stall reasons (warps stalled per issued instruction). A metric the profiled sections did not
collect prints as nan. Used by profile.sh and profile_kernels.sh."""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    sys.exit("ncu_summary: no profiled launches in " + sys.argv[1])
head = rows[0]


def col(r, name):
    return r[head.index(name)] if name in head else "?"


def extra(r, f):
    """The tensor pipe's busiest figure and shared-memory bank conflicts, where collected."""
    out = ""
    tensor = [h for h in head if "pipe_tensor" in h and "pct_of_peak" in h]
    if tensor:
        out += f"  tensor {max(f(h) for h in tensor):5.1f}%"
    banks = [h for h in head if "bank_conflicts" in h and h.endswith(".sum")]
    if banks:
        out += f"  bank conflicts {sum(f(h) for h in banks):.3g}"
    return out


stall = [h for h in head if "issue_stalled_" in h and h.endswith("_per_issue_active.ratio")]
for r in rows[2:]:
    def f(name):
        v = col(r, name).replace(",", "")
        try:
            return float(v)
        except ValueError:
            return float("nan")

    top = sorted(stall, key=lambda h: -f(h))[:4]
    names = " ".join(f"{h.split('issue_stalled_')[1].split('_per_issue')[0]} {f(h):.2f}" for h in top)
    print(f"{col(r, 'Kernel Name')[:26]:26} grid {col(r, 'Grid Size'):>14} {f('gpu__time_duration.sum') / 1e3:8.1f} us"
          f"  DRAM {f('gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%"
          f"  L2 {f('lts__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%"
          f"  L1 {f('l1tex__throughput.avg.pct_of_peak_sustained_active'):5.1f}%"
          f"  issue {f('smsp__issue_active.avg.pct_of_peak_sustained_active'):5.1f}%"
          f"  occ {f('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f}%"
          f"  IPC {f('sm__inst_executed.avg.per_cycle_active'):4.2f}{extra(r, f)}  | {names}")
