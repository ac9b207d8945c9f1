"""64 sampled requests through the real `ornith` binary on the full preset (H200 run):
2,048-token prompts, 64 tokens each, cycling greedy / the checkpoint's default sampling / top-p
only. Prints one line per mode (mean decode tok/s end to end) and the number of failed lines;
exits 1 if any request failed. Usage: soak_full.py ORNITH MODEL_DIR OUT_JSONL"""
import json, random, subprocess, sys

ornith, model, out = sys.argv[1:4]
modes = {"greedy": {"temperature": 0}, "default": {}, "top_p": {"temperature": 0.7, "top_p": 0.8}}
rng = random.Random(5)
lines = []
for i in range(64):
    name = list(modes)[i % 3]
    req = {"custom_id": f"{name}-{i}", "prompt_token_ids": [rng.randrange(1000, 200000) for _ in range(2048)],
           "max_tokens": 64, "ignore_eos": True, "seed": i, **modes[name]}
    lines.append(json.dumps(req))
p = subprocess.run([ornith, "--model", model, "--backend", "cuda", "--quiet"], input="\n".join(lines) + "\n",
                   capture_output=True, text=True)
open(out, "w").write(p.stdout)
res = [json.loads(l) for l in p.stdout.splitlines()]
failed = [r for r in res if r.get("error")]
rates = {m: [] for m in modes}
for r in res:
    if not r.get("error"):
        rates[r["custom_id"].split("-")[0]].append(r["response"]["body"]["decode_tok_s"])
for m, v in rates.items():
    print(f"soak {m:8s} requests {len(v):3d}  decode tok/s mean {sum(v) / max(len(v), 1):7.1f}  min {min(v, default=0):7.1f}")
print(f"soak: {len(res)} result lines for 64 requests, {len(failed)} failed; rc {p.returncode}")
for r in failed[:5]:
    print("  ", r["custom_id"], r["error"])
if p.returncode != 0:
    print(p.stderr[-2000:])
sys.exit(1 if failed or len(res) != 64 or p.returncode else 0)
