//! Streams a [`Plan`]'s shards to disk, tensor by tensor, one row batch at a time: memory stays
//! at one batch buffer (≤ ~8 MiB of f32 plus its encoded bytes), the encoded batches on their way
//! to the writer thread (at most [`IN_FLIGHT`]), as many written ones waiting to be filled again
//! (two more at most) and one FP8 weight's scales.
//!
//! Generation and writing overlap: a shard's bytes go to a writer thread through a bounded
//! channel while the next batch is generated on every core, and the shards are synced to disk
//! once, after the last one is written (before the caller stamps the checkpoint), not one by one
//! — so the disk flushes one shard while the next is generated. (Before, the generator waited for
//! each batch's write and each shard's sync; the bytes written are the same.) A batch's buffer
//! travels to the writer and back ([`ToWriter`]): its bytes are never copied on the way to the
//! file (the writer's small buffer only gathers the header and small tensors).

use super::init::{rows_of, Init, TensorKey};
use super::plan::{Kind, Plan, PlannedTensor, ShardPlan};
use anyhow::{bail, Context, Result};
use half::bf16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use model_spec::fp8::quantize_weight_row;
use model_spec::DType;
use rayon::prelude::*;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

/// What goes into the shard files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contents {
    /// Every tensor's values.
    Data,
    /// Length prefix and header only; the data section is a hole (`File::set_len`, a sparse
    /// file). Complete for everything that reads only headers, e.g. `model_spec::load_checkpoint`.
    HeadersOnly,
}

/// Target f32 elements per generated row batch.
const BATCH_ELEMS: usize = 2 << 20;
/// Encoded batches queued for the writer thread at most (the generator waits beyond that).
const IN_FLIGHT: usize = 4;
/// The shard writer's buffer: writes at least this long go to the file directly (every row batch
/// of a large tensor); shorter ones (the header, norms, scales) are gathered.
const WRITE_BUF: usize = 256 << 10;

/// Writes every shard of `plan` into `dir`.
pub fn write_shards(plan: &Plan, dir: &Path, contents: Contents, progress: bool) -> Result<()> {
    let bar = if progress && contents == Contents::Data {
        let b = ProgressBar::with_draw_target(Some(plan.total_size()), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b.set_message(format!("synth {}", plan.preset));
        b
    } else {
        ProgressBar::hidden()
    };
    // The encoded scales of the FP8 or NVFP4 weight written last, reused for its `.weight_scale`
    // when that follows.
    let mut pending: Option<(String, Vec<u8>)> = None;
    let mut written = Vec::with_capacity(plan.shards.len());
    for shard in &plan.shards {
        let path = dir.join(&shard.file);
        let file = write_shard(plan.seed, shard, &path, contents, &bar, &mut pending)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push((path, file));
    }
    bar.finish_and_clear();
    if contents == Contents::Data {
        for (path, file) in written {
            file.sync_all().with_context(|| format!("syncing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The producer's end of a shard's writer thread: [`ToWriter::send`] hands the writer a filled
/// buffer and returns one to fill next — one the writer has written and sent back (its old
/// contents still in it: the caller sets its length and writes every byte), or a new empty one —
/// so the bytes are not copied on the way. A closed channel means the writer stopped on an
/// error, which the join reports.
struct ToWriter {
    tx: SyncSender<Vec<u8>>,
    back: Receiver<Vec<u8>>,
}

impl ToWriter {
    fn send(&mut self, buf: Vec<u8>) -> io::Result<Vec<u8>> {
        let cap = buf.capacity();
        self.tx.send(buf).map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the shard writer stopped"))?;
        Ok(self.buffer(cap))
    }

    /// A buffer to fill: a returned one if any, else a new one of `cap` bytes' capacity.
    fn buffer(&mut self, cap: usize) -> Vec<u8> {
        self.back.try_recv().unwrap_or_else(|_| Vec::with_capacity(cap))
    }
}

/// Writes one shard; returns its file, written but not yet synced.
fn write_shard(
    seed: u64,
    shard: &ShardPlan,
    path: &Path,
    contents: Contents,
    bar: &ProgressBar,
    pending: &mut Option<(String, Vec<u8>)>,
) -> Result<File> {
    let file = File::create(path)?;
    let mut w = BufWriter::with_capacity(WRITE_BUF, file);
    w.write_all(&(shard.header.len() as u64).to_le_bytes())?;
    w.write_all(&shard.header)?;
    if contents == Contents::HeadersOnly {
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.set_len(shard.file_len())?;
        return Ok(file);
    }
    let (tx, rx) = sync_channel::<Vec<u8>>(IN_FLIGHT);
    // Written buffers on their way back (never more than exist: the writer does not block on it).
    let (back_tx, back) = sync_channel::<Vec<u8>>(IN_FLIGHT + 2);
    std::thread::scope(|sc| {
        let writer = sc.spawn(move || -> io::Result<File> {
            for batch in rx {
                w.write_all(&batch)?;
                let _ = back_tx.try_send(batch); // full or closed: the buffer is dropped
            }
            w.into_inner().map_err(|e| e.into_error())
        });
        let mut to_writer = ToWriter { tx, back };
        let produced = (|| -> Result<()> {
            let mut written = 0u64;
            for t in &shard.tensors {
                if t.data_offsets.0 != written {
                    bail!("plan error: {} starts at {} but {} bytes were written", t.name, t.data_offsets.0, written);
                }
                let n = write_tensor(seed, t, &mut to_writer, bar, pending)?;
                if n != t.nbytes() {
                    bail!("plan error: {} should be {} bytes but {} were written", t.name, t.nbytes(), n);
                }
                written += n;
            }
            Ok(())
        })();
        drop(to_writer); // closes the channel: the writer drains what is queued and stops
        let file = writer.join().map_err(|_| anyhow::anyhow!("the shard writer panicked"))?;
        // A write error stops the writer first and the producer then fails on the closed
        // channel: the writer's error is the one that says what happened.
        let file = file?;
        produced?;
        Ok(file)
    })
}

/// Generates rows `[r0, r0 + out.len() / row_len)` of a tensor in parallel.
fn gen_rows(key: TensorKey, init: Init, r0: usize, row_len: usize, out: &mut [f32]) {
    out.par_chunks_mut(row_len.max(1)).enumerate().for_each(|(i, row)| key.fill_row(init, (r0 + i) as u64, row));
}

fn write_tensor(
    seed: u64,
    t: &PlannedTensor,
    w: &mut ToWriter,
    bar: &ProgressBar,
    pending: &mut Option<(String, Vec<u8>)>,
) -> Result<u64> {
    let (rows, row_len) = rows_of(&t.shape);
    if row_len == 0 {
        return Ok(0);
    }
    let batch_rows = (BATCH_ELEMS / row_len).clamp(1, rows.max(1));
    let mut f = vec![0f32; batch_rows * row_len];
    let mut bytes = w.buffer(batch_rows * row_len * 4);
    let mut total = 0u64;
    // Hands a filled buffer to the writer, counts its bytes, returns the buffer to fill next.
    let mut put = |b: Vec<u8>| -> io::Result<Vec<u8>> {
        let n = b.len() as u64;
        total += n;
        bar.inc(n);
        w.send(b)
    };
    match &t.kind {
        Kind::Dense(init) => {
            let key = TensorKey::new(seed, &t.name);
            for r0 in (0..rows).step_by(batch_rows) {
                let n = batch_rows.min(rows - r0);
                let buf = &mut f[..n * row_len];
                gen_rows(key, *init, r0, row_len, buf);
                bytes.clear();
                encode(t.dtype, buf, &mut bytes)?;
                bytes = put(bytes)?;
            }
        }
        Kind::Fp8Weight(init) => {
            let key = TensorKey::new(seed, &t.name);
            let mut scales = Vec::with_capacity(rows);
            for r0 in (0..rows).step_by(batch_rows) {
                let n = batch_rows.min(rows - r0);
                let buf = &mut f[..n * row_len];
                gen_rows(key, *init, r0, row_len, buf);
                bytes.resize(n * row_len, 0);
                let mut s = vec![bf16::ZERO; n];
                bytes
                    .par_chunks_mut(row_len)
                    .zip(buf.par_chunks(row_len))
                    .zip(s.par_iter_mut())
                    .for_each(|((q, row), s)| *s = quantize_weight_row(row, q));
                scales.extend_from_slice(&s);
                bytes = put(bytes)?;
            }
            *pending = Some((t.name.clone(), scales.iter().flat_map(|s| s.to_le_bytes()).collect()));
        }
        Kind::Nvfp4Packed(init) => {
            let key = TensorKey::new(seed, &t.name);
            let (g, global) = (model_spec::nvfp4::GROUP, super::plan::nvfp4_global_scale());
            let n_in = row_len * 2;
            let mut scales = Vec::with_capacity(rows * n_in / g);
            let mut f = vec![0f32; batch_rows * n_in];
            for r0 in (0..rows).step_by(batch_rows) {
                let n = batch_rows.min(rows - r0);
                let buf = &mut f[..n * n_in];
                gen_rows(key, *init, r0, n_in, buf);
                bytes.resize(n * row_len, 0);
                let mut s = vec![0u8; n * n_in / g];
                bytes
                    .par_chunks_mut(row_len)
                    .zip(buf.par_chunks(n_in))
                    .zip(s.par_chunks_mut(n_in / g))
                    .for_each(|((p, row), s)| model_spec::nvfp4::quantize_row(row, global, p, s));
                scales.extend_from_slice(&s);
                bytes = put(bytes)?;
            }
            *pending = Some((t.name.clone(), scales));
        }
        Kind::Fp8Scale { .. } | Kind::Nvfp4Scale { .. } => {
            let (weight, want) = match &t.kind {
                Kind::Fp8Scale { weight, .. } => (weight, rows * 2),
                Kind::Nvfp4Scale { packed, .. } => (packed, rows * row_len),
                _ => unreachable!(),
            };
            let b = match pending.take() {
                Some((name, s)) if name == *weight => s,
                _ => scales_of(seed, &t.kind, rows),
            };
            if b.len() != want || (matches!(t.kind, Kind::Fp8Scale { .. }) && row_len != 1) {
                bail!(
                    "plan error: scale tensor {} {:?} does not match its weight's {} scale bytes",
                    t.name,
                    t.shape,
                    b.len()
                );
            }
            put(b)?;
        }
    }
    Ok(total)
}

/// The encoded bytes of a scale tensor, recomputed from its weight's rows (when the weight was
/// not the tensor written just before it).
fn scales_of(seed: u64, kind: &Kind, rows: usize) -> Vec<u8> {
    match kind {
        Kind::Fp8Scale { weight, init, in_features } => {
            fp8_scales(seed, weight, *init, rows, *in_features).iter().flat_map(|s| s.to_le_bytes()).collect()
        }
        Kind::Nvfp4Scale { packed, init, in_features } => nvfp4_scales(seed, packed, *init, rows, *in_features),
        _ => unreachable!("only scale tensors"),
    }
}

/// The E4M3 group scales `[rows, in/16]` of an NVFP4 weight, recomputed from its rows.
pub fn nvfp4_scales(seed: u64, packed: &str, init: Init, rows: usize, in_features: usize) -> Vec<u8> {
    let key = TensorKey::new(seed, packed);
    let (g, global) = (model_spec::nvfp4::GROUP, super::plan::nvfp4_global_scale());
    (0..rows)
        .into_par_iter()
        .flat_map_iter(|r| {
            let mut row = vec![0f32; in_features];
            key.fill_row(init, r as u64, &mut row);
            let (mut p, mut s) = (vec![0u8; in_features / 2], vec![0u8; in_features / g]);
            model_spec::nvfp4::quantize_row(&row, global, &mut p, &mut s);
            s
        })
        .collect()
}

/// The per-channel scales of an FP8 weight, recomputed from its rows.
pub fn fp8_scales(seed: u64, weight: &str, init: Init, rows: usize, in_features: usize) -> Vec<bf16> {
    let key = TensorKey::new(seed, weight);
    (0..rows)
        .into_par_iter()
        .map(|r| {
            let mut row = vec![0f32; in_features];
            key.fill_row(init, r as u64, &mut row);
            let mut q = vec![0u8; in_features];
            quantize_weight_row(&row, &mut q)
        })
        .collect()
}

/// f32 → stored little-endian bytes (BF16 round-to-nearest-even, or F32 as is).
fn encode(dtype: DType, src: &[f32], out: &mut Vec<u8>) -> Result<()> {
    match dtype {
        DType::BF16 => out.extend(src.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes())),
        DType::F32 => out.extend(src.iter().flat_map(|&x| x.to_le_bytes())),
        other => bail!("dense tensors are BF16 or F32, not {other}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::plan::{plan_quant, Quant};
    use crate::synth::preset::Preset;

    /// A shard whose writes fail (`/dev/full`: every write is ENOSPC) reports the writer's own
    /// error, not the producer's closed channel, and does not hang.
    #[test]
    fn a_failing_write_reports_the_disk_error() {
        let plan = plan_quant(Preset::Tiny, 1, Quant::Fp8);
        let shard = &plan.shards[0];
        assert!(shard.file_len() > 16 << 20, "the shard must be more than a few of the writer's batches");
        let mut pending = None;
        let err =
            write_shard(plan.seed, shard, Path::new("/dev/full"), Contents::Data, &ProgressBar::hidden(), &mut pending)
                .expect_err("writing to /dev/full must fail");
        let io = err.downcast_ref::<io::Error>().unwrap_or_else(|| panic!("not an io::Error: {err:#}"));
        assert_eq!(io.raw_os_error(), Some(28), "want ENOSPC (the disk's error), got {io}");
    }
}
