#!/usr/bin/env python3
"""Peer benchmark: Hugging Face transformers on the same checkpoint as `ornith-bench`, same GPU, same run.

What it does
  1. Loads the *text* model of an Ornith/Qwen3.5-MoE compressed-tensors FP8 checkpoint into transformers'
     `Qwen3_5MoeForCausalLM` (BF16 activations) on the chosen device, shard by shard, straight onto the device
     (no full host copy). Each FP8 Linear is dequantised as  W_bf16[o, i] = bf16(float(W_e4m3[o, i]) * float(s[o]))
     with the per-output-row `weight_scale [out, 1]` - the same arithmetic transformers' own
     `from_pretrained(..., CompressedTensorsConfig(dequantize=True))` uses (checked bit for bit by `--check`).
     Unquantised tensors keep their checkpoint dtype (BF16, and F32 for `linear_attn.A_log` / `linear_attn.norm`),
     which is also what `from_pretrained` does for this pre-quantised checkpoint. Per-expert Linears
     `mlp.experts.{e}.{gate,up,down}_proj` are stacked into the fused parameters transformers' weight loader
     builds: `gate_up_proj [E, 2I, H] = concat(gate_e, up_e)` along dim 1, `down_proj [E, H, I]`.
     `model.visual.*` and `mtp.*` are skipped (the causal-LM class does not hold them); any other tensor that
     does not map onto a parameter, any parameter left unfilled, any shape mismatch, an FP8 tensor without a
     scale or a scale without its weight is an error.
  2. Benchmarks batch 1 like `ornith-bench`: warm-up, then for each prompt length the same pseudo-random token
     ids as ornith-bench (its LCG): TTFT = one forward over the prompt with transformers' own cache
     (`use_cache=True`, `logits_to_keep=1`) + argmax, synchronised; prefill tok/s = prompt / TTFT; decode
     tok/s over `--gen` greedy one-token forwards reusing the returned cache.
  3. Reports the fast paths actually in use: which function transformers resolved for the Gated DeltaNet
     chunk / recurrent kernels and the causal conv1d (flash-linear-attention / causal-conv1d / torch reference),
     attention and experts implementations, and (with --profile) the kernels that really ran in one prefill and
     one decode step, marking those that are flash-linear-attention Triton kernels.
  4. With `--ornith-json` (ornith-bench's stdout) prints a side-by-side table and the ratios ornith / transformers.
  5. Writes everything, with package/GPU/driver versions, as JSON to `--out`.

Run `python3 tests/peer/hf_peer.py --help`; see tests/peer/README.md.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

TEXT_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def log(msg: str) -> None:
    print(f"hf_peer: {msg}", file=sys.stderr, flush=True)


class PeerError(Exception):
    pass


# ----------------------------------------------------------------------------------------------------------------
# versions and fast paths


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(device: torch.device) -> dict:
    import transformers

    v = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "flash-linear-attention": dist_version("flash-linear-attention"),
        "fla-core": dist_version("fla-core"),
        "triton": dist_version("triton"),
        "causal-conv1d": dist_version("causal-conv1d"),
        "safetensors": dist_version("safetensors"),
        "einops": dist_version("einops"),
        "kernels": dist_version("kernels"),
    }
    try:
        import fla  # noqa: F401

        v["fla_module_file"] = getattr(fla, "__file__", None)
        v["fla_import_error"] = None
    except Exception as e:  # report why, never guess
        v["fla_module_file"] = None
        v["fla_import_error"] = f"{type(e).__name__}: {e}"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        v["gpu"] = torch.cuda.get_device_name(device)
        v["gpu_capability"] = f"sm_{p.major}{p.minor}"
        v["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.strip().splitlines()
            v["nvidia_smi"] = out
            v["driver"] = out[0].split(",")[-1].strip() if out else None
        except Exception as e:
            v["driver"] = None
            v["nvidia_smi_error"] = f"{type(e).__name__}: {e}"
    else:
        v["cpu"] = platform.processor() or platform.machine()
        v["torch_threads"] = torch.get_num_threads()
    return v


def resolved_implementation(fn) -> str:
    """Which function transformers will call for a `use_kernel_func_from_hub_with_fallback` op.

    transformers resolves the implementation once, when its modeling module is imported (package import, else
    the torch reference), and keeps it in the wrapper's closure variable `implementation`."""
    seen = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None)
        if code is None or cells is None:
            continue
        names = dict(zip(code.co_freevars, cells))
        if "implementation" in names:
            impl = names["implementation"].cell_contents
            return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}"
        stack.extend(c.cell_contents for c in cells if callable(getattr(c, "cell_contents", None)))
    return f"unresolved wrapper {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def fast_paths(model) -> dict:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

    impl = {
        "chunk_gated_delta_rule (GDN prefill)": resolved_implementation(M.torch_chunk_gated_delta_rule),
        "fused_recurrent_gated_delta_rule (GDN decode)": resolved_implementation(M.torch_recurrent_gated_delta_rule),
        "causal_conv1d_fn (GDN conv, prefill)": resolved_implementation(M.causal_conv1d_fn),
        "causal_conv1d_update (GDN conv, decode)": resolved_implementation(M.causal_conv1d_update),
    }
    return {
        "gdn_ops": impl,
        "gdn_uses_fla": all(v.startswith("fla.") for k, v in impl.items() if "delta_rule" in k),
        "conv_uses_causal_conv1d": all(v.startswith("causal_conv1d") for k, v in impl.items() if "conv1d" in k),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": model.config._experts_implementation,
        "torch_sdp_backends_enabled": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        },
        "torch_compile": False,
        "cuda_graphs": False,
    }


def fla_triton_kernel_names() -> set[str]:
    """Names of every Triton kernel defined in the imported flash-linear-attention modules (empty without fla)."""
    try:
        from triton.runtime.jit import JITFunction
    except Exception:
        return set()
    names = set()
    for modname, mod in list(sys.modules.items()):
        if not (modname == "fla" or modname.startswith("fla.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            f = obj
            for _ in range(4):  # autotune / heuristics wrappers hold the JITFunction in `.fn`
                if isinstance(f, JITFunction):
                    names.add(f.fn.__name__)
                    break
                f = getattr(f, "fn", None)
                if f is None:
                    break
    return names


# ----------------------------------------------------------------------------------------------------------------
# loading


def read_config(model_dir: Path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    text = getattr(cfg, "text_config", cfg)
    if text.model_type != "qwen3_5_moe_text":
        raise PeerError(f"{model_dir}: text model_type is {text.model_type!r}, expected 'qwen3_5_moe_text'")
    q = getattr(cfg, "quantization_config", None)
    q = q if isinstance(q, dict) or q is None else q.to_dict()
    return cfg, text, q


def check_quantization(q: dict | None) -> None:
    """The loader implements exactly the vendor's scheme: FP8 E4M3 weights, one scale per output channel."""
    if q is None:
        raise PeerError("config.json has no quantization_config: this loader reads the compressed-tensors FP8 export")
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "float-quantized":
        raise PeerError(f"unsupported quantization {q.get('quant_method')}/{q.get('format')}")
    for name, g in q.get("config_groups", {}).items():
        w = g.get("weights", {})
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (8, "float", "channel"):
            raise PeerError(f"quantization group {name}: weights {w} are not FP8 per-channel")


def build_skeleton(text_cfg):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    # Parameters on the meta device: no memory and no random init; every one is replaced from the checkpoint.
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM._from_config(text_cfg, dtype=torch.bfloat16)
    return model


def weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file, from model.safetensors.index.json or a single model.safetensors."""
    idx = model_dir / "model.safetensors.index.json"
    if idx.is_file():
        return json.loads(idx.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise PeerError(f"{model_dir}: neither model.safetensors.index.json nor model.safetensors")


def load_peer(model_dir: Path, device: torch.device, unquantised_dtype: torch.dtype | None = None):
    """Returns (model, load report). Loads shard by shard onto `device`; see the module docstring.

    `unquantised_dtype`: None keeps each unquantised tensor's checkpoint dtype (F32 `A_log` / gated-norm weight
    stay F32), as `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)` does for this checkpoint (its loader keeps
    the checkpoint dtype of every key it renames, and it renames them all: `model.language_model.` -> `model.`);
    torch.bfloat16 casts them, as `Qwen3_5MoeForConditionalGeneration.from_pretrained(dtype=bfloat16)` does."""
    from safetensors import safe_open
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    t0 = time.perf_counter()
    _, text_cfg, q = read_config(model_dir)
    check_quantization(q)
    model = build_skeleton(text_cfg)
    params = dict(model.named_parameters())
    E, I = text_cfg.num_experts, text_cfg.moe_intermediate_size

    index = weight_map(model_dir)
    by_shard: dict[str, list[str]] = {}
    for k, shard in index.items():
        by_shard.setdefault(shard, []).append(k)
    scales = {k for k in index if k.endswith(".weight_scale")}
    handles = {}

    def get(key: str) -> torch.Tensor:
        shard = index[key]
        if shard not in handles:
            handles[shard] = safe_open(str(model_dir / shard), framework="pt", device=str(device))
        return handles[shard].get_tensor(key)

    def assign(name: str, tensor: torch.Tensor) -> None:
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        old = mod._parameters[leaf]
        if old.device.type != "meta":
            raise PeerError(f"{name} is written twice")
        mod._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)

    fused: dict[str, torch.Tensor] = {}  # parameter name -> device tensor being filled
    filled: dict[str, torch.Tensor] = {}  # parameter name -> bool [E, parts]
    skipped = {p: 0 for p in SKIPPED_PREFIXES}
    used_scales = set()
    n_fp8 = n_plain = 0
    fp8_bytes = 0

    def dequant(key: str) -> torch.Tensor:
        nonlocal n_fp8, fp8_bytes
        w = get(key)
        sk = key + "_scale"
        if sk not in index:
            raise PeerError(f"{key} is {w.dtype} without {sk}")
        if w.dtype != torch.float8_e4m3fn:
            raise PeerError(f"{key}: has a weight_scale but dtype {w.dtype}, expected float8_e4m3fn")
        s = get(sk)
        if s.shape != (w.shape[0], 1):
            raise PeerError(f"{sk}: shape {tuple(s.shape)}, expected ({w.shape[0]}, 1) (one scale per output row)")
        used_scales.add(sk)
        n_fp8 += 1
        fp8_bytes += w.numel()
        # W_bf16[o, i] = bf16(float(W_e4m3[o, i]) * float(s[o, 0]))
        return (w.float() * s.float()).to(torch.bfloat16)

    for shard in sorted(by_shard):
        for key in sorted(by_shard[shard]):
            if key in scales:
                continue
            skip = next((p for p in SKIPPED_PREFIXES if key.startswith(p)), None)
            if skip:
                skipped[skip] += 1
                continue
            if key.startswith(TEXT_PREFIX):
                name = "model." + key[len(TEXT_PREFIX):]
            elif key.startswith("lm_head."):
                name = key
            else:
                raise PeerError(f"unexpected checkpoint tensor {key}")
            m = EXPERT_RE.match(name)
            if m:
                layer, e, kind = int(m.group(1)), int(m.group(2)), m.group(3)
                pname = f"model.layers.{layer}.mlp.experts." + ("down_proj" if kind == "down_proj" else "gate_up_proj")
                if pname not in params:
                    raise PeerError(f"unexpected checkpoint tensor {key}: no parameter {pname}")
                if e >= E:
                    raise PeerError(f"{key}: expert {e} >= num_experts {E}")
                if pname not in fused:
                    fused[pname] = torch.empty(params[pname].shape, dtype=torch.bfloat16, device=device)
                    filled[pname] = torch.zeros(E, 1 if kind == "down_proj" else 2, dtype=torch.bool)
                w = dequant(key + "")  # key ends in ".weight"
                part = {"gate_proj": 0, "up_proj": 1, "down_proj": 0}[kind]
                dst = fused[pname][e] if kind == "down_proj" else fused[pname][e, part * I:(part + 1) * I]
                if tuple(w.shape) != tuple(dst.shape):
                    raise PeerError(f"{key}: shape {tuple(w.shape)}, expected {tuple(dst.shape)}")
                if filled[pname][e, part]:
                    raise PeerError(f"{key} is written twice")
                dst.copy_(w)
                filled[pname][e, part] = True
                continue
            if name not in params:
                raise PeerError(f"unexpected checkpoint tensor {key} (no parameter {name})")
            want = params[name].shape
            if key + "_scale" in index:
                t = dequant(key)
            else:
                t = get(key)
                if t.dtype == torch.float8_e4m3fn:
                    raise PeerError(f"{key} is FP8 without {key}_scale")
                if unquantised_dtype is not None and t.is_floating_point():
                    t = t.to(unquantised_dtype)
                n_plain += 1
            if tuple(t.shape) != tuple(want):
                raise PeerError(f"{key}: shape {tuple(t.shape)}, expected {tuple(want)}")
            assign(name, t)

    for pname, t in fused.items():
        missing = (~filled[pname]).nonzero().tolist()
        if missing:
            raise PeerError(f"{pname}: no checkpoint tensor for (expert, part) {missing[:8]}{'...' if len(missing) > 8 else ''}")
        assign(pname, t)
    orphan_scales = sorted(s for s in scales - used_scales if not s.startswith(SKIPPED_PREFIXES))
    if orphan_scales:
        raise PeerError(f"weight_scale without its weight: {orphan_scales[:5]}")
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise PeerError(f"{len(missing)} parameters have no checkpoint tensor: {missing[:8]}")
    # The only buffers are RoPE's inverse frequencies (not in checkpoints): rebuild them on the device.
    with torch.device(device):
        model.model.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(config=text_cfg)
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise PeerError(f"buffers left on the meta device: {meta_buffers}")
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = {
        "load_s": time.perf_counter() - t0,
        "fp8_linears_dequantised": n_fp8,
        "fp8_weight_bytes": fp8_bytes,
        "unquantised_tensors": n_plain,
        "fused_expert_params": len(fused),
        "skipped_tensors": skipped,
        "missing_keys": [],
        "unexpected_keys": [],
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "parameter_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    return model, report


# ----------------------------------------------------------------------------------------------------------------
# benchmark


def ornith_prompt(n: int, vocab: int) -> list[int]:
    """ornith-bench's prompt: x <- x * 6364136223846793005 + 1442695040888963407 (mod 2^64); id = (x >> 33) % vocab."""
    x, out = 0x2545F4914F6CDD1D, []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % vocab)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model, ids: torch.Tensor):
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1), out.past_key_values, out.logits[:, -1]


@torch.inference_mode()
def decode(model, tok: torch.Tensor, cache, steps: int) -> list[torch.Tensor]:
    toks = []
    for _ in range(steps):
        out = model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        toks.append(tok)
    return toks


def bench(model, device: torch.device, prompts: list[int], gen: int, warmup_gen: int) -> list[dict]:
    vocab = model.config.vocab_size
    runs = []
    # Warm-up: one untimed prefill at every measured length (Triton JIT + autotune, cuBLAS heuristics,
    # allocator pools) and a few decode steps.
    for p in [64] + prompts:
        ids = torch.tensor([ornith_prompt(p, vocab)], device=device)
        tok, cache, _ = prefill(model, ids)
        decode(model, tok, cache, warmup_gen)
        del cache
    sync(device)
    for p in prompts:
        ids = torch.tensor([ornith_prompt(p, vocab)], device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        tok, cache, last = prefill(model, ids)
        tok_host = int(tok.item())  # the first token is on the host: TTFT ends here
        ttft = time.perf_counter() - t0
        top2 = last.float().topk(2, dim=-1).values[0]
        # Decode: each step's token comes back to the host, as in ornith-bench (its sampler returns the id) and
        # in transformers' generate(); the per-step times show any slow first steps.
        sync(device)
        step_s, toks = [], []
        t1 = time.perf_counter()
        for _ in range(gen):
            ts = time.perf_counter()
            tok = decode(model, tok, cache, 1)[0]
            toks.append(int(tok.item()))
            step_s.append(time.perf_counter() - ts)
        dec = time.perf_counter() - t1
        steps_sorted = sorted(step_s)
        run = {
            "prompt_tokens": p,
            "ttft_s": ttft,
            "prefill_tok_s": p / ttft,
            "decode_tokens": gen,
            "decode_tok_s": gen / dec if gen else None,
            "decode_ms_per_token": dec * 1e3 / gen if gen else None,
            "decode_step_ms_first": step_s[0] * 1e3 if gen else None,
            "decode_step_ms_median": steps_sorted[len(steps_sorted) // 2] * 1e3 if gen else None,
            "decode_step_ms_max": steps_sorted[-1] * 1e3 if gen else None,
            "decode_step_ms": [round(t * 1e3, 3) for t in step_s],
            "first_tokens": [tok_host] + toks[:7],
            # top-1 minus top-2 logit of the first token: on random weights it is often below BF16 resolution,
            # so another attention backend (or engine) may legitimately pick another first token.
            "first_token_logit_margin": (top2[0] - top2[1]).item(),
            "first_token_logit": top2[0].item(),
        }
        if device.type == "cuda":
            run["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        runs.append(run)
        log(f"prompt {p}: TTFT {ttft:.3f} s, prefill {p / ttft:,.0f} tok/s, decode {run['decode_tok_s'] or 0:.2f} tok/s "
            f"(step ms: first {run['decode_step_ms_first'] or 0:.1f}, median {run['decode_step_ms_median'] or 0:.1f}, "
            f"max {run['decode_step_ms_max'] or 0:.1f})")
        del cache
    return runs


@torch.inference_mode()
def profile(model, device: torch.device, prompt_len: int, top: int = 25) -> dict:
    """Kernels (CUDA) or ops (CPU) of one prefill of `prompt_len` tokens and one decode step, by self time."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    vocab = model.config.vocab_size
    ids = torch.tensor([ornith_prompt(prompt_len, vocab)], device=device)
    fla_names = fla_triton_kernel_names()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result = {"prompt_tokens": prompt_len, "fla_kernel_names_known": len(fla_names)}
    tok, cache, _ = prefill(model, ids)  # untimed: the profiled decode step needs a cache
    for phase in ("prefill", "decode_step"):
        sync(device)
        with tprofile(activities=acts) as prof:
            if phase == "prefill":
                prefill(model, ids)
            else:
                decode(model, tok, cache, 1)
            sync(device)
        rows = []
        for ev in prof.key_averages():
            if device.type == "cuda":
                t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
                if ev.device_type != torch.autograd.DeviceType.CUDA or t <= 0:
                    continue
            else:
                t = ev.self_cpu_time_total
            rows.append((t, ev.count, ev.key))
        rows.sort(reverse=True)
        host = sorted(((ev.self_cpu_time_total, ev.count, ev.key) for ev in prof.key_averages()
                       if ev.self_cpu_time_total > 0), reverse=True)
        total = sum(r[0] for r in rows)
        fla_us = sum(t for t, _, k in rows if k in fla_names)
        result[phase] = {
            "total_us": total,
            "fla_kernel_us": fla_us,
            "fla_kernels": sorted({k for _, _, k in rows if k in fla_names}),
            "top": [{"name": k[:120], "count": c, "self_us": t, "fla": k in fla_names} for t, c, k in rows[:top]],
            "host_top": [{"name": k[:120], "count": c, "self_cpu_us": t} for t, c, k in host[:top]],
        }
    del cache
    return result


@torch.inference_mode()
def python_profile_decode(model, device: torch.device, prompt_len: int, steps: int, top: int = 20) -> dict:
    """Where the host time of `steps` decode steps goes (cProfile; functions by own time and by cumulative time)."""
    import cProfile
    import pstats

    ids = torch.tensor([ornith_prompt(prompt_len, model.config.vocab_size)], device=device)
    tok, cache, _ = prefill(model, ids)
    decode(model, tok, cache, 2)
    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    decode(model, tok, cache, steps)
    sync(device)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)

    def rows(key: int) -> list[dict]:
        out = []
        for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
            out.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "own_ms": tt * 1e3, "cum_ms": ct * 1e3})
        out.sort(key=lambda r: -r["own_ms" if key == 0 else "cum_ms"])
        return out[:top]

    del cache
    return {"prompt_tokens": prompt_len, "steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
            "by_own_time": rows(0), "by_cumulative_time": rows(1)}


# ----------------------------------------------------------------------------------------------------------------
# comparison with ornith-bench


def compare(ornith: dict, runs: list[dict]) -> list[dict]:
    by_len = {r["prompt_tokens"]: r for r in ornith.get("runs", [])}
    rows = []
    for r in runs:
        o = by_len.get(r["prompt_tokens"])
        if o is None:
            continue
        rows.append({
            "prompt_tokens": r["prompt_tokens"],
            "ornith_ttft_s": o["ttft_s"],
            "hf_ttft_s": r["ttft_s"],
            "ornith_prefill_tok_s": o["prefill_tok_s"],
            "hf_prefill_tok_s": r["prefill_tok_s"],
            "prefill_ratio": o["prefill_tok_s"] / r["prefill_tok_s"],
            "ornith_decode_tok_s": o["decode_tok_s"],
            "ornith_decode_tokens": o.get("decode_tokens"),
            "hf_decode_tok_s": r["decode_tok_s"],
            "hf_decode_tokens": r["decode_tokens"],
            "decode_ratio": (o["decode_tok_s"] / r["decode_tok_s"]) if r["decode_tok_s"] else None,
        })
    return rows


def print_table(rows: list[dict], runs: list[dict], variant: str) -> None:
    print(f"\nHugging Face transformers peer (batch 1, SDPA variant {variant}):")
    print(f"{'prompt':>8} {'TTFT s':>9} {'prefill t/s':>12} {'decode t/s':>11} {'ms/tok':>9} {'step ms first/median/max':>26}")
    for r in runs:
        steps = (f"{r['decode_step_ms_first']:.1f}/{r['decode_step_ms_median']:.1f}/{r['decode_step_ms_max']:.1f}"
                 if r["decode_tokens"] else "-")
        print(f"{r['prompt_tokens']:>8} {r['ttft_s']:>9.3f} {r['prefill_tok_s']:>12,.0f} "
              f"{r['decode_tok_s'] or 0:>11.2f} {r['decode_ms_per_token'] or 0:>9.1f} {steps:>26}")
    if not rows:
        return
    print(f"\nornith / transformers (same GPU, same checkpoint, same prompt ids; HF SDPA variant {variant}):")
    print(f"{'prompt':>8} | {'prefill tok/s: ornith':>21} {'HF':>9} {'ratio':>7} | "
          f"{'decode tok/s: ornith':>20} {'HF':>7} {'ratio':>7} | {'TTFT s: ornith':>14} {'HF':>7}")
    for r in rows:
        dr = f"{r['decode_ratio']:.1f}x" if r["decode_ratio"] else "-"
        print(f"{r['prompt_tokens']:>8} | {r['ornith_prefill_tok_s']:>21,.0f} {r['hf_prefill_tok_s']:>9,.0f} "
              f"{r['prefill_ratio']:>6.2f}x | {r['ornith_decode_tok_s']:>20.1f} {r['hf_decode_tok_s'] or 0:>7.2f} "
              f"{dr:>7} | {r['ornith_ttft_s']:>14.3f} {r['hf_ttft_s']:>7.3f}")
    gens = {(r["ornith_decode_tokens"], r["hf_decode_tokens"]) for r in rows}
    print(f"(decode tokens timed, ornith/HF: {', '.join(f'{a}/{b}' for a, b in sorted(gens, key=str))})")


# ----------------------------------------------------------------------------------------------------------------
# check against transformers' own loading


@torch.inference_mode()
def compare_with_reference(model, ref, to_peer_name, device: torch.device, prompt_len: int, steps: int) -> dict:
    """Every peer parameter against the reference's (bit for bit, dtype included), then logits and greedy tokens."""
    mine = dict(model.named_parameters())
    theirs = {}
    for n, p in ref.named_parameters():
        m = to_peer_name(n)
        if m is not None:
            theirs[m] = p
    # compressed-tensors leaves its (now unused) scales as extra parameters on the decompressed Linears.
    extra_ref = sorted(n for n in theirs if n not in mine)
    bad_extra = [n for n in extra_ref if not n.endswith(".weight_scale")]
    missing_in_ref = sorted(n for n in mine if n not in theirs)
    diffs = []
    for n, p in mine.items():
        if n in theirs:
            q = theirs[n]
            if p.dtype != q.dtype or p.shape != q.shape or not torch.equal(p, q):
                diffs.append(f"{n}: {p.dtype}{tuple(p.shape)} vs {q.dtype}{tuple(q.shape)}")
    # compressed-tensors keeps its quantisation scheme on the Linears it decompressed (attention q/k/v/o and the
    # shared expert; the routed experts become plain fused tensors) and replaces their forward with one that
    # fake-quantises the *input activations* to FP8 per token (W8A8 simulation). The peer runs plain BF16
    # activations, so compare twice: as loaded, and with that activation quantisation switched off
    # (`quantization_enabled = False`, compressed-tensors' own switch), where the two must agree bit for bit.
    fq = [m for m in ref.modules() if getattr(m, "quantization_scheme", None) is not None]
    ids = torch.tensor([ornith_prompt(prompt_len, model.config.vocab_size)], device=device)
    a = model(input_ids=ids, use_cache=False).logits.float()
    b_w8a8 = ref(input_ids=ids, use_cache=False).logits.float()
    for m in fq:
        m.quantization_enabled = False
    b = ref(input_ids=ids, use_cache=False).logits.float()
    # Greedy decode through the cache: the peer's loop vs the reference model's own generate().
    tok, cache, _ = prefill(model, ids)
    mine_toks = [int(tok.item())] + [int(t.item()) for t in decode(model, tok, cache, steps)]
    gen = ref.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    ref_toks = gen[0, ids.shape[1]:].tolist()
    res = {
        "reference_class": type(ref).__name__,
        "parameters_compared": sum(1 for n in mine if n in theirs),
        "parameters_not_bit_equal": diffs,
        "missing_in_reference": missing_in_ref,
        "reference_extra_parameters": len(extra_ref),
        "reference_extra_non_scale_parameters": bad_extra,
        "reference_fake_quant_linears": len(fq),
        "prompt_tokens": prompt_len,
        "logits_finite": bool(torch.isfinite(a).all().item()),
        "logits_max_abs": a.abs().max().item(),
        "logits_bit_equal": bool(torch.equal(a, b)),
        "logits_max_abs_diff": (a - b).abs().max().item(),
        "logits_max_abs_diff_vs_reference_with_fp8_activations": (a - b_w8a8).abs().max().item(),
        "greedy_tokens_peer_cache_loop": mine_toks,
        "greedy_tokens_reference_generate": ref_toks,
        "greedy_tokens_equal": mine_toks == ref_toks,
    }
    res["ok"] = (not diffs and not missing_in_ref and not bad_extra and res["logits_bit_equal"]
                 and res["logits_finite"] and res["greedy_tokens_equal"])
    return res


def check_against_from_pretrained(model_dir: Path, device: torch.device, prompt_len: int, steps: int) -> dict:
    """Loads the checkpoint again with transformers' own `from_pretrained` (compressed-tensors decompression,
    `dequantize=True`) through two entry points and compares each with a peer loaded under the same dtype
    policy. Only for small checkpoints. Each must match bit for bit unless its own load reported missing keys:
    * `architecture`: the class config.json names (Qwen3_5MoeForConditionalGeneration), whose module names are
      the checkpoint's own; it casts F32 tensors to BF16.
    * `auto_causal_lm`: AutoModelForCausalLM (-> Qwen3_5MoeForCausalLM, the class the peer uses); it keeps F32
      tensors F32. Its module names lack `language_model.`, so an `ignore` list of literal module names (as
      llm-compressor writes it) no longer matches: compressed-tensors then expects scales for the unquantised
      linear_attn Linears, reports them missing and produces NaN. With regex ignores (`re:.*linear_attn.*`, as
      in the vendor's export and `cargo xtask synth`) it loads correctly."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    qc = lambda: CompressedTensorsConfig(dequantize=True)  # noqa: E731
    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    out = {"reference_loader": "from_pretrained(dtype=bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))"}

    def from_vl(n: str):
        if n.startswith("model.language_model."):
            return "model." + n[len("model.language_model."):]
        return n if n.startswith("lm_head.") else None

    # The two entry points differ in one thing the peer controls: the dtype of unquantised F32 tensors (see
    # load_peer). Each is compared with a peer loaded under its policy.
    bf16_peer, _ = load_peer(model_dir, device, unquantised_dtype=torch.bfloat16)
    ref, info = getattr(transformers, arch).from_pretrained(
        model_dir, dtype=torch.bfloat16, quantization_config=qc(), output_loading_info=True)
    out["architecture"] = compare_with_reference(bf16_peer, ref.to(device).eval(), from_vl, device, prompt_len, steps)
    out["architecture"]["peer_unquantised_dtype"] = "bfloat16"
    out["architecture"]["reference_loading_info"] = {k: sorted(map(str, v)) for k, v in info.items() if v}
    del ref, bf16_peer
    ref, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, quantization_config=qc(), output_loading_info=True)
    model, _ = load_peer(model_dir, device)
    out["auto_causal_lm"] = compare_with_reference(model, ref.to(device).eval(), lambda n: n, device, prompt_len, steps)
    out["auto_causal_lm"]["peer_unquantised_dtype"] = "checkpoint"
    out["auto_causal_lm"]["reference_loading_info"] = {k: sorted(map(str, v)) for k, v in info.items() if v}
    return out


# ----------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint directory (compressed-tensors FP8)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--prompts", default="2048", help="comma-separated prompt lengths (default 2048)")
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens timed after each prefill (default 32)")
    ap.add_argument("--warmup-gen", type=int, default=4, help="decode steps in each warm-up (default 4)")
    ap.add_argument("--ornith-json", type=Path, help="ornith-bench's JSON stdout, for the side-by-side table")
    ap.add_argument("--out", type=Path, help="write the whole report as JSON here")
    ap.add_argument("--profile", type=int, default=256, metavar="N",
                    help="profile one prefill of N tokens and one decode step (0: off; default 256)")
    ap.add_argument("--sdpa", default="default,no-cudnn",
                    help="SDPA backend variants to benchmark on CUDA, in order; the first is the headline "
                         "(default: 'default,no-cudnn'; see main())")
    ap.add_argument("--pyprofile-steps", type=int, default=8, metavar="N",
                    help="cProfile N decode steps after the benchmark to show where host time goes (0: off; default 8)")
    ap.add_argument("--unquantised-dtype", choices=("checkpoint", "bfloat16"), default="checkpoint",
                    help="dtype of unquantised tensors (F32 A_log / gated-norm weight): keep the checkpoint's, as "
                         "AutoModelForCausalLM.from_pretrained does (default), or cast to bfloat16")
    ap.add_argument("--check", action="store_true",
                    help="also load with transformers' from_pretrained and compare parameters and logits (small checkpoints only)")
    ap.add_argument("--check-prompt", type=int, default=16, help="prompt length of --check (default 16)")
    args = ap.parse_args()

    try:
        prompts = [int(x) for x in args.prompts.split(",") if x.strip()]
    except ValueError:
        raise PeerError(f"--prompts {args.prompts!r}: expected comma-separated integers")
    if not prompts or min(prompts) < 1 or args.gen < 0:
        raise PeerError("--prompts must be positive integers and --gen >= 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PeerError("--device cuda but torch sees no CUDA device (use --device cpu for a CPU run)")
    if not (args.model / "config.json").is_file():
        raise PeerError(f"{args.model}: no config.json")
    ornith = json.loads(args.ornith_json.read_text()) if args.ornith_json else None

    vers = versions(device)
    log(f"torch {vers['torch']}, transformers {vers['transformers']}, flash-linear-attention "
        f"{vers['flash-linear-attention']}, fla-core {vers['fla-core']}, triton {vers['triton']}"
        + (f", {vers['gpu']}, driver {vers.get('driver')}" if device.type == "cuda" else ", CPU"))
    if vers["fla_import_error"]:
        log(f"flash-linear-attention is not importable: {vers['fla_import_error']}")

    model, load = load_peer(args.model, device,
                            None if args.unquantised_dtype == "checkpoint" else torch.bfloat16)
    log(f"loaded {args.model} in {load['load_s']:.1f} s: {load['fp8_linears_dequantised']} FP8 Linears dequantised, "
        f"{load['unquantised_tensors']} unquantised tensors, skipped {load['skipped_tensors']}, "
        f"{load['parameter_bytes'] / 2**30:.2f} GiB of parameters ({', '.join(load['parameter_dtypes'])}); "
        "no missing or unexpected keys")
    paths = fast_paths(model)
    for k, v in paths["gdn_ops"].items():
        log(f"  {k}: {v}")
    log(f"  attention: {paths['attn_implementation']}, experts: {paths['experts_implementation']}, "
        f"GDN via fla: {paths['gdn_uses_fla']}, conv via causal-conv1d: {paths['conv_uses_causal_conv1d']}")
    if device.type == "cpu" and paths["gdn_uses_fla"]:
        log("warning: fla's Triton kernels are selected but the device is the CPU; expect failures")

    report = {
        "tool": "tests/peer/hf_peer.py",
        "argv": sys.argv[1:],
        "model": str(args.model.resolve()),
        "device": vers.get("gpu", "cpu"),
        "versions": vers,
        "load": load,
        "fast_paths": paths,
        "config": {
            "num_hidden_layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size,
            "num_experts": model.config.num_experts,
            "num_experts_per_tok": model.config.num_experts_per_tok,
            "vocab_size": model.config.vocab_size,
        },
    }
    if args.check:
        chk = check_against_from_pretrained(args.model, device, args.check_prompt, 4)
        report["check"] = chk
        for which in ("architecture", "auto_causal_lm"):
            c = chk[which]
            log(f"check vs {c['reference_class']}.from_pretrained: {c['parameters_compared']} parameters, "
                f"not bit-equal {len(c['parameters_not_bit_equal'])}, missing {len(c['missing_in_reference'])}; "
                f"logits (its FP8 activation fake-quant off) bit-equal {c['logits_bit_equal']}, max |diff| "
                f"{c['logits_max_abs_diff']:.3g}; with fake-quant on ({c['reference_fake_quant_linears']} Linears) max "
                f"|diff| {c['logits_max_abs_diff_vs_reference_with_fp8_activations']:.3g} (max |logit| "
                f"{c['logits_max_abs']:.3g}); finite {c['logits_finite']}; greedy tokens = generate(): "
                f"{c['greedy_tokens_equal']} -> {'OK' if c['ok'] else 'MISMATCH'}")
        # A reference whose own load reported missing keys is broken by itself (see check_against_from_pretrained).
        required = [w for w in ("architecture", "auto_causal_lm") if not chk[w]["reference_loading_info"].get("missing_keys")]
        for w in ("architecture", "auto_causal_lm"):
            if w not in required:
                log(f"note: transformers' own {chk[w]['reference_class']} load reported missing keys "
                    f"{chk[w]['reference_loading_info']['missing_keys'][:4]}...: that reference is not comparable")
        if not required or not all(chk[w]["ok"] for w in required):
            log("error: --check failed: the peer model differs from transformers' own loading (see above)")
            write_report(args.out, report)
            return 1

    # SDPA variants: "default" is what a user gets. "no-cudnn" switches off torch's cuDNN attention backend
    # (torch.backends.cuda.enable_cudnn_sdp(False)), so SDPA falls to flash / memory-efficient attention: on the
    # H200 the cuDNN backend was seen to build a new plan for every new key length in decode (steps beyond the
    # lengths seen in warm-up took ~60 ms each on a 4-layer model, ~11 ms before), which that variant shows.
    variants = [v for v in args.sdpa.split(",") if v]
    if device.type != "cuda":
        variants = ["default"]
    default_flags = torch.backends.cuda.cudnn_sdp_enabled()
    runs_by = {}
    for v in variants:
        if v not in ("default", "no-cudnn"):
            raise PeerError(f"--sdpa: unknown variant {v!r} (default, no-cudnn)")
        torch.backends.cuda.enable_cudnn_sdp(default_flags if v == "default" else False)
        log(f"SDPA variant {v}: cudnn_sdp_enabled={torch.backends.cuda.cudnn_sdp_enabled()}")
        runs_by[v] = bench(model, device, prompts, args.gen, args.warmup_gen)
    torch.backends.cuda.enable_cudnn_sdp(default_flags)
    runs = runs_by[variants[0]]
    report["runs"] = runs
    report["runs_by_sdpa_variant"] = runs_by
    if args.profile > 0:
        report["profile"] = profile(model, device, args.profile)
        for phase in ("prefill", "decode_step"):
            p = report["profile"][phase]
            log(f"profile {phase} ({args.profile} tokens): {p['total_us'] / 1e3:.1f} ms of "
                f"{'kernel' if device.type == 'cuda' else 'CPU op'} self time, fla kernels {p['fla_kernel_us'] / 1e3:.1f} ms "
                f"({', '.join(p['fla_kernels']) or 'none'})")
            for row in p["top"][:12]:
                log(f"    {row['self_us'] / 1e3:9.3f} ms {row['count']:6d}x {'[fla] ' if row['fla'] else ''}{row['name']}")
            if device.type == "cuda":
                log(f"  host (CPU) self time of the {phase}, top ops:")
                for row in p["host_top"][:8]:
                    log(f"    {row['self_cpu_us'] / 1e3:9.3f} ms {row['count']:6d}x {row['name']}")
    if args.pyprofile_steps > 0:
        pp = report["python_profile_decode"] = python_profile_decode(model, device, min(prompts), args.pyprofile_steps)
        log(f"cProfile of {pp['steps']} decode steps: {pp['wall_ms_per_step']:.1f} ms/step (profiled); top by own time:")
        for row in pp["by_own_time"][:10]:
            log(f"    {row['own_ms'] / pp['steps']:8.2f} ms/step own {row['cum_ms'] / pp['steps']:8.2f} cum "
                f"{row['calls'] // pp['steps']:6d} calls/step  {row['function']}")
        log("  top by cumulative time:")
        for row in pp["by_cumulative_time"][:12]:
            log(f"    {row['cum_ms'] / pp['steps']:8.2f} ms/step cum {row['calls'] // pp['steps']:6d} calls/step  {row['function']}")
    if ornith is not None:
        report["ornith"] = {k: ornith.get(k) for k in ("device", "model", "load_s", "weight_bytes")}
        report["ornith"]["runs"] = [{k: r.get(k) for k in ("prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tokens",
                                                            "decode_tok_s")} for r in ornith.get("runs", [])]
        report["comparison"] = compare(ornith, runs)
        report["comparison_by_sdpa_variant"] = {v: compare(ornith, r) for v, r in runs_by.items()}
        if ornith.get("device") and device.type == "cuda" and ornith["device"] != vers.get("gpu"):
            log(f"warning: ornith-bench ran on {ornith['device']!r}, this run on {vers.get('gpu')!r}")
        missing = sorted(set(prompts) - {r["prompt_tokens"] for r in report["comparison"]})
        if missing:
            log(f"warning: ornith-bench JSON has no run for prompt lengths {missing}")
    for v, r in runs_by.items():
        print_table(report.get("comparison_by_sdpa_variant", {}).get(v, []), r, v)
    write_report(args.out, report)
    return 0


def write_report(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {path}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PeerError as e:
        log(f"error: {e}")
        sys.exit(1)
