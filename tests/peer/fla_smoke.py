#!/usr/bin/env python3
"""GPU smoke test of the Gated DeltaNet kernels transformers resolved (flash-linear-attention when importable)
against transformers' own torch reference, at Ornith's real GDN shape (32 value heads, 16 key heads repeated to
32 as the model does, head dims 128), one chunked prefill of T tokens then one recurrent step.

Prints the max |difference| of outputs and final states relative to the reference's max |value|. Both run in
fp32 internally on BF16 inputs; the chunked and recurrent forms sum in different orders, so they agree to fp32
rounding accumulated over T steps, not bit for bit. Pass: relative difference < 2e-2 (BF16 output rounding is
2^-8 = 3.9e-3 relative; the bound leaves room for the kernels' TF32/BF16 intermediate products).
Usage: python3 tests/peer/fla_smoke.py [T]   (needs a CUDA GPU)
"""
import sys

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_peer import resolved_implementation  # noqa: E402


def main() -> int:
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    H, K, V = 32, 128, 128
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q = r(1, T + 1, H, K).bfloat16()
    k = r(1, T + 1, H, K).bfloat16()
    v = r(1, T + 1, H, V).bfloat16()
    beta = torch.sigmoid(r(1, T + 1, H)).bfloat16()
    # g = -exp(A_log) * softplus(a + dt_bias) as the model computes it (fp32, <= 0)
    gl = (-torch.exp(torch.rand(H, device=dev, generator=g) * 2) * F.softplus(r(1, T + 1, H))).float()
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    impls = {
        "chunk": resolved_implementation(M.torch_chunk_gated_delta_rule),
        "recurrent": resolved_implementation(M.torch_recurrent_gated_delta_rule),
    }
    print(f"fla_smoke: T={T}, H={H}, K={K}, V={V}; resolved {impls}")
    out, st = M.torch_chunk_gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], g=gl[:, :T], beta=beta[:, :T], **kw)
    o1, st1 = M.torch_recurrent_gated_delta_rule(q[:, T:], k[:, T:], v[:, T:], g=gl[:, T:], beta=beta[:, T:],
                                                 initial_state=st, **kw)
    torch.cuda.synchronize()
    # Reference: transformers' torch implementations (the undecorated functions).
    ref_chunk = M.torch_chunk_gated_delta_rule.__wrapped__
    ref_rec = M.torch_recurrent_gated_delta_rule.__wrapped__
    rout, rst = ref_chunk(q[:, :T], k[:, :T], v[:, :T], g=gl[:, :T], beta=beta[:, :T], **kw)
    ro1, rst1 = ref_rec(q[:, T:], k[:, T:], v[:, T:], g=gl[:, T:], beta=beta[:, T:], initial_state=rst, **kw)
    worst = 0.0
    for name, a, b in (("prefill out", out, rout), ("prefill state", st, rst), ("step out", o1, ro1), ("step state", st1, rst1)):
        rel = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        worst = max(worst, rel)
        print(f"fla_smoke: {name:14s} {tuple(a.shape)} {a.dtype}: max|diff|/max|ref| = {rel:.2e}")
    ok = worst < 2e-2
    print(f"fla_smoke: {'PASS' if ok else 'FAIL'} (worst {worst:.2e}, bound 2e-2)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
