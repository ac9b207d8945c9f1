"""Reads OUR synthetic checkpoint (`cargo xtask synth --preset tiny`) back through the vendor's own
tools and records the result in tests/fixtures/synth_roundtrip.json:

1. compressed-tensors' decompressor (the `float-quantized` compressor with the scheme parsed from our
   config.json) dequantises every FP8 Linear; the result must equal `bf16(e4m3 · weight_scale)`
   computed independently here, for every element of every FP8 weight, and the sha256 of each
   result (BF16 bytes, little-endian, row-major) is recorded, so that tests/tests/synth_roundtrip.rs
   can recompute it in Rust from a freshly synthesised checkpoint (the generator's bytes and our
   reading of the E4M3 codes and per-channel scales, both checked against the vendor's values).
2. transformers loads the directory as a compressed-tensors checkpoint (decompressing on load) and
   runs a forward pass with finite logits.

Usage (from the repo root, with the venv of tests/generators/requirements.txt):
    cargo xtask synth --preset tiny --out /tmp/ornith-tiny
    python tests/generators/roundtrip_synth.py /tmp/ornith-tiny
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ckpt = Path(sys.argv[1])
    import compressed_tensors
    import transformers
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = json.loads((ckpt / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])
    scheme = next(iter(qcfg.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qcfg.format)

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard = {}
    for name, shard in index.items():
        by_shard.setdefault(shard, []).append(name)
    checked = mismatched = elements = 0
    digests = {}
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(ckpt / shard), "pt") as f:
            keys = set(names)
            for name in sorted(keys):
                if not name.endswith(".weight") or f.get_slice(name).get_dtype() != "F8_E4M3":
                    continue
                module = name[: -len(".weight")]
                w = f.get_tensor(name)
                s = f.get_tensor(module + ".weight_scale")
                out = compressor.decompress({"weight": w, "weight_scale": s}, scheme)["weight"]
                ours = (w.float() * s.float()).to(out.dtype)
                checked += 1
                elements += w.numel()
                if not torch.equal(out, ours):
                    mismatched += 1
                assert out.dtype == torch.bfloat16, out.dtype
                digests[module] = hashlib.sha256(out.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
    assert checked > 0

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[248045, 872, 198, 9707, 248046, 198]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    finite = bool(torch.isfinite(logits).all())

    result = {
        "generator": "tests/generators/roundtrip_synth.py",
        "checkpoint": "cargo xtask synth --preset tiny (default seed)",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compressed-tensors": compressed_tensors.__version__,
        },
        "decompressor": f"{type(compressor).__name__} ({qcfg.format}), scheme from our config.json",
        "fp8_linears_checked": checked,
        "elements_checked": elements,
        "fp8_linears_mismatched": mismatched,
        "dequantised_equals_bf16_of_e4m3_times_scale": mismatched == 0,
        "dequantised_sha256_bf16": digests,
        "transformers_load_and_forward": {"class": type(model).__name__, "logits_shape": list(logits.shape), "finite": finite},
    }
    out = Path(__file__).resolve().parents[1] / "fixtures" / "synth_roundtrip.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "dequantised_sha256_bf16"}, indent=2))
    assert mismatched == 0 and finite


if __name__ == "__main__":
    main()
