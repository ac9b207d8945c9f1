//! The checkpoint at run time: validated again through model-spec (so a changed or damaged
//! directory is refused before anything is allocated), shards memory-mapped, tensors borrowed
//! by exact name with their dtype and shape checked against what the compiled graph expects.

use anyhow::{bail, Context, Result};
use model_spec::{DType, ModelSpec, TensorInfo};
use std::collections::HashMap;
use std::path::Path;

pub struct Checkpoint {
    pub spec: ModelSpec,
    maps: HashMap<String, memmap2::Mmap>,
}

/// A tensor's bytes inside a shard map.
pub struct TensorView<'a> {
    pub name: &'a str,
    pub info: &'a TensorInfo,
    pub bytes: &'a [u8],
}

impl Checkpoint {
    /// Opens `dir`, re-validating the whole checkpoint, and checks that its fingerprint is the
    /// one the binary was compiled for.
    pub fn open(dir: &Path, compiled_fingerprint: &str) -> Result<Self> {
        let spec = model_spec::load_checkpoint(dir)?;
        if spec.fingerprint != compiled_fingerprint {
            bail!(
                "{}: this checkpoint (fingerprint {}) is not the one this binary was compiled for (fingerprint {}). \
                 Fix: run `cargo xtask gen --model {}` and rebuild, or pass the --model the binary was built for.",
                dir.display(),
                &spec.fingerprint[..16],
                &compiled_fingerprint[..16.min(compiled_fingerprint.len())],
                dir.display()
            );
        }
        let mut maps = HashMap::new();
        for shard in &spec.shards {
            let path = spec.model_dir.join(&shard.file);
            let f = std::fs::File::open(&path).with_context(|| format!("{}: cannot open shard", path.display()))?;
            // SAFETY: read-only map of a file we just validated; the engine never writes it.
            let map =
                unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("{}: cannot map shard", path.display()))?;
            if map.len() as u64 != shard.file_size {
                bail!(
                    "{}: the shard changed size since it was validated ({} → {} bytes)",
                    path.display(),
                    shard.file_size,
                    map.len()
                );
            }
            maps.insert(shard.file.clone(), map);
        }
        Ok(Checkpoint { spec, maps })
    }

    /// Borrows tensor `name`, checking dtype ∈ `dtypes` and the element count / shape.
    pub fn tensor<'a>(&'a self, name: &str, dtypes: &[DType], shape: &[usize]) -> Result<TensorView<'a>> {
        let (name, info) = self.spec.tensors.get_key_value(name).with_context(|| {
            format!("{}: missing tensor {name} (expected {:?} {shape:?}). Fix: this checkpoint does not match the compiled model; run `cargo xtask gen --model {}`", self.spec.model_dir.display(), dtypes, self.spec.model_dir.display())
        })?;
        if !dtypes.contains(&info.dtype) {
            bail!(
                "{}: tensor {name}: expected dtype {:?}, found {}",
                self.shard_path(info).display(),
                dtypes,
                info.dtype
            );
        }
        let numel: usize = shape.iter().product();
        if info.shape != shape && !(info.numel() == numel && squeeze_eq(&info.shape, shape)) {
            bail!(
                "{}: tensor {name}: expected shape {shape:?}, found {:?}",
                self.shard_path(info).display(),
                info.shape
            );
        }
        let shard = &self.spec.shards.iter().find(|s| s.file == info.shard).expect("validated shard");
        let map = &self.maps[&info.shard];
        let start = (shard.data_start() + info.data_offsets.0) as usize;
        let end = (shard.data_start() + info.data_offsets.1) as usize;
        Ok(TensorView { name, info, bytes: &map[start..end] })
    }

    fn shard_path(&self, info: &TensorInfo) -> std::path::PathBuf {
        self.spec.model_dir.join(&info.shard)
    }
}

/// Equal up to dimensions of size 1 (`[out, 1]` vs `[out]`, `[C, 1, K]` vs `[C, K]`).
fn squeeze_eq(a: &[usize], b: &[usize]) -> bool {
    let sa: Vec<_> = a.iter().filter(|&&d| d != 1).collect();
    let sb: Vec<_> = b.iter().filter(|&&d| d != 1).collect();
    sa == sb
}

/// Converts BF16 or F32 little-endian bytes to f32.
pub fn to_f32(v: &TensorView<'_>) -> Vec<f32> {
    match v.info.dtype {
        DType::F32 => v.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::BF16 => v.bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => panic!("to_f32 on {other}: callers check dtypes first"),
    }
}

/// Reinterprets BF16 bytes as bf16 values (copying; mmaps carry no alignment promise).
pub fn to_bf16(v: &TensorView<'_>) -> Vec<half::bf16> {
    assert_eq!(v.info.dtype, DType::BF16);
    v.bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect()
}
