"""The prefix cache through the real `ornith` binary (H200 run), two workloads, each once with the
cache (default --prefix-cache-bytes) and once without it (--prefix-cache-bytes 0), in one run:

1. A synthetic coding-agent conversation: TURNS turns (default 16), the first of START tokens
   (default 8,192), each later one re-sending the whole previous prompt plus STEP new tokens
   (default 7,680: tool output, a reply, a new instruction), sent one at a time as an agent does
   (the next turn only after the answer). Per-turn TTFT (the result's ttft_ms) and cached tokens.
2. A batch file of N requests (default 256) sharing one 4,096-token system prompt followed by 512
   tokens of their own, max_tokens 1, all read at once: wall time from the first line written to
   the last result read (the binary's load excluded), and prompt tokens served from the cache.

Prompts are token ids (random weights: any ids); sampling is the checkpoint's default, seeded.
Usage: prefix_cache.py ORNITH MODEL_DIR OUT_JSON [TURNS START STEP N]; prints a table, exits 1 on
any failed line or a cached answer that differs from the uncached one."""
import json, random, subprocess, sys, time

ornith, model, out = sys.argv[1:4]
turns, start, step, n = (int(x) for x in (sys.argv[4:8] + ["16", "8192", "7680", "256"][len(sys.argv[4:8]):]))
ctx = start + (turns - 1) * step + 64
rng = random.Random(11)
conv = [rng.randrange(1000, 200000) for _ in range(start + (turns - 1) * step)]
system = [rng.randrange(1000, 200000) for _ in range(4096)]
batch = [system + [rng.randrange(1000, 200000) for _ in range(512)] for _ in range(n)]


def run(cache):
    args = [ornith, "--model", model, "--backend", "cuda", "--max-context", str(ctx)]
    if not cache:
        args += ["--prefix-cache-bytes", "0"]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def send(obj):
        p.stdin.write(json.dumps(obj) + "\n")
        p.stdin.flush()

    def result():
        r = json.loads(p.stdout.readline())
        if r.get("error"):
            raise SystemExit(f"failed line: {r}")
        return r

    rows = []
    for t in range(turns):
        ids = conv[: start + t * step]
        send({"custom_id": f"turn{t}", "prompt_token_ids": ids, "max_tokens": 8, "seed": t})
        r = result()
        body = r["response"]["body"]
        rows.append({"turn": t + 1, "prompt": len(ids), "ttft_ms": body["ttft_ms"],
                     "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                     "text": body["choices"][0]["text"]})
    t0 = time.time()
    for i, ids in enumerate(batch):
        send({"custom_id": f"b{i}", "prompt_token_ids": ids, "max_tokens": 1, "seed": i})
    res = [result() for _ in batch]
    wall = time.time() - t0
    p.stdin.close()
    log = p.stderr.read()
    p.wait()
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in res}
    cached = sum(r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in res)
    summary = [l for l in log.splitlines() if "prefix cache" in l or "done:" in l]
    return {"turns": rows, "batch_wall_s": wall, "batch_cached": cached, "batch_texts": texts,
            "summary": summary, "rc": p.returncode}


warm, cold = run(True), run(False)
json.dump({"warm": warm, "cold": cold}, open(out, "w"))
print(f"prefix cache, agent conversation: {turns} turns, {start} + {step}/turn tokens (TTFT ms)")
print("| turn | prompt | cached | TTFT with cache | TTFT without |")
print("|---|---|---|---|---|")
same = True
for a, b in zip(warm["turns"], cold["turns"]):
    same &= a["text"] == b["text"]
    print(f"| {a['turn']} | {a['prompt']} | {a['cached']} | {a['ttft_ms']:.0f} | {b['ttft_ms']:.0f} |")
same_batch = warm["batch_texts"] == cold["batch_texts"]
print(f"batch file: {n} x (4096 shared + 512) tokens, max_tokens 1: wall {warm['batch_wall_s']:.2f} s with the cache "
      f"({warm['batch_cached']} prompt tokens cached), {cold['batch_wall_s']:.2f} s without "
      f"({100 * warm['batch_wall_s'] / cold['batch_wall_s']:.0f}%)")
print(f"answers identical with and without the cache: conversation {same}, batch {same_batch}")
for s in warm["summary"] + cold["summary"]:
    print("  ", s)
sys.exit(0 if same and same_batch and warm["rc"] == 0 and cold["rc"] == 0 else 1)
