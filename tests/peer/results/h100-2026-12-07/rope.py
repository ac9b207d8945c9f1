# Compares bf16 cos/sin at positions 0..n-1 (rot 64, theta 1e7) from transformers' formula (torch, CPU
# and CUDA) with the CUDA kernel's current formula (v0) and a host inv_freq + double cos (v1).
import sys, subprocess, numpy as np, torch
n = int(sys.argv[1]); half = 32; rot = 64; theta = 10000000.0
inv_t = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).to(dtype=torch.float) / rot))
# host proposal: f32(pow_f64(theta, f32 exponent)), then an f32 division (torch's two roundings)
e = (np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)).astype(np.float32)
p = np.power(np.float64(theta), e.astype(np.float64)).astype(np.float32)
inv_h = (np.float32(1.0) / p).astype(np.float32)
inv_h.tofile("/tmp/inv.bin")
print("inv_freq torch vs host (f64 pow): differing bits", int((inv_t.numpy().view(np.uint32) != inv_h.view(np.uint32)).sum()), "of", half)
print("inv_freq torch vs numpy f32 powf:", int((inv_t.numpy().view(np.uint32) != (np.float32(1)/np.power(np.float32(theta), e)).view(np.uint32)).sum()))
subprocess.run(["/tmp/rope_bin", str(n), "/tmp/inv.bin", "/tmp/rope_out.bin"], check=True)
raw = np.fromfile("/tmp/rope_out.bin", dtype=np.uint8)
plane = n * half
tabs = raw[: 12 * plane].view(np.uint16).reshape(6, n, half)
inv_cuda = raw[12 * plane:].view(np.float32)
print("inv_freq torch vs CUDA powf: differing bits", int((inv_t.numpy().view(np.uint32) != inv_cuda.view(np.uint32)).sum()),
      "max ulp", int(np.abs(inv_t.numpy().view(np.int32).astype(np.int64) - inv_cuda.view(np.int32)).max()))
pos = torch.arange(n, dtype=torch.int64)
for dev in ["cpu", "cuda"]:
    freqs = (inv_t.to(dev)[:, None].float() @ pos.to(dev)[None, :].float()).transpose(0, 1)
    ref_c = freqs.cos().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    ref_s = freqs.sin().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    for name, c, s in [("v0 powf/cosf", tabs[0], tabs[1]), ("v1 host inv + double", tabs[2], tabs[3]), ("v2 host inv + cosf", tabs[4], tabs[5])]:
        for lo, hi in [(0, 4096), (4096, 32768), (32768, 131072), (131072, n)]:
            if lo >= n: continue
            dc = (c[lo:hi] != ref_c[lo:hi]).sum() + (s[lo:hi] != ref_s[lo:hi]).sum()
            tot = 2 * (min(hi, n) - lo) * half
            print(f"torch-{dev} vs {name} pos {lo}..{min(hi,n)}: {dc} of {tot} bf16 values differ ({dc/tot:.2e})")
