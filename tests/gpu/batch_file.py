"""A JSONL batch file through the real `ornith` binary (H200 run): N requests (default 256) of
2,048-token prompts and 128 generated tokens each (the checkpoint's default sampling, seeded),
all read at once and run as many at a time as the engine holds. Two empty runs of the same binary
come first: the first start (on a fresh machine it includes the driver's one-time compilation of
the PTX, ~70 s before the twelfth session's trim of gemv.cu, which is why it is kept out of the
figure), then the load time, subtracted from the file's wall time. Prints the wall time, the load
time, generated tokens and generated tok/s, and the failed-line count; exits 1 on any failure.
Usage: batch_file.py ORNITH MODEL_DIR OUT_JSONL [N] [EXTRA_ARGS...]
BATCH_EXTRA='{"logprobs": 5}' merges those fields into every request (what they cost)."""
import json, os, random, subprocess, sys, time

ornith, model, out = sys.argv[1:4]
n = int(sys.argv[4]) if len(sys.argv) > 4 else 256
extra = sys.argv[5:]
rng = random.Random(7)
lines = []
for i in range(n):
    req = {"custom_id": f"b{i}", "prompt_token_ids": [rng.randrange(1000, 200000) for _ in range(2048)],
           "max_tokens": 128, "ignore_eos": True, "seed": i, **json.loads(os.environ.get("BATCH_EXTRA", "{}"))}
    lines.append(json.dumps(req))


cmd = [ornith, "--model", model, "--backend", "cuda", "--quiet", *extra]


def empty_run():
    t = time.time()
    subprocess.run(cmd, input="", capture_output=True, text=True)
    return time.time() - t


first = empty_run()
load = empty_run()
t0 = time.time()
p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
stdout, stderr = p.communicate("\n".join(lines) + "\n")
wall = time.time() - t0
open(out, "w").write(stdout)
res = [json.loads(l) for l in stdout.splitlines()]
failed = [r for r in res if r.get("error")]
gen = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in res if not r.get("error"))
serve = max(wall - load, 1e-9)
print(f"batch file: first start {first:.1f} s; {n} requests x 2048 prompt + 128 generated; wall {wall:.1f} s (load {load:.1f} s), "
      f"generated {gen} tokens, {gen / serve:.1f} generated tok/s after load, "
      f"{(gen + 2048 * n) / serve:.1f} prompt+generated tok/s; {len(res)} result lines, {len(failed)} failed; rc {p.returncode}")
for r in failed[:5]:
    print("  ", r["custom_id"], r["error"])
if p.returncode != 0:
    print(stderr[-2000:])
sys.exit(1 if failed or len(res) != n or p.returncode else 0)
