//! Weight upload: every tensor goes from the shard mmap straight to device memory (no host copy of
//! the model), routed experts packed into one contiguous buffer per layer as the MoE kernel wants
//! them (`[E, 2I, H]` gate|up rows and `[E, H, I]` down, FP8, with f32 scales), a progress line on
//! stderr.
use super::{CudaBackend, CudaExperts, CudaLinear, CudaVector, DevLinear, ExpertScales, Fp4Dev};
use crate::cuda::nvfp4::{fp4_device_codes, fp4_table, TAB_BYTES};
use crate::graph::{Dims, Prec};
use crate::weights::{to_f32, Checkpoint};
use anyhow::{ensure, Context, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use model_spec::{DType, ExpertLayout, ModelSpec, Precision};
use std::io::Write;
use std::marker::PhantomData;

const VEC: &[DType] = &[DType::BF16, DType::F32];

/// Upload progress on stderr (a line per 5%, or a carriage-return bar on a terminal).
pub(super) struct Progress {
    pub total: u64,
    pub done: u64,
    pub shown: u64,
    pub quiet: bool,
    pub started: std::time::Instant,
}

impl Progress {
    pub fn new(total: u64, quiet: bool) -> Self {
        Progress { total: total.max(1), done: 0, shown: u64::MAX, quiet, started: std::time::Instant::now() }
    }

    fn add(&mut self, n: u64) {
        self.done += n;
        let pct = (self.done * 100 / self.total).min(100);
        if self.quiet || (self.shown != u64::MAX && pct < self.shown + 5 && pct != 100) || pct == self.shown {
            return;
        }
        self.shown = pct;
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let g = |b: u64| b as f64 / (1u64 << 30) as f64;
        eprintln!(
            "ornith: uploading weights {:>3}%  {:.2}/{:.2} GiB  {:.2} GiB/s",
            pct,
            g(self.done),
            g(self.total),
            g(self.done) / secs
        );
        let _ = std::io::stderr().flush();
    }
}

impl CudaBackend {
    /// Copies host bytes into a new device buffer and counts them in the progress line.
    fn put(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        let mut d = self.cx.alloc::<u8>(bytes.len().max(1))?;
        if !bytes.is_empty() {
            self.cx.stream().memcpy_htod(bytes, &mut d)?;
        }
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(bytes.len() as u64);
        Ok(d)
    }

    /// Host byte runs copied one after the other into one new device buffer (no host copy of the
    /// whole), counted in the progress line.
    fn put_parts(&self, parts: &[&[u8]]) -> Result<CudaSlice<u8>> {
        let n: usize = parts.iter().map(|p| p.len()).sum();
        let mut d = self.cx.alloc::<u8>(n.max(1))?;
        let mut at = 0;
        for p in parts {
            self.cx.stream().memcpy_htod(*p, &mut d.slice_mut(at..at + p.len()))?;
            at += p.len();
        }
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(n as u64);
        Ok(d)
    }

    fn put_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        let d = self.cx.upload(v)?;
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(v.len() as u64 * 2);
        Ok(d)
    }

    /// One Linear `[out, in]` as stored: BF16 bytes, or E4M3 codes + f32 per-channel scales.
    fn dev_linear(
        &self,
        ck: &Checkpoint,
        module: &str,
        kind: Precision,
        out_f: usize,
        in_f: usize,
    ) -> Result<DevLinear> {
        let wname = format!("{module}.weight");
        match kind {
            Precision::Bf16 => {
                let v = ck.tensor(&wname, &[DType::BF16], &[out_f, in_f])?;
                Ok(DevLinear { out_features: out_f, in_features: in_f, w: self.put(v.bytes)?, scale: None, fp4: None })
            }
            Precision::Fp8 => {
                let v = ck.tensor(&wname, &[DType::F8_E4M3], &[out_f, in_f])?;
                let s = to_f32(&ck.tensor(&format!("{module}.weight_scale"), VEC, &[out_f, 1])?);
                Ok(DevLinear {
                    out_features: out_f,
                    in_features: in_f,
                    w: self.put(v.bytes)?,
                    scale: Some(self.put_f32(&s)?),
                    fp4: None,
                })
            }
            Precision::Nvfp4 => {
                let p = fp4_parts(ck, module, out_f, in_f)?;
                Ok(DevLinear {
                    out_features: out_f,
                    in_features: in_f,
                    w: self.put(&p.codes)?,
                    scale: None,
                    fp4: Some(Fp4Dev { ws: self.put(p.scales)?, tab: self.put(&p.table)?, tab_rows: out_f }),
                })
            }
        }
    }

    /// Loads a Linear. The router `mlp.gate` `[E, H]` is loaded together with
    /// `mlp.shared_expert_gate` `[1, H]` as one `[E + 1, H]` BF16 matrix (one router GEMM/GEMV
    /// writes the E router logits and the shared-expert gate logit as one row); the shared gate
    /// then holds no memory of its own. The shared expert's `gate_proj` is loaded together with its `up_proj` as
    /// one `[2I, H]` gate|up matrix (the MoE kernel runs the shared expert as one more slot of the
    /// routed-expert launch); `up_proj` then holds no memory of its own and is marked as fused.
    pub(super) fn linear<P: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        out_f: usize,
        in_f: usize,
    ) -> Result<CudaLinear<P>> {
        if let Some((parts, idx)) = fused_group(&ck.spec, &self.dims, module, P::KIND) {
            if idx > 0 {
                return Ok(CudaLinear { dev: None, _p: PhantomData });
            }
            return Ok(CudaLinear { dev: Some(self.fused(ck, &parts, P::KIND, in_f)?), _p: PhantomData });
        }
        if let Some(base) = module.strip_suffix(".mlp.gate") {
            ensure!(P::KIND == Precision::Bf16, "{module}: the CUDA MoE needs a BF16 router (found {})", P::NAME);
            let (gn, sgn) = (format!("{module}.weight"), format!("{base}.mlp.shared_expert_gate.weight"));
            let g = ck.tensor(&gn, &[DType::BF16], &[out_f, in_f])?;
            let sg = ck.tensor(&sgn, &[DType::BF16], &[1, in_f])?;
            let n = g.bytes.len();
            let mut w = self.cx.alloc::<u8>(n + sg.bytes.len())?;
            self.cx.stream().memcpy_htod(g.bytes, &mut w.slice_mut(0..n))?;
            self.cx.stream().memcpy_htod(sg.bytes, &mut w.slice_mut(n..n + sg.bytes.len()))?;
            self.progress.lock().unwrap_or_else(|e| e.into_inner()).add((n + sg.bytes.len()) as u64);
            let d = DevLinear { out_features: out_f + 1, in_features: in_f, w, scale: None, fp4: None };
            return Ok(CudaLinear { dev: Some(d), _p: PhantomData });
        }
        if module.ends_with(".mlp.shared_expert_gate") {
            ensure!(
                P::KIND == Precision::Bf16,
                "{module}: the CUDA MoE needs a BF16 shared_expert_gate (found {})",
                P::NAME
            );
            return Ok(CudaLinear { dev: None, _p: PhantomData });
        }
        if let Some(base) = module.strip_suffix("shared_expert.gate_proj") {
            ensure!(
                P::KIND != Precision::Bf16,
                "{module}: the CUDA MoE kernel needs an FP8 or NVFP4 shared expert (found {})",
                P::NAME
            );
            let up = format!("{base}shared_expert.up_proj");
            if P::KIND == Precision::Nvfp4 {
                let d = self.fp4_stacked(&[fp4_parts(ck, module, out_f, in_f)?, fp4_parts(ck, &up, out_f, in_f)?])?;
                return Ok(CudaLinear { dev: Some(d), _p: PhantomData });
            }
            let (gn, un) = (format!("{module}.weight"), format!("{up}.weight"));
            let g = ck.tensor(&gn, &[DType::F8_E4M3], &[out_f, in_f])?;
            let u = ck.tensor(&un, &[DType::F8_E4M3], &[out_f, in_f])?;
            let mut s = to_f32(&ck.tensor(&format!("{module}.weight_scale"), VEC, &[out_f, 1])?);
            s.extend(to_f32(&ck.tensor(&format!("{up}.weight_scale"), VEC, &[out_f, 1])?));
            let n = out_f * in_f;
            let mut w = self.cx.alloc::<u8>(2 * n)?;
            self.cx.stream().memcpy_htod(g.bytes, &mut w.slice_mut(0..n))?;
            self.cx.stream().memcpy_htod(u.bytes, &mut w.slice_mut(n..2 * n))?;
            self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(2 * n as u64);
            let d =
                DevLinear { out_features: 2 * out_f, in_features: in_f, w, scale: Some(self.put_f32(&s)?), fp4: None };
            return Ok(CudaLinear { dev: Some(d), _p: PhantomData });
        }
        if module.ends_with("shared_expert.up_proj") {
            ensure!(
                P::KIND != Precision::Bf16,
                "{module}: the CUDA MoE kernel needs an FP8 or NVFP4 shared expert (found {})",
                P::NAME
            );
            return Ok(CudaLinear { dev: None, _p: PhantomData });
        }
        Ok(CudaLinear { dev: Some(self.dev_linear(ck, module, P::KIND, out_f, in_f)?), _p: PhantomData })
    }

    /// Linears that read the same input, stored one after the other as one matrix `[Σ rows, in]`
    /// of precision `kind` (FP8 scales concatenated likewise): one GEMV/GEMM writes all their
    /// outputs as one row. `parts` = (module, rows).
    fn fused(&self, ck: &Checkpoint, parts: &[(String, usize)], kind: Precision, in_f: usize) -> Result<DevLinear> {
        if kind == Precision::Nvfp4 {
            let ps: Vec<Fp4Parts> = parts.iter().map(|(m, n)| fp4_parts(ck, m, *n, in_f)).collect::<Result<_>>()?;
            return self.fp4_stacked(&ps);
        }
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let elem = if kind == Precision::Fp8 { 1 } else { 2 };
        let mut w = self.cx.alloc::<u8>(rows * in_f * elem)?;
        let mut scales = Vec::new();
        let mut r0 = 0;
        for (m, n) in parts {
            let (name, n) = (format!("{m}.weight"), *n);
            let dt = if kind == Precision::Fp8 { DType::F8_E4M3 } else { DType::BF16 };
            let v = ck.tensor(&name, &[dt], &[n, in_f])?;
            self.cx.stream().memcpy_htod(v.bytes, &mut w.slice_mut(r0 * in_f * elem..(r0 + n) * in_f * elem))?;
            self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(v.bytes.len() as u64);
            if kind == Precision::Fp8 {
                scales.extend(to_f32(&ck.tensor(&format!("{m}.weight_scale"), VEC, &[n, 1])?));
            }
            r0 += n;
        }
        let scale = if kind == Precision::Fp8 { Some(self.put_f32(&scales)?) } else { None };
        Ok(DevLinear { out_features: rows, in_features: in_f, w, scale, fp4: None })
    }

    /// NVFP4 matrices stored one after the other as one `[Σ rows, in]` (codes, scale bytes): the
    /// shared expert's gate|up and attention's q|k|v. The kernels take one table per `tab_rows`
    /// rows, so `tab_rows` is the gcd of the parts' rows (a multiple of 16, `fused_group`) and a
    /// part of n rows stores its table n / tab_rows times (q|k|v at the 35B shapes: 16 copies of
    /// q's, 60 KiB a layer beyond the one table per global scale the memory plan counts, inside
    /// its margin).
    fn fp4_stacked(&self, parts: &[Fp4Parts]) -> Result<DevLinear> {
        let (tab_rows, table) = stacked_tables(&parts.iter().map(|p| (p.rows, &p.table[..])).collect::<Vec<_>>())?;
        Ok(DevLinear {
            out_features: parts.iter().map(|p| p.rows).sum(),
            in_features: parts[0].in_f,
            w: self.put_parts(&parts.iter().map(|p| &p.codes[..]).collect::<Vec<_>>())?,
            scale: None,
            fp4: Some(Fp4Dev {
                ws: self.put_parts(&parts.iter().map(|p| p.scales).collect::<Vec<_>>())?,
                tab: self.put(&table)?,
                tab_rows,
            }),
        })
    }

    pub(super) fn experts<G: Prec, U: Prec, D: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        layout: ExpertLayout,
        e: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<CudaExperts<G, U, D>> {
        let kinds = [G::KIND, U::KIND, D::KIND];
        ensure!(
            layout == ExpertLayout::PerExpert && (kinds.iter().all(|k| *k == Precision::Fp8) || kinds.iter().all(|k| *k == Precision::Nvfp4)),
            "{module}: the CUDA MoE kernel needs per-expert FP8 or NVFP4 experts (this checkpoint has {layout:?} {}/{}/{}); use --backend cpu",
            G::NAME, U::NAME, D::NAME
        );
        if G::KIND == Precision::Nvfp4 {
            return self.experts_nvfp4(ck, module, e, inter, hidden);
        }
        let (ih, hi) = (inter * hidden, hidden * inter);
        let mut gu = self.cx.alloc::<u8>(e * 2 * ih)?;
        let mut dn = self.cx.alloc::<u8>(e * hi)?;
        let mut gus = Vec::with_capacity(e * 2 * inter);
        let mut dns = Vec::with_capacity(e * hidden);
        let stream = self.cx.stream().clone();
        for x in 0..e {
            let m = |p: &str| format!("{module}.{x}.{p}");
            let (gn, un, dnn) = (
                format!("{}.weight", m("gate_proj")),
                format!("{}.weight", m("up_proj")),
                format!("{}.weight", m("down_proj")),
            );
            let g = ck.tensor(&gn, &[DType::F8_E4M3], &[inter, hidden])?;
            let u = ck.tensor(&un, &[DType::F8_E4M3], &[inter, hidden])?;
            let dw = ck.tensor(&dnn, &[DType::F8_E4M3], &[hidden, inter])?;
            let base = x * 2 * ih;
            stream.memcpy_htod(g.bytes, &mut gu.slice_mut(base..base + ih))?;
            stream.memcpy_htod(u.bytes, &mut gu.slice_mut(base + ih..base + 2 * ih))?;
            stream.memcpy_htod(dw.bytes, &mut dn.slice_mut(x * hi..(x + 1) * hi))?;
            gus.extend(to_f32(&ck.tensor(&format!("{}.weight_scale", m("gate_proj")), VEC, &[inter, 1])?));
            gus.extend(to_f32(&ck.tensor(&format!("{}.weight_scale", m("up_proj")), VEC, &[inter, 1])?));
            dns.extend(to_f32(&ck.tensor(&format!("{}.weight_scale", m("down_proj")), VEC, &[hidden, 1])?));
            self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(3 * ih as u64);
        }
        Ok(CudaExperts {
            gu,
            dn,
            scales: ExpertScales::Fp8 { gus: self.put_f32(&gus)?, dns: self.put_f32(&dns)? },
            experts: e,
            _p: PhantomData,
        })
    }

    /// NVFP4A16 experts packed as `CudaExperts` documents (codes, scale bytes, gate and up tables).
    fn experts_nvfp4<G: Prec, U: Prec, D: Prec>(
        &self,
        ck: &Checkpoint,
        module: &str,
        e: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<CudaExperts<G, U, D>> {
        let (ih, hi) = (inter * hidden, hidden * inter);
        let mut gu = self.cx.alloc::<u8>(e * ih)?; // 2 matrices of ih / 2 code bytes
        let mut gus = self.cx.alloc::<u8>(e * ih / 8)?;
        let mut dn = self.cx.alloc::<u8>(e * hi / 2)?;
        let mut dns = self.cx.alloc::<u8>(e * hi / 16)?;
        let (mut gt, mut dt) = (Vec::with_capacity(e * 2 * TAB_BYTES), Vec::with_capacity(e * TAB_BYTES));
        let stream = self.cx.stream().clone();
        // The host side of each expert (its codes put in the kernels' order, its three scale
        // tables) is prepared on every core, FP4_EXPERT_BATCH experts at a time (at the 35B
        // shapes 1.5 MB of codes each, so ~96 MB held at once): the FP8 experts are copied as
        // stored, these are rewritten first, and one expert at a time the NVFP4A16 load took
        // 12.1 s against FP8's 5.7 s (H100 host, c44e53a). The uploads stay in expert order on
        // the one stream.
        for first in (0..e).step_by(FP4_EXPERT_BATCH) {
            let batch = fp4_expert_parts(ck, module, first..(first + FP4_EXPERT_BATCH).min(e), inter, hidden)?;
            for (x, [g, u, d]) in (first..).zip(batch) {
                let (c, sc) = (ih / 2, ih / 16);
                stream.memcpy_htod(&g.codes, &mut gu.slice_mut(2 * x * c..(2 * x + 1) * c))?;
                stream.memcpy_htod(&u.codes, &mut gu.slice_mut((2 * x + 1) * c..(2 * x + 2) * c))?;
                stream.memcpy_htod(g.scales, &mut gus.slice_mut(2 * x * sc..(2 * x + 1) * sc))?;
                stream.memcpy_htod(u.scales, &mut gus.slice_mut((2 * x + 1) * sc..(2 * x + 2) * sc))?;
                stream.memcpy_htod(&d.codes, &mut dn.slice_mut(x * hi / 2..(x + 1) * hi / 2))?;
                stream.memcpy_htod(d.scales, &mut dns.slice_mut(x * hi / 16..(x + 1) * hi / 16))?;
                gt.extend(g.table);
                gt.extend(u.table);
                dt.extend(d.table);
                self.progress.lock().unwrap_or_else(|e| e.into_inner()).add((3 * ih * 9 / 16) as u64);
            }
        }
        Ok(CudaExperts {
            gu,
            dn,
            scales: ExpertScales::Nvfp4 { gus, dns, gut: self.put(&gt)?, dnt: self.put(&dt)? },
            experts: e,
            _p: PhantomData,
        })
    }

    /// A vector rounded to bf16 as transformers does when it loads the model in bf16 (A_log and
    /// the gated-norm weight are stored F32), kept as bf16 and as the same values in f32.
    pub(super) fn vector(&self, ck: &Checkpoint, name: &str, shape: &[usize]) -> Result<CudaVector> {
        let v = to_f32(&ck.tensor(name, VEC, shape)?);
        let b: Vec<u16> = v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let f: Vec<f32> = b.iter().map(|&x| bf16::from_bits(x).to_f32()).collect();
        let bf = self.cx.upload(&b).with_context(|| format!("uploading {name}"))?;
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).add(b.len() as u64 * 2);
        Ok(CudaVector { bf, f: self.cx.upload(&f)? })
    }

    pub(super) fn embedding(&self, ck: &Checkpoint, name: &str, vocab: usize, hidden: usize) -> Result<CudaSlice<u8>> {
        self.put(ck.tensor(name, &[DType::BF16], &[vocab, hidden])?.bytes)
    }
}

/// Experts whose NVFP4 host parts are prepared at once (`experts_nvfp4`).
const FP4_EXPERT_BATCH: usize = 64;

/// [`fp4_parts`] of the gate, up and down projections of experts `experts` of `module`, prepared
/// on every core, in expert order.
fn fp4_expert_parts<'a>(
    ck: &'a Checkpoint,
    module: &str,
    experts: std::ops::Range<usize>,
    inter: usize,
    hidden: usize,
) -> Result<Vec<[Fp4Parts<'a>; 3]>> {
    use rayon::prelude::*;
    experts
        .into_par_iter()
        .map(|x| {
            let m = |p: &str| format!("{module}.{x}.{p}");
            Ok([
                fp4_parts(ck, &m("gate_proj"), inter, hidden)?,
                fp4_parts(ck, &m("up_proj"), inter, hidden)?,
                fp4_parts(ck, &m("down_proj"), hidden, inter)?,
            ])
        })
        .collect()
}

/// One NVFP4A16 Linear `[out, in]`: its codes in the kernels' order (`fp4_device_codes`), its E4M3
/// group scales (borrowed from the shard mmap), and the dequantisation table of its global scale.
#[derive(Debug, PartialEq)]
pub(super) struct Fp4Parts<'a> {
    codes: Vec<u8>,
    scales: &'a [u8],
    table: Vec<u8>,
    rows: usize,
    in_f: usize,
}

/// The scale tables of NVFP4 parts `(rows, table)` stacked into one matrix: rows per table (the
/// gcd of the parts' rows, a multiple of 16 as the kernels need) and each part's table repeated
/// once per `tab_rows` of its rows, in row order.
fn stacked_tables(parts: &[(usize, &[u8])]) -> Result<(usize, Vec<u8>)> {
    let tab_rows = shared_tab_rows(parts.iter().map(|p| p.0)).ok_or_else(|| {
        anyhow::anyhow!(
            "NVFP4 parts of {:?} rows cannot share one matrix",
            parts.iter().map(|p| p.0).collect::<Vec<_>>()
        )
    })?;
    Ok((tab_rows, parts.iter().flat_map(|p| std::iter::repeat_n(p.1, p.0 / tab_rows).flatten().copied()).collect()))
}

/// Rows per scale table when NVFP4 parts of these row counts share one matrix: their gcd, if it is
/// a (non-zero) multiple of 16 as the kernels need (a 16-row group never straddles two tables).
fn shared_tab_rows(rows: impl Iterator<Item = usize>) -> Option<usize> {
    let g = rows.fold(0, gcd);
    (g > 0 && g.is_multiple_of(16)).then_some(g)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Reads and checks `module`'s `weight_packed`, `weight_scale` and `weight_global_scale`: the
/// shapes compressed-tensors writes, `in` a multiple of 32 (the CUDA kernels' code chunks), and a
/// positive finite global scale (the table divides by it).
pub(super) fn fp4_parts<'a>(ck: &'a Checkpoint, module: &str, out_f: usize, in_f: usize) -> Result<Fp4Parts<'a>> {
    ensure!(
        in_f.is_multiple_of(32),
        "{module}: NVFP4 in_features {in_f} is not a multiple of 32, which the CUDA kernels need. Fix: run with --backend cpu"
    );
    let codes = ck.tensor(&format!("{module}.weight_packed"), &[DType::U8], &[out_f, in_f / 2])?.bytes;
    let scales = ck.tensor(&format!("{module}.weight_scale"), &[DType::F8_E4M3], &[out_f, in_f / 16])?.bytes;
    let gname = format!("{module}.weight_global_scale");
    let gs = to_f32(&ck.tensor(&gname, &[DType::F32], &[1])?)[0];
    ensure!(
        gs.is_finite() && gs > 0.0,
        "{gname} is {gs}: NVFP4 dequantisation divides by it, so it must be positive and finite. Fix: re-export the checkpoint"
    );
    Ok(Fp4Parts { codes: fp4_device_codes(codes), scales, table: fp4_table(gs), rows: out_f, in_f })
}

/// Linears that read the same input and load as one matrix: the Gated DeltaNet's four input
/// projections as `[qkv; z; b; a]` (the layer's `[qkv | z | b | a]` projection row in one launch
/// instead of four, two of them 32 rows tall) and attention's `[q; k; v]`, when every member is
/// stored with the precision `kind`. Returns the group's parts (module, rows) in order and the
/// index of `module` among them (0 loads the matrix, the others then hold no memory), or None.
pub(super) fn fused_group(
    spec: &ModelSpec,
    d: &Dims,
    module: &str,
    kind: Precision,
) -> Option<(Vec<(String, usize)>, usize)> {
    let groups: [(&str, &[(&str, usize)]); 2] = [
        (
            ".linear_attn",
            &[
                ("in_proj_qkv", d.conv_dim()),
                ("in_proj_z", d.value_dim()),
                ("in_proj_b", d.linear_num_value_heads),
                ("in_proj_a", d.linear_num_value_heads),
            ],
        ),
        (
            ".self_attn",
            &[
                ("q_proj", 2 * d.num_attention_heads * d.head_dim),
                ("k_proj", d.num_key_value_heads * d.head_dim),
                ("v_proj", d.num_key_value_heads * d.head_dim),
            ],
        ),
    ];
    // The tensor that carries a member's stored precision.
    let (suffix, dt) = match kind {
        Precision::Fp8 => ("weight", DType::F8_E4M3),
        Precision::Bf16 => ("weight", DType::BF16),
        Precision::Nvfp4 => ("weight_packed", DType::U8),
    };
    groups.iter().find_map(|(parent, members)| {
        let (base, idx) = members
            .iter()
            .enumerate()
            .find_map(|(i, (m, _))| Some((module.strip_suffix(&format!("{parent}.{m}"))?, i)))?;
        let parts: Vec<(String, usize)> = members.iter().map(|(m, n)| (format!("{base}{parent}.{m}"), *n)).collect();
        // The spec cross-checked stored dtypes against the compiled precisions, so the stored
        // dtype decides the same way for every member.
        let same = parts.iter().all(|(m, _)| spec.tensors.get(&format!("{m}.{suffix}")).is_some_and(|t| t.dtype == dt));
        // NVFP4 parts share one matrix with a scale table per gcd-of-rows rows (`fp4_stacked`).
        let tables_fit = kind != Precision::Nvfp4 || shared_tab_rows(parts.iter().map(|p| p.1)).is_some();
        (same && tables_fit).then_some((parts, idx))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The micro dims (tests/fixtures: hidden 64, GDN 2 k / 4 v heads of 32, attention 4 q / 2 kv
    /// heads of 32); only the projection widths matter here.
    fn micro_dims() -> Dims {
        Dims {
            vocab_size: 0,
            hidden_size: 64,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rotary_dim: 8,
            rope_theta: 1e7,
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            linear_key_head_dim: 32,
            linear_value_head_dim: 32,
            linear_conv_kernel_dim: 4,
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            shared_expert_intermediate_size: 32,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 1024,
        }
    }

    fn fixture_dir(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
    }

    fn fixture(name: &str) -> ModelSpec {
        model_spec::load_checkpoint(&fixture_dir(name)).expect("fixture checkpoint")
    }

    /// The experts' NVFP4 parts prepared in parallel batches are each expert's parts as
    /// `fp4_parts` makes them one at a time, in expert order (micro-nvfp4: the vendor's export,
    /// 16 experts of 32 x 64).
    #[test]
    fn parallel_expert_parts_equal_serial_ones_in_order() {
        let ck = Checkpoint::open(&fixture_dir("micro-nvfp4"), &fixture("micro-nvfp4").fingerprint).unwrap();
        let module = "model.language_model.layers.1.mlp.experts";
        let (inter, hidden) = (32, 64);
        let serial: Vec<[Fp4Parts; 3]> = (0..16)
            .map(|x| {
                let m = |p: &str| format!("{module}.{x}.{p}");
                [
                    fp4_parts(&ck, &m("gate_proj"), inter, hidden).unwrap(),
                    fp4_parts(&ck, &m("up_proj"), inter, hidden).unwrap(),
                    fp4_parts(&ck, &m("down_proj"), hidden, inter).unwrap(),
                ]
            })
            .collect();
        let mut batched = fp4_expert_parts(&ck, module, 0..5, inter, hidden).unwrap();
        batched.extend(fp4_expert_parts(&ck, module, 5..16, inter, hidden).unwrap());
        assert_eq!(batched, serial);
        // The experts differ, so an order swap would show.
        assert_ne!(serial[0][0].codes, serial[1][0].codes);
        assert!(fp4_expert_parts(&ck, module, 15..17, inter, hidden).is_err(), "expert 16 does not exist");
    }

    #[test]
    fn stacked_nvfp4_tables_repeat_each_part_over_its_rows() {
        let (t1, t2, t3) = ([1u8; TAB_BYTES], [2u8; TAB_BYTES], [3u8; TAB_BYTES]);
        // Attention's q|k|v at the 35B shapes: 8,192 + 512 + 512 rows, a table per 512 rows.
        let (rows, tab) = stacked_tables(&[(8192, &t1[..]), (512, &t2[..]), (512, &t3[..])]).unwrap();
        assert_eq!(rows, 512);
        assert_eq!(tab.len(), 18 * TAB_BYTES);
        let table_of_row = |r: usize| tab[(r / rows) * TAB_BYTES + TAB_BYTES - 1];
        assert_eq!((table_of_row(0), table_of_row(8191), table_of_row(8192), table_of_row(8703)), (1, 1, 2, 2));
        assert_eq!((table_of_row(8704), table_of_row(9215)), (3, 3));
        // A fused gate|up: one table each.
        assert_eq!(stacked_tables(&[(512, &t1[..]), (512, &t2[..])]).unwrap().0, 512);
        // Row counts whose gcd is not a multiple of 16 cannot share the kernels' tables.
        assert!(stacked_tables(&[(24, &t1[..]), (40, &t2[..])]).is_err());
    }

    #[test]
    fn fused_groups_follow_the_stored_precision() {
        let d = micro_dims();
        let l0 = "model.language_model.layers.0.linear_attn";
        let l3 = "model.language_model.layers.3.self_attn";
        // The vendor-tool FP8 export: linear_attn.* BF16 (ignored by the quantiser), q/k/v FP8.
        let fp8 = fixture("micro-fp8");
        let (parts, idx) = fused_group(&fp8, &d, &format!("{l0}.in_proj_qkv"), Precision::Bf16).expect("GDN group");
        assert_eq!(idx, 0);
        let want: Vec<(String, usize)> = [("in_proj_qkv", 256), ("in_proj_z", 128), ("in_proj_b", 4), ("in_proj_a", 4)]
            .iter()
            .map(|(m, n)| (format!("{l0}.{m}"), *n))
            .collect();
        assert_eq!(parts, want);
        assert_eq!(fused_group(&fp8, &d, &format!("{l0}.in_proj_a"), Precision::Bf16).map(|g| g.1), Some(3));
        let (parts, idx) = fused_group(&fp8, &d, &format!("{l3}.v_proj"), Precision::Fp8).expect("attention group");
        assert_eq!((parts.iter().map(|p| p.1).collect::<Vec<_>>(), idx), (vec![256, 64, 64], 2));
        // A precision the checkpoint does not store: no fusion (loaded one by one, and refused there).
        assert!(fused_group(&fp8, &d, &format!("{l3}.q_proj"), Precision::Bf16).is_none());
        assert!(fused_group(&fp8, &d, &format!("{l0}.in_proj_qkv"), Precision::Fp8).is_none());
        // Not in a group.
        for m in [
            format!("{l3}.o_proj"),
            format!("{l0}.out_proj"),
            "model.language_model.layers.0.mlp.gate".into(),
            "lm_head".into(),
        ] {
            assert!(
                fused_group(&fp8, &d, &m, Precision::Bf16).is_none()
                    && fused_group(&fp8, &d, &m, Precision::Fp8).is_none(),
                "{m}"
            );
        }
        // The NVFP4A16 export fuses attention's q|k|v in NVFP4 (linear_attn.* stays BF16, fused).
        let fp4 = fixture("micro-nvfp4");
        let (parts, idx) =
            fused_group(&fp4, &d, &format!("{l3}.k_proj"), Precision::Nvfp4).expect("NVFP4 attention group");
        assert_eq!((parts.iter().map(|p| p.1).collect::<Vec<_>>(), idx), (vec![256, 64, 64], 1));
        assert!(fused_group(&fp4, &d, &format!("{l3}.q_proj"), Precision::Fp8).is_none());
        assert!(fused_group(&fp4, &d, &format!("{l0}.in_proj_qkv"), Precision::Bf16).is_some());
        // The BF16 export fuses both groups in BF16.
        let bf16 = fixture("micro-bf16");
        assert!(fused_group(&bf16, &d, &format!("{l3}.q_proj"), Precision::Bf16).is_some());
        assert!(fused_group(&bf16, &d, &format!("{l0}.in_proj_z"), Precision::Bf16).is_some());
    }
}
