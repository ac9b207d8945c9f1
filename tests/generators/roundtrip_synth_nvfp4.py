"""Reads OUR synthetic NVFP4A16 checkpoint (`cargo xtask synth --preset tiny --quant nvfp4a16`) back
through the vendor's own decompressor and records the result in tests/fixtures/synth_roundtrip_nvfp4.json:

1. compressed-tensors' `nvfp4-pack-quantized` compressor (`NVFP4PackedCompressor`), with the scheme
   parsed from our config.json, dequantises every NVFP4 Linear; the sha256 of each result (BF16 bytes,
   row-major) is recorded, and tests/tests/synth_roundtrip.rs recomputes them from
   `model_spec::nvfp4::dequantize` on a freshly synthesised checkpoint: identical dequantised values.
2. transformers loads the directory as a compressed-tensors checkpoint (decompressing on load) and
   runs a forward pass with finite logits.

Usage (from the repo root, with the venv of tests/generators/requirements.txt):
    cargo xtask synth --preset tiny --quant nvfp4a16 --out /tmp/ornith-tiny-nvfp4
    python tests/generators/roundtrip_synth_nvfp4.py /tmp/ornith-tiny-nvfp4
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
    assert qcfg.format == "nvfp4-pack-quantized", qcfg.format
    scheme = next(iter(qcfg.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qcfg.format)

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard = {}
    for name, shard in index.items():
        by_shard.setdefault(shard, []).append(name)
    digests = {}
    elements = 0
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(ckpt / shard), "pt") as f:
            for name in sorted(names):
                if not name.endswith(".weight_packed"):
                    continue
                module = name[: -len(".weight_packed")]

                def get(n):
                    return f.get_tensor(n) if n in names else safe_open(str(ckpt / index[n]), "pt").get_tensor(n)

                sd = {
                    "weight_packed": get(name),
                    "weight_scale": get(module + ".weight_scale"),
                    "weight_global_scale": get(module + ".weight_global_scale"),
                }
                w = compressor.decompress(sd, scheme)["weight"]
                assert w.dtype == torch.bfloat16
                digests[module] = hashlib.sha256(w.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
                elements += w.numel()
    assert digests

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[248045, 872, 198, 9707, 248046, 198]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    finite = bool(torch.isfinite(logits).all())

    result = {
        "generator": "tests/generators/roundtrip_synth_nvfp4.py",
        "checkpoint": "cargo xtask synth --preset tiny --quant nvfp4a16 (default seed)",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compressed-tensors": compressed_tensors.__version__,
        },
        "decompressor": f"{type(compressor).__name__} ({qcfg.format}), scheme from our config.json",
        "nvfp4_linears_checked": len(digests),
        "elements_checked": elements,
        "dequantised_sha256_bf16": digests,
        "transformers_load_and_forward": {"class": type(model).__name__, "logits_shape": list(logits.shape), "finite": finite},
    }
    out = Path(__file__).resolve().parents[1] / "fixtures" / "synth_roundtrip_nvfp4.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "dequantised_sha256_bf16"}, indent=2))
    assert finite


if __name__ == "__main__":
    main()
