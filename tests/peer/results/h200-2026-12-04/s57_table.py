"""One line per bench JSON under a folder (in the order written): variant, batch, greedy / default
tok/s, step ms, and the in-graph ablation's MoE / GEMV / GDN kernels (µs per step)."""
import glob
import json
import os
import sys

for f in sorted(glob.glob(f"{sys.argv[1]}/bench_*.json"), key=os.path.getmtime):
    v = os.path.basename(f)[6:-5]
    try:
        d = json.load(open(f))
    except Exception as e:  # a failed run leaves an empty or partial file
        print(v, "no json", e)
        continue
    for br in d.get("batch_runs") or []:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("moe", "gemv", "gdn"))]
        cells = " ".join("%s=%.0f" % (k.replace("moe_gemv_", "m_"), ab[k]) for k in keys)
        print(v, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]),
              "step %.3f ms" % br["decode_step_ms"], cells)
