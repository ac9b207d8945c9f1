#!/usr/bin/env python3
"""The oracle: runs the micro fixtures in transformers on the CPU and writes goldens.

  tests/golden/micro-fp8/   FP8 fixture, dequantised by compressed-tensors, bf16, activations fake-quantised
                            per token (compressed-tensors' own functions) before exactly the FP8 Linears
  tests/golden/micro-bf16/  BF16 fixture, bf16, no fake quant
  tests/golden/micro-fp8/act_quant.safetensors   per-token quantiser reference (edge cases)

Each golden dir: golden.safetensors (tensors) + meta.json (versions, paths taken, measured oracle gaps).
Run: /work/pyenv/bin/python tests/generators/golden_forward.py   (CPU, well under a minute)
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_micro as mm  # noqa: E402

GOLDEN = mm.ROOT / "tests" / "golden"
# Set explicitly: HF's default wherever torch._grouped_mm dispatches (it does on the CPU in torch 2.11):
# per (token, slot) `bf16(y_e * w)`, then `.view(T, k, H).sum(1)` — an fp32-accumulated k-sum, one
# rounding. The engine (CPU reference and CUDA kernels) implements exactly this order.
EXPERTS_IMPL = "grouped_mm"
CAPTURE_LAYERS = [0, 1, 2, 3]  # hidden states after every decoder layer (GDN 0-2, attention 3)

# Messages transformers logs when it picks a kernel path (collected into meta.json).
_PATH_LOG: list[str] = []


class _Collect(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if "falling back" in msg or "fast path" in msg or "flash" in msg.lower():
            _PATH_LOG.append(msg)


# ---------------------------------------------------------------- fake quant (compressed-tensors' own code)
def token_args():
    """The input_activations args llm-compressor wrote (FP8_DYNAMIC preset)."""
    from compressed_tensors.quantization import QuantizationArgs

    cfg = json.loads((mm.OUT_FP8 / "config.json").read_text())["quantization_config"]
    return QuantizationArgs(**cfg["config_groups"]["group_0"]["input_activations"])


def per_token_qparams(x: torch.Tensor, args):
    """compressed-tensors' dynamic scale for `x` viewed as [1, tokens, features].

    compute_dynamic_scales_and_zp with strategy TOKEN keeps dims {0, 1} and reduces over the rest, so a
    2-D [tokens, features] input would reduce over nothing -> one scale for the whole tensor. The HF MoE
    block feeds the shared expert 2-D input; the vendor semantics (and vLLM) are per token, so the oracle
    always views the activation as [1, tokens, features]."""
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x3 = x.reshape(1, -1, x.shape[-1])
    scale, zp = compute_dynamic_scales_and_zp(value=x3, args=args, module=torch.nn.Module())
    return x3, scale, zp


def act_fake_quant(x: torch.Tensor, args) -> torch.Tensor:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    if x.numel() == 0:
        return x
    x3, scale, zp = per_token_qparams(x, args)
    return fake_quantize(x=x3, scale=scale, zero_point=zp, args=args).reshape(x.shape)


def act_quantize(x: torch.Tensor, args):
    """(E4M3 codes, per-token scale) as compressed-tensors' `quantize` produces them."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    x3, scale, zp = per_token_qparams(x, args)
    q = quantize(x=x3, scale=scale, zero_point=zp, args=args, dtype=torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.reshape(x.shape[0], 1)


# ---------------------------------------------------------------- model loading
def load_fp8(dtype: torch.dtype):
    """FP8 fixture through transformers + compressed-tensors (dequantised, experts fused back on load).
    For fp32 the FP8 weights are re-dequantised exactly in fp32 (e4m3 * scale needs up to 12 significant
    bits; the bf16 decompression rounds it)."""
    from transformers import CompressedTensorsConfig, Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        str(mm.OUT_FP8),
        dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(run_compressed=False),
        experts_implementation=EXPERTS_IMPL,
    ).eval()
    if dtype == torch.float32:
        model = model.float()
        sd = load_file(str(mm.OUT_FP8 / "model.safetensors"))
        deq = lambda n: sd[f"{n}.weight"].float() * sd[f"{n}.weight_scale"].float()  # noqa: E731
        with torch.no_grad():
            for name, mod in model.named_modules():
                if hasattr(mod, "quantization_scheme"):
                    mod.weight.copy_(deq(name))
                if name.endswith("mlp.experts") and hasattr(mod, "gate_up_proj"):
                    for e in range(mod.num_experts):
                        mod.gate_up_proj[e].copy_(torch.cat([deq(f"{name}.{e}.gate_proj"), deq(f"{name}.{e}.up_proj")]))
                        mod.down_proj[e].copy_(deq(f"{name}.{e}.down_proj"))
    return model


def load_bf16(dtype: torch.dtype):
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        str(mm.OUT_BF16), dtype=torch.bfloat16, experts_implementation=EXPERTS_IMPL
    ).eval()
    return model.float() if dtype == torch.float32 else model


def fp8_linear_modules(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "quantization_scheme")]


def experts_forward_fq(self, hidden_states, top_k_index, top_k_weights, args):
    """HF 5.17 grouped_mm experts forward, computed expert by expert, with per-token fake quant of each
    expert's input rows (before gate/up) and of the intermediate act (before down_proj) — the per-expert
    FP8 Linears of the checkpoint. Combine exactly as grouped_mm: `y * w` in bf16 per (token, slot),
    then `.view(T, k, H).sum(dim=1)` (fp32 accumulation inside torch's bf16 sum, one rounding)."""
    num_tokens, k = top_k_index.shape
    weighted = torch.zeros(num_tokens, k, hidden_states.size(-1), dtype=hidden_states.dtype)
    for e in torch.unique(top_k_index).tolist():
        if e >= self.num_experts:
            continue
        tok, pos = torch.where(top_k_index == e)
        cur = hidden_states[tok]
        if args is not None:
            cur = act_fake_quant(cur, args)
        proj = F.linear(cur, self.gate_up_proj[e])
        act = self._apply_gate(proj)
        if args is not None:
            act = act_fake_quant(act, args)
        y = F.linear(act, self.down_proj[e])
        weighted[tok, pos] = y * top_k_weights[tok, pos, None]
    return weighted.sum(dim=1).to(hidden_states.dtype)


def install_fake_quant(model, args) -> list[str]:
    """Forward pre-hooks on the FP8 nn.Linears; patched forward on the fused experts. compressed-tensors'
    own QDQ forward is switched off (it would also re-fake-quantise the weights and, on the 2-D shared-
    expert input, use one scale per tensor)."""
    names = fp8_linear_modules(model)
    for n in names:
        mod = model.get_submodule(n)
        mod.quantization_enabled = False
        mod.register_forward_pre_hook(lambda _m, inp: (act_fake_quant(inp[0], args),) + tuple(inp[1:]))
    for n, mod in model.named_modules():
        if type(mod).__name__ == "Qwen3_5MoeExperts":
            mod.forward = (lambda self: lambda h, i, w: experts_forward_fq(self, h, i, w, args))(mod)
    return names


# ---------------------------------------------------------------- runs
@torch.no_grad()
def run(model, ids: torch.Tensor, teacher: list[int] | None = None):
    """Prefill (hidden after CAPTURE_LAYERS, logits, router top-k + gaps), then a 32-step decode with
    the cache: greedy, or teacher-forced with `teacher` tokens. Step i's logits are the ones token i is
    chosen from (step 0 = last prefill position)."""
    layers = model.model.language_model.layers
    k = model.config.text_config.num_experts_per_tok
    hidden, routers = {}, []

    hooks = [layers[i].register_forward_hook(lambda _m, _i, out, i=i: hidden.__setitem__(i, out[0].clone())) for i in CAPTURE_LAYERS]

    def rhook(_m, _i, out):
        logits = out[0].float()
        top = torch.topk(logits, k + 1, dim=-1)
        routers.append((top.indices[:, :k].clone(), top.values[:, k - 1] - top.values[:, k], mm.bf16_ulp(top.values[:, k - 1])))

    hooks += [l.mlp.gate.register_forward_hook(rhook) for l in layers]
    try:
        out = model(input_ids=ids, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    prefill_routers = routers[: len(layers)]
    past = out.past_key_values
    prefill_logits = out.logits[0].clone()
    logits = out.logits[0, -1]
    tokens, steps = [], []
    for i in range(mm.DECODE_STEPS):
        steps.append(logits.clone())
        nxt = int(torch.argmax(logits)) if teacher is None else teacher[i]
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
    return {
        "hidden": hidden,
        "prefill_logits": prefill_logits,
        "tokens": tokens,
        "step_logits": torch.stack(steps),
        "router_topk": torch.stack([r[0] for r in prefill_routers]),
        "router_gap_ulp": torch.stack([r[1] / r[2] for r in prefill_routers]),
    }


def gap(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


def margins(step_logits: torch.Tensor) -> list[float]:
    top2 = torch.topk(step_logits.float(), 2, dim=-1).values
    return [float(x) for x in (top2[:, 0] - top2[:, 1])]


def gdn_paths() -> dict:
    """Which GDN kernels ran. The HF GDN calls module-level functions decorated with a hub-kernel
    fallback; without fla / causal_conv1d the torch reference implementations run (the log says so)."""
    from transformers.utils.import_utils import is_causal_conv1d_available, is_flash_linear_attention_available

    return {
        "flash_linear_attention_installed": bool(is_flash_linear_attention_available()),
        "causal_conv1d_installed": bool(is_causal_conv1d_available()),
        "prefill": "torch_chunk_gated_delta_rule (chunk 64) + causal_conv1d_fn torch reference (F.conv1d)",
        "decode": "torch_recurrent_gated_delta_rule + causal_conv1d_update torch reference",
    }


def golden(name: str, loader, fake_quant: bool) -> None:
    out = GOLDEN / name
    out.mkdir(parents=True, exist_ok=True)
    ids = mm.prompt_ids()
    args = token_args() if fake_quant else None

    model = loader(torch.bfloat16)
    fq_modules = install_fake_quant(model, args) if fake_quant else []
    r = run(model, ids)
    paths = gdn_paths()
    impl = model.config.text_config._experts_implementation

    # Self-check: the patched experts forward is HF's grouped_mm forward when fake quant is off.
    if fake_quant:
        ex = model.model.language_model.layers[0].mlp.experts
        h = torch.randn(9, ex.hidden_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
        idx = torch.stack([torch.randperm(ex.num_experts)[:4] for _ in range(9)])
        w = torch.softmax(torch.randn(9, 4), -1).bfloat16()
        from transformers.integrations.moe import grouped_mm_experts_forward

        assert torch.equal(experts_forward_fq(ex, h, idx, w, None), grouped_mm_experts_forward(ex, h, idx, w))

    m32 = loader(torch.float32)
    if fake_quant:
        install_fake_quant(m32, args)
    r32 = run(m32, ids, teacher=r["tokens"])  # teacher-forced on the bf16 tokens: comparable step by step

    tensors = {
        "prompt_ids": ids[0].to(torch.int64),
        "prefill_logits": r["prefill_logits"].to(torch.bfloat16),
        "prefill_logits_fp32": r32["prefill_logits"].float(),
        "greedy_tokens": torch.tensor(r["tokens"], dtype=torch.int64),
        "step_logits": r["step_logits"].to(torch.bfloat16),
        "step_logits_fp32": r32["step_logits"].float(),
        "router_topk": r["router_topk"].to(torch.int64),
        "router_gap_ulp": r["router_gap_ulp"].float(),
    }
    for i in CAPTURE_LAYERS:
        tensors[f"hidden_after_layer_{i}"] = r["hidden"][i].to(torch.bfloat16)  # [T, hidden], every prompt token
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "golden.safetensors"))

    per_layer = {str(i): gap(r["hidden"][i], r32["hidden"][i]) for i in CAPTURE_LAYERS}
    meta = {
        "generator": "tests/generators/golden_forward.py",
        "versions": mm.versions(),
        "fixture": f"tests/fixtures/{'micro-fp8' if fake_quant else 'micro-bf16'}",
        "dtype": "bfloat16 (oracle); fp32 run for the gap",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "experts_implementation": impl,
        "gdn_paths": paths,
        "transformers_path_log": sorted(set(_PATH_LOG)),
        "prompt": {"seed": mm.PROMPT_SEED, "len": mm.PROMPT_LEN, "ids_below": 1000},
        "decode_steps": mm.DECODE_STEPS,
        "captured_layers": CAPTURE_LAYERS,
        "fake_quant": (
            {
                "function": "compressed_tensors.quantization.lifecycle.forward.fake_quantize with "
                "compute_dynamic_scales_and_zp (strategy token) on the activation viewed as [1, T, in]",
                "args": json.loads(args.model_dump_json()),
                "modules_hooked": fq_modules,
                "experts": "Qwen3_5MoeExperts.forward patched: per-token fake quant of each expert's input rows and of act before down_proj",
            }
            if fake_quant
            else None
        ),
        "greedy_tokens": r["tokens"],
        "greedy_top1_top2_margins": margins(r["step_logits"]),
        "fp32_greedy_tokens_free_run": None,
        "router_near_ties_prefill": int((r["router_gap_ulp"] <= 2).sum()),
        "oracle_gap_bf16_vs_fp32": {
            "prefill_logits": gap(r["prefill_logits"], r32["prefill_logits"]),
            "step_logits_teacher_forced": gap(r["step_logits"], r32["step_logits"]),
            "hidden_after_layer": per_layer,
            "router_topk_disagreements_prefill": int((r["router_topk"].sort(-1).values != r32["router_topk"].sort(-1).values).any(-1).sum()),
        },
    }
    free32 = run(m32, ids)
    meta["fp32_greedy_tokens_free_run"] = free32["tokens"]
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({name: meta["oracle_gap_bf16_vs_fp32"], "paths": paths, "log": meta["transformers_path_log"]}, indent=2))


def act_quant_reference() -> None:
    """Random bf16 activations with edge cases, and compressed-tensors' quantised output."""
    args = token_args()
    g = torch.Generator().manual_seed(7)
    c = 64
    rows = [torch.randn(c, generator=g) * s for s in (1.0, 0.01, 30.0, 1000.0)]
    rows.append(torch.zeros(c))  # all-zero row: scale 0 -> eps
    rows.append(torch.full((c,), -0.0))  # all negative zero
    r = torch.randn(c, generator=g)
    r[::7] = -0.0
    rows.append(r)  # negative zeros among normal values
    r = torch.randn(c, generator=g) * 1e-3
    r[5] = 1e4
    rows.append(r)  # one huge outlier: the rest lands in the E4M3 subnormal range or flushes to 0
    r = torch.randn(c, generator=g) * 0.02
    r[0] = 448.0 * 1.4
    rows.append(r)  # most values x/s < 2^-6: subnormal E4M3 codes
    # amax whose amax/448 rounds DOWN in bf16, so amax/scale > 448 and the clamp saturates
    for amax in (1.0 + 3 / 128, 3.0 + 7 / 64, 449.0 * 8):
        r = torch.rand(c, generator=g) * 2 - 1
        r = r / r.abs().max() * amax * 0.9
        r[3] = -amax
        rows.append(r)
    rows.append(torch.randn(c, generator=g) * 1e-36)  # scale in bf16 subnormal range
    rows.append(torch.tensor([(-1) ** i * 2.0 ** (i % 20 - 10) for i in range(c)]))  # exact powers of two
    x = torch.stack(rows).to(torch.bfloat16)
    codes, scale = act_quantize(x, args)
    fq = act_fake_quant(x, args)
    # consistency: fake quant == bf16(codes * scale)
    assert torch.equal(fq, (codes.to(torch.bfloat16) * scale).to(torch.bfloat16))
    sat = (x.float().abs() / scale.float() > 448).any(-1)
    out = GOLDEN / "micro-fp8"
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {"x": x, "codes": codes.contiguous(), "codes_u8": codes.view(torch.uint8).clone(), "scale": scale.contiguous(), "fake_quant": fq},
        str(out / "act_quant.safetensors"),
    )
    (out / "act_quant.json").write_text(json.dumps({
        "rows": x.shape[0], "cols": c,
        "saturating_rows": [int(i) for i in torch.nonzero(sat).flatten()],
        "row_meaning": ["randn*1", "randn*0.01", "randn*30", "randn*1000", "all zero", "all -0.0",
                        "randn with -0.0 every 7th", "1e-3 noise + one 1e4 outlier", "0.02 noise + one 627.2",
                        "amax 1.0234375 (scale rounds down)", "amax 3.109375", "amax 3592", "randn*1e-36 (bf16 subnormal scale)",
                        "+-powers of two 2^-10..2^9"],
        "versions": mm.versions(),
    }, indent=2) + "\n")
    print(f"act_quant: {x.shape[0]} rows, saturating rows {sat.nonzero().flatten().tolist()}")


def main() -> None:
    h = _Collect()
    for lg in ("transformers", ""):
        logging.getLogger(lg).addHandler(h)
    torch.manual_seed(0)
    golden("micro-fp8", load_fp8, fake_quant=True)
    golden("micro-bf16", load_bf16, fake_quant=False)
    act_quant_reference()


if __name__ == "__main__":
    main()
