//! The chunked Gated DeltaNet kernels of `kernels/cuda/gdn_chunk.cu` (`gdn_chunk_prep`, then
//! `gdn_chunk_scan`), the CUDA source itself, run on the CPU through `tests/emu` (g++ against an
//! emulation of the CUDA subset they use: threads, block and warp barriers, shuffles) and compared
//! with the CPU reference `cpu::gdn::gated_delta_rule` within the tolerance of the device test
//! `gdn_chunked_matches_reference` (src/cuda/prefill_tests.rs): o within 1 ulp + 2^-10 rms per
//! element and 2^-9 relative L2, the fp32 state within 2^-12 (|want| + rms). So CI, which has no
//! GPU, still fails when the kernels' logic breaks (an index, a gate, a chunk boundary; a missing
//! barrier only if the threads happen to race); the device test remains the one for the device's
//! arithmetic (its expf, its fused multiply-adds).
//! Needs a C++20 compiler (`CXX`, default g++; `.ci/run` installs g++ when absent).
use half::bf16;
use ornith_runtime::cpu::gdn::{gated_delta_rule, GdnDims};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The harness built from this tree's kernels (with fused multiply-adds, as nvcc builds them).
fn build(dir: &Path) -> PathBuf {
    let exe = dir.join("gdn_chunk");
    let script = format!(
        ". tests/emu/lib.sh && emu_prepare . '{0}/k' && emu_build '{0}/k' tests/emu/gdn_chunk.cpp '{1}' fast",
        dir.display(),
        exe.display()
    );
    let out = Command::new("bash").arg("-c").arg(&script).current_dir(root()).output().expect("bash");
    assert!(
        out.status.success(),
        "building tests/emu/gdn_chunk.cpp (a C++20 compiler with <barrier> is required: g++ 11+ or clang++ 14+, \
         named by CXX, default g++):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn bf(v: &[u16]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_bits(x)).collect()
}

#[test]
fn gdn_chunk_kernels_on_the_cpu_match_the_reference() {
    let dir = std::env::temp_dir().join(format!("ornith-emu-gdn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = build(&dir);
    // one token, a partial chunk, one chunk and one token, several chunks with a partial last
    for tokens in [1usize, 63, 65, 200] {
        let (outp, inp) = (dir.join("out.bin"), dir.join("in.bin"));
        let run = Command::new(&exe).arg(tokens.to_string()).arg(&outp).arg(&inp).output().unwrap();
        assert!(run.status.success(), "gdn_chunk harness, {tokens} tokens: {}", String::from_utf8_lossy(&run.stdout));
        let inb = std::fs::read(&inp).unwrap();
        let dims: Vec<usize> =
            inb[..20].chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as usize).collect();
        let (t, hk, hv, d, stride) = (dims[0], dims[1], dims[2], dims[3], dims[4]);
        assert_eq!(t, tokens);
        let mut off = 20;
        let mut take = |n: usize| {
            let s = &inb[off..off + n];
            off += n;
            s
        };
        let qkv = u16s(take(2 * t * stride));
        let ba = u16s(take(2 * t * 2 * hv));
        let a_log = f32s(take(4 * hv));
        let dt_bias = bf(&u16s(take(2 * hv)));
        let state0 = f32s(take(4 * hv * d * d));
        let dims = GdnDims { hk, hv, dk: d, dv: d };
        let cd = dims.conv_dim();
        let conv: Vec<bf16> = (0..t).flat_map(|r| bf(&qkv[r * stride..r * stride + cd])).collect();
        let b: Vec<bf16> = (0..t).flat_map(|r| bf(&ba[r * 2 * hv..r * 2 * hv + hv])).collect();
        let a: Vec<bf16> = (0..t).flat_map(|r| bf(&ba[r * 2 * hv + hv..(r + 1) * 2 * hv])).collect();
        let mut want_s = state0.clone();
        let mut want_o = vec![bf16::ZERO; t * hv * d];
        gated_delta_rule(&conv, &b, &a, &a_log, &dt_bias, t, dims, &mut want_s, &mut want_o);

        let outb = std::fs::read(&outp).unwrap();
        let got_o = u16s(&outb[..2 * t * hv * d]);
        let got_s = f32s(&outb[2 * t * hv * d..]);
        assert_eq!(got_s.len(), want_s.len());
        let rms_o = (want_o.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / want_o.len() as f64).sqrt();
        let (mut num, mut den) = (0f64, 0f64);
        for (i, (&g, w)) in got_o.iter().zip(&want_o).enumerate() {
            let (g, w) = (bf16::from_bits(g).to_f64(), w.to_f64());
            let ulp = 2f64.powi(w.abs().max(1e-30).log2().floor() as i32 - 7);
            assert!(
                (g - w).abs() <= ulp + rms_o / 1024.0,
                "{tokens} tokens: o[{i}] = {g}, reference {w} (rms {rms_o})"
            );
            num += (g - w).powi(2);
            den += w * w;
        }
        let rel = (num / den.max(1e-300)).sqrt();
        assert!(rel <= 2f64.powi(-9), "{tokens} tokens: o's relative L2 {rel:.3e} > 2^-9");
        let rms_s = (want_s.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / want_s.len() as f64).sqrt();
        for (i, (&g, &w)) in got_s.iter().zip(&want_s).enumerate() {
            let dd = (g as f64 - w as f64).abs();
            assert!(
                dd <= 2f64.powi(-12) * (w.abs() as f64 + rms_s),
                "{tokens} tokens: state[{i}] = {g}, reference {w}"
            );
        }
        eprintln!("gdn_chunk on the CPU emulation, {tokens} tokens: o rel L2 {rel:.2e} against cpu::gdn");
    }
    std::fs::remove_dir_all(&dir).ok();
}
