#!/usr/bin/env python3
"""Builds the *micro NVFP4A16* fixture with the vendor tools, and its goldens.

Input: the committed tests/fixtures/micro-bf16/ (make_micro.py; the same random model).
Outputs (committed):
  tests/fixtures/micro-nvfp4/             llm-compressor `oneshot(QuantizationModifier(targets="Linear",
                                          scheme="NVFP4A16", ignore=<6 vendor patterns>))`, saved compressed;
                                          untouched (incl. recipe.yaml)
  tests/fixtures/micro-nvfp4.json         versions and what the tool wrote (observed from the files)
  tests/golden/micro-nvfp4/dequant.safetensors
                                          compressed-tensors' own decompressor output (`weight`, BF16 [out, in])
                                          for every non-expert NVFP4 Linear and experts 0 and 15 of each layer,
                                          named `{module}.weight` (all 208 are checked against the formula here)
  tests/golden/micro-nvfp4/golden.safetensors + meta.json
                                          transformers (CompressedTensorsConfig(run_compressed=False): weights
                                          decompressed on load, BF16 activations; routed experts replaced by the
                                          decompressor's, see run_transformers) prefill logits and greedy tokens
                                          for the make_micro prompt
  tests/golden/micro-nvfp4/nibbles.json   pack_fp4_to_uint8 / unpack_fp4_from_uint8 on the 16 codes: which
                                          nibble comes first, the E2M1 table

Run: /work/pyenv/bin/python tests/generators/make_micro_nvfp4.py   (CPU, ~30 s)
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_micro  # noqa: E402  (same model, prompt, ignore list, versions)

ROOT = make_micro.ROOT
SRC = make_micro.OUT_BF16
OUT = make_micro.FIXTURES / "micro-nvfp4"
RECORD = make_micro.FIXTURES / "micro-nvfp4.json"
GOLDEN = ROOT / "tests" / "golden" / "micro-nvfp4"
DECODE_STEPS = 8


def quantise():
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(SRC), dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=list(make_micro.VENDOR_IGNORE))
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(OUT), save_compressed=True)


def decompress_all():
    """Every NVFP4 Linear through the format's registered decompressor with the scheme parsed from the
    written config.json — the vendor's own dequantisation, element for element."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    cfg = json.loads((OUT / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert len(qcfg.config_groups) == 1
    scheme = next(iter(qcfg.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qcfg.format)
    out = {}
    mine_equal = 0
    with safe_open(str(OUT / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            if not name.endswith(".weight_packed"):
                continue
            m = name[: -len(".weight_packed")]
            sd = {
                "weight_packed": f.get_tensor(name),
                "weight_scale": f.get_tensor(m + ".weight_scale"),
                "weight_global_scale": f.get_tensor(m + ".weight_global_scale"),
            }
            w = compressor.decompress(sd, scheme)["weight"]
            out[m + ".weight"] = w.contiguous()
            # The formula the engine implements, written out independently:
            # bf16( e2m1(code) * f32( f32(e4m3 scale) / global_scale ) ), low nibble = even column.
            p = sd["weight_packed"]
            codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], -1).long()
            table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
            v = table[codes]
            s = sd["weight_scale"].float() / sd["weight_global_scale"].float()
            mine = (v * s.repeat_interleave(16, dim=1)).to(torch.bfloat16)
            mine_equal += int(torch.equal(mine.view(torch.int16), w.view(torch.int16)))
    return scheme, compressor, out, mine_equal


def nibble_probe():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    # Row [a, b]: which nibble of the byte holds a?
    pair = pack_fp4_to_uint8(torch.tensor([[0.5, -6.0]], dtype=torch.bfloat16))
    packed_all = pack_fp4_to_uint8(vals.reshape(1, 16).to(torch.bfloat16))
    codes = list(range(16))
    bytes_ = torch.tensor([[c | (((c + 5) % 16) << 4) for c in codes]], dtype=torch.uint8)
    unpacked = unpack_fp4_from_uint8(bytes_, 1, 32, dtype=torch.float32)[0].tolist()
    return {
        "pack([[0.5, -6.0]])": int(pair[0, 0]),
        "pack(e2m1 table order)": [int(b) for b in packed_all[0]],
        "unpack_bytes": [int(b) for b in bytes_[0]],
        "unpack_values": unpacked,
    }


def expert_slices(lm, name):
    """The fused-expert slice transformers holds for a per-expert module name on disk."""
    parts = name.split(".")
    layer, e, proj = int(parts[3]), int(parts[6]), parts[7]
    ex = lm.layers[layer].mlp.experts
    inter = ex.down_proj.shape[-1]
    if proj == "gate_proj":
        return ex.gate_up_proj.data[e][:inter]
    if proj == "up_proj":
        return ex.gate_up_proj.data[e][inter:]
    return ex.down_proj.data[e]


@torch.no_grad()
def run_transformers(deq):
    """transformers loads the fixture decompressed (BF16 weights, plain nn.Linear forwards: input
    activations are not quantised). Checked here, not assumed: every non-expert NVFP4 Linear it holds equals
    the decompressor's output. Its fused routed experts do NOT (transformers 5.17 drops
    `weight_global_scale` of per-expert Linears as UNEXPECTED keys while fusing them, so they come out
    multiplied by the global scale): the oracle overwrites them with the decompressor's weights."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForImageTextToText.from_pretrained(
        str(OUT),
        dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(run_compressed=False),
        experts_implementation="grouped_mm",
    ).eval()
    lm = model.model.language_model
    linears_equal, experts_equal_before, ratio = True, True, None
    for name, w in deq.items():
        if ".mlp.experts." in name:
            got = expert_slices(lm, name)
            experts_equal_before &= torch.equal(got, w)
            if ratio is None:
                nz = w != 0
                ratio = float((got.float()[nz] / w.float()[nz]).median())
            got.copy_(w)
        else:
            lin = model.get_submodule(name[: -len(".weight")])
            linears_equal &= torch.equal(lin.weight, w)
            x = torch.randn(3, lin.in_features).to(torch.bfloat16)
            linears_equal &= torch.equal(lin(x), torch.nn.functional.linear(x, w))
    ids = make_micro.prompt_ids()
    logits = model(input_ids=ids).logits[0].contiguous()
    tokens, margins = make_micro.greedy(model, ids, DECODE_STEPS)
    # The oracle's own precision: the same dequantised weights in fp32.
    model = model.float()
    logits32 = model(input_ids=ids).logits[0].float().contiguous()
    d = (logits.float() - logits32).abs()
    checks = {
        "oracle_gap_bf16_vs_fp32_prefill_logits": {"max_abs": float(d.max()), "mean_abs": float(d.mean())},
        "transformers_nonexpert_linears_equal_decompressor_and_forward_is_plain_linear": bool(linears_equal),
        "transformers_fused_experts_equal_decompressor_as_loaded": bool(experts_equal_before),
        "transformers_fused_experts_over_decompressor_median_ratio": ratio,
    }
    return ids, logits, logits32, tokens, margins, checks


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    assert (SRC / "model.safetensors").exists(), "run make_micro.py first (tests/fixtures/micro-bf16)"
    if OUT.exists():
        shutil.rmtree(OUT)
    quantise()

    from safetensors.torch import save_file

    stored = make_micro.tensor_table(OUT)
    cfg = json.loads((OUT / "config.json").read_text())
    scheme, compressor, deq, mine_equal = decompress_all()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    # Committed subset (size): every non-expert NVFP4 Linear and experts 0 and 15 of every layer.
    keep = {n: w for n, w in deq.items() if ".mlp.experts." not in n or n.split(".")[6] in ("0", "15")}
    save_file(keep, str(GOLDEN / "dequant.safetensors"), metadata={"generator": "tests/generators/make_micro_nvfp4.py"})

    ids, logits, logits32, tokens, margins, checks = run_transformers(deq)
    save_file(
        {
            "prompt_ids": ids[0].contiguous(),
            "prefill_logits": logits,
            "prefill_logits_fp32": logits32,
            "greedy_tokens": torch.tensor(tokens),
        },
        str(GOLDEN / "golden.safetensors"),
    )

    q = cfg["quantization_config"]
    observed = {
        "tensor_count": len(stored),
        "dtypes": sorted({dt for dt, _ in stored.values()}),
        "nvfp4_linear_count": sum(1 for n in stored if n.endswith(".weight_packed")),
        "suffixes_of_quantised": sorted({n.rsplit(".", 1)[1] for n in stored if n.rsplit(".", 1)[0] + ".weight_packed" in stored}),
        "weight_packed_dtype_shape_ok": all(
            stored[n][0] == "U8" and stored[n[: -len("_packed")] + "_scale"][1] == [stored[n][1][0], stored[n][1][1] * 2 // 16]
            for n in stored if n.endswith(".weight_packed")
        ),
        "weight_scale_dtypes": sorted({stored[n][0] for n in stored if n.endswith(".weight_scale")}),
        "weight_global_scale": sorted({(stored[n][0], str(stored[n][1])) for n in stored if n.endswith(".weight_global_scale")}),
        "bf16_weights": sorted(n for n, (dt, s) in stored.items() if n.endswith(".weight") and dt == "BF16" and len(s) == 2 and "visual" not in n),
        "quantization_config": q,
        "decompressor": f"{type(compressor).__name__} ({q['format']})",
        "decompressed_equals_bf16_of_e2m1_times_f32_scale_over_global": mine_equal == len(deq),
        "decompressed_linears": len(deq),
        **checks,
        "nibbles": nibble_probe(),
    }
    record = {
        "generator": "tests/generators/make_micro_nvfp4.py",
        "versions": make_micro.versions(),
        "source": "tests/fixtures/micro-bf16 (make_micro.py)",
        "recipe": {"targets": "Linear", "scheme": "NVFP4A16", "ignore": make_micro.VENDOR_IGNORE},
        "files": sorted(p.name for p in OUT.iterdir()),
        "size_bytes": sum(p.stat().st_size for p in OUT.iterdir()),
        "observed": observed,
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    meta = {
        "generator": "tests/generators/make_micro_nvfp4.py",
        "versions": make_micro.versions(),
        "oracle": "transformers AutoModelForImageTextToText, CompressedTensorsConfig(run_compressed=False), bf16, grouped_mm",
        "greedy_tokens": tokens,
        "greedy_margins": margins,
        "oracle_gap_bf16_vs_fp32": {"prefill_logits": checks["oracle_gap_bf16_vs_fp32_prefill_logits"]},
    }
    (GOLDEN / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
