"""One long prompt through the real `ornith` binary (H200 run): a single JSONL request of N token
ids (default 261,000; random weights, so any ids), max_tokens M (default 8; ignore_eos, so all M
are generated), the checkpoint's default sampling, seeded, with --max-context N + M + 64 and the
default prefix cache. Records the result's ttft_ms and decode_tok_s (the binary's own figures: at
N = 2,048, M = 256 its decode beside the bench's), the wall time from the line written to the
result read (the binary's load excluded), the usage and the finish reason. Usage:
long_prompt.py ORNITH MODEL_DIR OUT_JSON [N] [M]; prints one line, exits 1 if the result is an
error, holds no text or does not count the N prompt tokens."""
import json, random, subprocess, sys, time

ornith, model, out = sys.argv[1:4]
n = int(sys.argv[4]) if len(sys.argv) > 4 else 261000
m = int(sys.argv[5]) if len(sys.argv) > 5 else 8
rng = random.Random(5)
ids = [rng.randrange(1000, 200000) for _ in range(n)]
args = [ornith, "--model", model, "--backend", "cuda", "--max-context", str(n + m + 64)]
t_start = time.time()
p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
t0 = time.time()
p.stdin.write(json.dumps({"custom_id": "long", "prompt_token_ids": ids, "max_tokens": m, "seed": 1, "ignore_eos": True}) + "\n")
p.stdin.flush()
line = p.stdout.readline()
wall = time.time() - t0
p.stdin.close()
log = p.stderr.read()
rc = p.wait()
try:
    r = json.loads(line)
except ValueError:
    r = {"error": f"no JSON result line (rc {rc}): {line[:200]!r}; stderr tail: {log[-2000:]}"}
rec = {"prompt_tokens": n, "wall_s_from_request": wall, "process_s": time.time() - t_start, "rc": rc, "result": r,
       "stderr_tail": log[-3000:]}
with open(out, "w") as f:
    json.dump(rec, f, indent=1)
body = (r.get("response") or {}).get("body") or {}
usage = body.get("usage") or {}
ch = (body.get("choices") or [{}])[0]
ok = not r.get("error") and usage.get("prompt_tokens") == n and bool(ch.get("text"))
print(f"long prompt {n} tokens: ttft_ms {body.get('ttft_ms')}, wall from request {wall:.2f} s, "
      f"prefill {n / (body.get('ttft_ms') or 1e30) * 1e3:.0f} tok/s, completion {usage.get('completion_tokens')} tokens, "
      f"decode_tok_s {body.get('decode_tok_s')}, finish {ch.get('finish_reason')}, rc {rc}, {'ok' if ok else 'FAILED: ' + json.dumps(r)[:300]}")
sys.exit(0 if ok else 1)
