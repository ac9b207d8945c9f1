#!/usr/bin/env python3
"""Builds the *micro* fixtures with the vendor tools (transformers + llm-compressor).

Outputs (committed):
  tests/fixtures/micro-bf16/   the random model as transformers saves it (every Linear BF16, no quantization_config)
  tests/fixtures/micro-fp8/    the same model after llm-compressor `oneshot` FP8_DYNAMIC, saved compressed
  tests/fixtures/VERSIONS.json exact package versions + what the tool wrote (observed, not assumed)

Every parameter is randomised (HF init leaves norms at 0 and A_log/dt_bias at defaults, which would let
bugs in those ops hide). Scales are chosen so activations and logits are O(1):
  * zero-centred RMSNorm weights (used as 1+w): N(0, 0.2)
  * GDN gated-norm weight (used as w): U(0.7, 1.3); A_log = log U(1, 16); dt_bias U(0.5, 1.5)
  * Linear weights N(0, 1/sqrt(in)) so a unit-RMS input gives unit-RMS output
  * router N(0, ROUTER_STD/sqrt(H)): router logits have std ~ROUTER_STD, so the softmax is peaked and a
    swap of the k-th/(k+1)-th expert moves little weight. Near ties cannot be designed away: bf16 logits
    carry 8 significant bits, and with 16 experts about 3% of token-layers have a k-th/(k+1)-th gap of at
    most 2 ulps whatever the scale (measured over 48 seeds: 9..25 of 408). `--search` picks the seed with
    the fewest near ties whose greedy continuation is EOS-free with top-1/top-2 margins > 0.1; goldens
    record the per-token gaps so tests can tell a legitimate routing flip from a bug
  * lm_head N(0, 3/sqrt(H)): logits std ~3, greedy top-1/top-2 margins well above bf16 resolution

Run: /work/pyenv/bin/python tests/generators/make_micro.py [--search]   (CPU: ~20 s; --search ~5 min)
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
OUT_BF16 = FIXTURES / "micro-bf16"
OUT_FP8 = FIXTURES / "micro-fp8"

VOCAB = 1024
HIDDEN = 64
ROUTER_STD = 3.0
LM_HEAD_STD = 3.0
# `--search` tries these candidate seeds (see choose_seed); MODEL_SEED is the seed that search picked
# (fewest router near-ties, 13 of 408 token-layers, then greedy margin 0.125), used by a plain run.
MODEL_SEEDS = range(24)
MODEL_SEED = 18
PROMPT_SEED = 20240613
PROMPT_LEN = 70  # > one 64-token GDN chunk
DECODE_STEPS = 32
EOS_ID = 1023  # prompt ids are < 1000; selection rejects a seed whose greedy continuation emits EOS

# The six vendor ignore patterns of docs/DESIGN.md.
VENDOR_IGNORE = [
    "re:.*lm_head",
    "re:.*embed_tokens$",
    "re:.*mlp.gate$",
    "re:.*shared_expert_gate$",
    "re:.*linear_attn.*",
    "re:.*visual.*",
]


def micro_config():
    from transformers import Qwen3_5MoeConfig

    text = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        # rotary dim = 32 * 0.25 = 8 -> 4 frequency pairs split over (t, h, w) as [2, 1, 1]
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        partial_rotary_factor=0.25,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=HIDDEN,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
    )
    # image/video token ids must lie inside the micro vocabulary; the ids are never used (text only).
    return Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=1020,
        video_token_id=1021,
        vision_start_token_id=1018,
        vision_end_token_id=1019,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def randomise(model, seed: int) -> None:
    """Draws every parameter of `model` (fp32) from the distributions in the module doc."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    seen = 0
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = p.shape
        if "visual" in name:
            if name.endswith(".bias"):
                v = normal(shape, 0.05)
            elif "norm" in name:
                v = normal(shape, 0.1, 1.0)
            else:
                fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
                v = normal(shape, 1.0 / math.sqrt(fan_in))
        elif name.endswith("embed_tokens.weight"):
            v = normal(shape, 1.0)
        elif name == "lm_head.weight":
            v = normal(shape, LM_HEAD_STD / math.sqrt(shape[1]))
        elif name.endswith("linear_attn.A_log"):
            v = torch.log(uniform(shape, 1.0, 16.0))
        elif name.endswith("linear_attn.dt_bias"):
            v = uniform(shape, 0.5, 1.5)
        elif name.endswith("linear_attn.norm.weight"):
            v = uniform(shape, 0.7, 1.3)
        elif name.endswith("conv1d.weight"):
            v = normal(shape, 0.5)
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name.endswith("language_model.norm.weight"):
            v = normal(shape, 0.2)
        elif name.endswith("mlp.gate.weight"):
            v = normal(shape, ROUTER_STD / math.sqrt(shape[1]))
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            v = normal(shape, 1.0 / math.sqrt(shape[2]))
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            v = normal(shape, 1.0 / math.sqrt(shape[2]))
        elif name.endswith(".weight") and len(shape) == 2:
            v = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise RuntimeError(f"randomise: no rule for parameter {name} {tuple(shape)}")
        p.copy_(v)
        seen += 1
    assert seen == sum(1 for _ in model.parameters())


def build_model(seed: int):
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    cfg = micro_config()
    model = Qwen3_5MoeForConditionalGeneration(cfg).to(torch.float32).eval()
    randomise(model, seed)
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def prompt_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, 1000, (1, PROMPT_LEN), generator=g)


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |v| (8 significant bits): 2^(floor(log2|v|) - 7)."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


def router_stats(model, ids: torch.Tensor, steps: int):
    """Runs prefill + greedy decode and measures how close routing is to a tie. For every token and MoE
    layer, gap = (k-th largest) - ((k+1)-th largest) bf16 router logit; a near tie is gap <= 2 bf16 ulps
    of the k-th logit (one rounding difference on each side could swap the choice).
    Returns (near-tie count, min gap in ulps, min top1-top2 logit margin, greedy tokens)."""
    k = model.config.text_config.num_experts_per_tok
    gaps_ulp: list[torch.Tensor] = []

    def hook(_m, _inp, out):
        top = torch.topk(out[0].float(), k + 1, dim=-1).values
        gaps_ulp.append((top[:, k - 1] - top[:, k]) / bf16_ulp(top[:, k - 1]))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        tokens, margins = greedy(model, ids, steps)
    finally:
        for h in handles:
            h.remove()
    g = torch.cat(gaps_ulp)
    return int((g <= 2).sum()), float(g.min()), min(margins), tokens


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int, collect=None):
    """Greedy decode with the KV/GDN cache. Returns (tokens, top1-top2 margins); `collect(i, logits)` sees
    the last-position logits of step i (0 = prefill)."""
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1]
    tokens, margins = [], []
    for i in range(steps):
        if collect is not None:
            collect(i, logits)
        top2 = torch.topk(logits.float(), 2).values
        margins.append(float(top2[0] - top2[1]))
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
    return tokens, margins


def choose_seed():
    """Keeps the candidate seed with the fewest router near-ties (see router_stats), then the widest
    greedy margin; rejects seeds whose greedy continuation emits EOS or has a margin below 0.1."""
    ids = prompt_ids()
    best = None
    for seed in MODEL_SEEDS:
        model = build_model(seed)
        model.config.text_config._experts_implementation = "eager"
        ties, gap, margin, tokens = router_stats(model, ids, DECODE_STEPS)
        ok = EOS_ID not in tokens and margin > 0.1
        print(f"seed {seed}: router near-ties {ties}  min gap {gap:.2f} ulp  min greedy margin {margin:.4f}  ok {ok}", file=sys.stderr)
        if ok and (best is None or (ties, -margin) < (best[1], -best[3])):
            best = (seed, ties, gap, margin)
    if best is None:
        raise SystemExit("no candidate seed gave an EOS-free greedy continuation with margins > 0.1")
    return best


def tensor_table(d: Path) -> dict:
    from safetensors import safe_open

    table = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for n in s.keys():
                sl = s.get_slice(n)
                table[n] = (sl.get_dtype(), list(sl.get_shape()))
    return table


def versions() -> dict:
    import compressed_tensors
    import llmcompressor
    import safetensors
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llmcompressor": llmcompressor.__version__,
        "compressed-tensors": compressed_tensors.__version__,
        "safetensors": safetensors.__version__,
    }


def quantise(src: Path, dst: Path):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(src), dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=list(VENDOR_IGNORE))
    oneshot(model=model, recipe=recipe)
    # Checked after oneshot (it replaces the experts module): is the router an nn.Linear?
    router_is_linear = isinstance(model.model.language_model.layers[0].mlp.gate, torch.nn.Linear)
    model.save_pretrained(str(dst), save_compressed=True)
    return router_is_linear, type(model.model.language_model.layers[0].mlp.experts).__name__


def observe(bf16: dict, fp8: dict, fp8_cfg: dict) -> dict:
    """What the tool actually wrote, measured from the files."""
    lin_fp8 = sorted(n[: -len(".weight")] for n, (dt, _) in fp8.items() if dt == "F8_E4M3")
    scales = {n: v for n, v in fp8.items() if n.endswith(".weight_scale")}
    scale_dtypes = sorted({dt for dt, _ in scales.values()})
    scale_shapes_ok = all(
        fp8[n][1] == [fp8[n[: -len("_scale")]][1][0], 1] for n in scales
    )
    per_expert = sorted(n for n in fp8 if ".mlp.experts." in n and n.split(".mlp.experts.")[1][:1].isdigit())
    fused = sorted(n for n in fp8 if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    q = fp8_cfg.get("quantization_config", {})
    return {
        "fp8_tensor_count": len(fp8),
        "bf16_tensor_count": len(bf16),
        "fp8_linear_count": len(lin_fp8),
        "weight_scale_dtypes": scale_dtypes,
        "weight_scale_shape_is_out_by_1": scale_shapes_ok,
        "experts_per_expert_tensors": len(per_expert),
        "experts_fused_tensors_in_fp8": fused,
        "experts_fused_tensors_in_bf16": sorted(n for n in bf16 if n.endswith(("experts.gate_up_proj", "experts.down_proj"))),
        "fp8_dtypes": sorted({dt for dt, _ in fp8.values()}),
        "bf16_dtypes": sorted({dt for dt, _ in bf16.values()}),
        "ignore_written": q.get("ignore"),
        "quantization_config_keys": sorted(q.keys()),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    if "--search" in sys.argv[1:]:
        seed, ties, gap, margin = choose_seed()
    else:
        seed = MODEL_SEED
        m = build_model(seed)
        m.config.text_config._experts_implementation = "eager"
        ties, gap, margin, _ = router_stats(m, prompt_ids(), DECODE_STEPS)
        del m
    print(f"chosen model seed {seed} ({ties} router near-ties, min gap {gap:.2f} ulp, min greedy margin {margin:.4f})", file=sys.stderr)

    for d in (OUT_BF16, OUT_FP8):
        if d.exists():
            shutil.rmtree(d)
    model = build_model(seed)
    model.save_pretrained(str(OUT_BF16))
    del model

    router_is_linear, experts_cls = quantise(OUT_BF16, OUT_FP8)

    bf16 = tensor_table(OUT_BF16)
    fp8 = tensor_table(OUT_FP8)
    fp8_cfg = json.loads((OUT_FP8 / "config.json").read_text())
    record = {
        "generator": "tests/generators/make_micro.py",
        "versions": versions(),
        "model_seed": seed,
        "prompt_seed": PROMPT_SEED,
        "router_std": ROUTER_STD,
        "lm_head_std": LM_HEAD_STD,
        "bf16_router_near_ties": ties,
        "bf16_router_min_gap_ulp": gap,
        "min_greedy_margin_bf16": margin,
        "recipe": {"targets": "Linear", "scheme": "FP8_DYNAMIC", "ignore": VENDOR_IGNORE},
        "router_mlp_gate_is_nn_linear": router_is_linear,
        "experts_module_after_oneshot": experts_cls,
        "files": {
            "micro-bf16": sorted(p.name for p in OUT_BF16.iterdir()),
            "micro-fp8": sorted(p.name for p in OUT_FP8.iterdir()),
        },
        "sizes_bytes": {
            "micro-bf16": sum(p.stat().st_size for p in OUT_BF16.iterdir()),
            "micro-fp8": sum(p.stat().st_size for p in OUT_FP8.iterdir()),
        },
        "observed": observe(bf16, fp8, fp8_cfg),
    }
    vpath = FIXTURES / "VERSIONS.json"
    old = json.loads(vpath.read_text()) if vpath.exists() else {}
    if "synthetic_roundtrip" in old:
        record["synthetic_roundtrip"] = old["synthetic_roundtrip"]
    vpath.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
