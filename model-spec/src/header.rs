//! Safetensors header reading. The shard is memory-mapped and only its header pages are
//! touched; the `safetensors` crate validates the header (dtype, shape × dtype = byte length,
//! contiguous in-bounds offsets, file length = header + data), and every failure becomes an
//! error naming the file — never a panic.

use crate::{DType, Result, SpecError};
use std::collections::BTreeMap;
use std::path::Path;

/// One tensor entry of a shard header.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderEntry {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data_offsets: (u64, u64),
}

/// A parsed shard header.
#[derive(Debug, Clone)]
pub struct ShardHeader {
    pub file_size: u64,
    pub header_len: u64,
    /// The raw JSON header bytes (fingerprinted).
    pub raw: Vec<u8>,
    pub tensors: BTreeMap<String, HeaderEntry>,
}

pub fn dtype_from_safetensors(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::BF16 => DType::BF16,
        S::F16 => DType::F16,
        S::F32 => DType::F32,
        S::F64 => DType::F64,
        S::F8_E4M3 => DType::F8_E4M3,
        S::F8_E5M2 => DType::F8_E5M2,
        S::I8 => DType::I8,
        S::U8 => DType::U8,
        S::I16 => DType::I16,
        S::I32 => DType::I32,
        S::I64 => DType::I64,
        S::U16 => DType::U16,
        S::U32 => DType::U32,
        S::U64 => DType::U64,
        S::BOOL => DType::BOOL,
        _ => return None,
    })
}

/// Parses a header from the bytes of a whole safetensors file (or its memory map).
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<ShardHeader> {
    let bad = |reason: String| SpecError::BadShard { path: path.to_path_buf(), reason };
    let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| {
        // safetensors' own messages do not name the tensor; look for the first concrete fault.
        if let Some(detail) = diagnose(bytes) {
            return bad(detail);
        }
        let detail = match &e {
            safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                "the file length does not match the header's data offsets (truncated or padded)".to_string()
            }
            safetensors::SafeTensorError::InvalidHeaderLength => {
                "the 8-byte header length points past the end of the file".to_string()
            }
            other => other.to_string(),
        };
        bad(detail)
    })?;
    let mut tensors = BTreeMap::new();
    for (name, info) in meta.tensors() {
        let dtype = dtype_from_safetensors(info.dtype)
            .ok_or_else(|| bad(format!("tensor {name}: dtype {:?} is not supported", info.dtype)))?;
        tensors.insert(
            name.clone(),
            HeaderEntry {
                dtype,
                shape: info.shape.clone(),
                data_offsets: (info.data_offsets.0 as u64, info.data_offsets.1 as u64),
            },
        );
    }
    Ok(ShardHeader { file_size: bytes.len() as u64, header_len: n as u64, raw: bytes[8..8 + n].to_vec(), tensors })
}

/// Names the first concrete fault of a header that safetensors refused: a tensor whose
/// dtype × shape disagrees with its byte range, overlapping or gapped ranges, or a data section
/// whose length differs from where the last tensor ends. `None` when the header is not even
/// readable JSON of the expected form (safetensors' message is then the best there is).
fn diagnose(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8u64.checked_add(n)?;
    let header = bytes.get(8..usize::try_from(end).ok()?)?;
    let value: serde_json::Value = serde_json::from_slice(header).ok()?;
    let obj = value.as_object()?;
    let data_len = bytes.len() as u64 - end;
    // (start, end, name) of every well-formed entry.
    let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = entry.get("dtype")?.as_str()?;
        let size = dtype_size_by_name(dtype)?;
        let shape: Vec<u64> = entry.get("shape")?.as_array()?.iter().map(|d| d.as_u64()).collect::<Option<_>>()?;
        let offs = entry.get("data_offsets")?.as_array()?;
        let (s, e) = (offs.first()?.as_u64()?, offs.get(1)?.as_u64()?);
        let want = shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d));
        if e < s {
            return Some(format!("tensor {name}: data_offsets [{s}, {e}] end before they start"));
        }
        match want {
            None => return Some(format!("tensor {name}: shape {shape:?} × {dtype} overflows 64 bits")),
            Some(w) if w != e - s => {
                return Some(format!(
                "tensor {name}: dtype {dtype} × shape {shape:?} = {w} bytes, but data_offsets [{s}, {e}] span {} bytes",
                e - s
            ))
            }
            _ => {}
        }
        if e > data_len {
            return Some(format!(
                "tensor {name}: data_offsets [{s}, {e}] point past the end of the data section ({data_len} bytes after the {n}-byte header): the file is truncated or its header is wrong"
            ));
        }
        ranges.push((s, e, name.as_str()));
    }
    ranges.sort();
    let mut pos = 0u64;
    let mut prev: Option<&str> = None;
    for &(s, e, name) in &ranges {
        if s < pos {
            return Some(format!(
                "tensor {name}: data_offsets [{s}, {e}] overlap tensor {} (which ends at {pos})",
                prev.unwrap_or("?")
            ));
        }
        if s > pos {
            return Some(format!(
                "tensor {name}: data_offsets start at {s}, leaving a gap after byte {pos} of the data section"
            ));
        }
        pos = e;
        prev = Some(name);
    }
    if pos != data_len {
        let last = prev.map(|p| format!(" (last tensor {p})")).unwrap_or_default();
        return Some(format!(
            "the header's tensors end at byte {pos} of the data section{last}, but {data_len} bytes follow the {n}-byte header (file length {}): the file is padded or its header is wrong",
            bytes.len()
        ));
    }
    None
}

fn dtype_size_by_name(d: &str) -> Option<u64> {
    Some(match d {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "BF16" | "F16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

/// Memory-maps `path` and parses its header.
pub fn read_header(path: &Path) -> Result<ShardHeader> {
    let file = std::fs::File::open(path).map_err(|source| SpecError::Io { path: path.to_path_buf(), err: source })?;
    let len = file.metadata().map_err(|source| SpecError::Io { path: path.to_path_buf(), err: source })?.len();
    if len < 8 {
        return Err(SpecError::BadShard {
            path: path.to_path_buf(),
            reason: format!("the file is {len} bytes, shorter than the 8-byte header length"),
        });
    }
    // SAFETY: the map is read-only and lives only for this call; a concurrent writer could
    // change the bytes under us, which at worst makes the header parse fail.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|source| SpecError::Io { path: path.to_path_buf(), err: source })?;
    parse_header(path, &map)
}
