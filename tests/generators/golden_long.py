#!/usr/bin/env python3
"""The oracle at length: the micro BF16 fixture in transformers on a 16,421-token prompt.

The 70-token goldens of golden_forward.py exercise every op, but not what only length brings: RoPE
angles at positions in the tens of thousands (fp32 `pos * inv_freq`, then bf16 cos/sin), softmax and
P·V sums over 16K cached keys, the Gated DeltaNet state carried through 257 chunks (the last one
partial) and the conv state across them. This writes tests/golden/micro-bf16-long/:

  golden.safetensors  prompt_ids [16421] (seeded, ids < 1000), rows [R] (the prompt rows kept: every
                      512th and the last 32), prefill_logits [R, vocab] bf16 and _fp32,
                      hidden_after_layer_{0..3} [R, hidden] bf16, greedy_tokens [32],
                      step_logits [32, vocab] bf16 and _fp32 (the fp32 run teacher-forced on the
                      bf16 run's tokens, so each step is comparable)
  meta.json           versions, the paths transformers took, the prompt, and the oracle's own
                      bf16-vs-fp32 gaps on exactly those rows (the test's bounds)

Run (CPU, about a minute): python tests/generators/golden_long.py
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import golden_forward as gf  # noqa: E402
import make_micro as mm  # noqa: E402

OUT = gf.GOLDEN / "micro-bf16-long"
PROMPT_SEED = 20261206
PROMPT_LEN = 16421  # 256 full GDN chunks of 64 and a partial one of 37
ROWS = sorted(set(range(0, PROMPT_LEN, 512)) | set(range(PROMPT_LEN - 32, PROMPT_LEN)))


def at(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The kept prompt rows of a captured layer output ([T, hidden] or [1, T, hidden])."""
    return hidden.reshape(-1, hidden.shape[-1])[rows]


def main() -> None:
    h = gf._Collect()
    for lg in ("transformers", ""):
        logging.getLogger(lg).addHandler(h)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(PROMPT_SEED)
    ids = torch.randint(0, 1000, (1, PROMPT_LEN), generator=g)
    rows = torch.tensor(ROWS)

    r = gf.run(gf.load_bf16(torch.bfloat16), ids)
    r32 = gf.run(gf.load_bf16(torch.float32), ids, teacher=r["tokens"])

    tensors = {
        "prompt_ids": ids[0].to(torch.int64),
        "rows": rows.to(torch.int64),
        "prefill_logits": r["prefill_logits"][rows].to(torch.bfloat16),
        "prefill_logits_fp32": r32["prefill_logits"][rows].float(),
        "greedy_tokens": torch.tensor(r["tokens"], dtype=torch.int64),
        "step_logits": r["step_logits"].to(torch.bfloat16),
        "step_logits_fp32": r32["step_logits"].float(),
    }
    for i in gf.CAPTURE_LAYERS:
        tensors[f"hidden_after_layer_{i}"] = at(r["hidden"][i], rows).to(torch.bfloat16)
    OUT.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(OUT / "golden.safetensors"))

    meta = {
        "generator": "tests/generators/golden_long.py",
        "versions": mm.versions(),
        "fixture": "tests/fixtures/micro-bf16",
        "dtype": "bfloat16 (oracle); fp32 run for the gap",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "experts_implementation": gf.EXPERTS_IMPL,
        "gdn_paths": gf.gdn_paths(),
        "transformers_path_log": sorted(set(gf._PATH_LOG)),
        "prompt": {"seed": PROMPT_SEED, "len": PROMPT_LEN, "ids_below": 1000},
        "rows": ROWS,
        "decode_steps": mm.DECODE_STEPS,
        "captured_layers": gf.CAPTURE_LAYERS,
        "greedy_tokens": r["tokens"],
        "greedy_top1_top2_margins": gf.margins(r["step_logits"]),
        "oracle_gap_bf16_vs_fp32": {
            "prefill_logits": gf.gap(r["prefill_logits"][rows], r32["prefill_logits"][rows]),
            "step_logits_teacher_forced": gf.gap(r["step_logits"], r32["step_logits"]),
            "hidden_after_layer": {str(i): gf.gap(at(r["hidden"][i], rows), at(r32["hidden"][i], rows)) for i in gf.CAPTURE_LAYERS},
        },
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({"gaps": meta["oracle_gap_bf16_vs_fp32"], "margins": meta["greedy_top1_top2_margins"]}, indent=2))


if __name__ == "__main__":
    main()
