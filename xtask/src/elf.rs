//! Just enough of ELF64 (little-endian) to say what a Linux binary needs at run time: the
//! `DT_NEEDED` libraries of its dynamic section and the glibc symbol versions it references
//! (`.gnu.version_r`). Self-contained (std only) so that `ornith-runtime`'s end-to-end tests can
//! include it with `#[path]` and check the binary they run.

use std::path::Path;

/// The libraries glibc itself consists of: a binary that needs only these runs on any Linux with
/// a new enough glibc. Rust's std needs libc, libm, libgcc_s (unwinding) and the loader.
pub const GLIBC_LIBRARIES: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libgcc_s.so.1",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

/// What the dynamic loader needs for a binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicNeeds {
    /// `DT_NEEDED` entries, in file order.
    pub needed: Vec<String>,
    /// Version names required from other objects (`GLIBC_2.34`, `GCC_3.0`, …), sorted, unique.
    pub versions: Vec<String>,
}

impl DynamicNeeds {
    /// The newest `GLIBC_x.y` version referenced, as (x, y).
    pub fn max_glibc(&self) -> Option<(u32, u32)> {
        self.versions
            .iter()
            .filter_map(|v| {
                let (a, b) = v.strip_prefix("GLIBC_")?.split_once('.')?;
                let b = b.split('.').next()?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .max()
    }

    /// `DT_NEEDED` entries that are not part of glibc.
    pub fn beyond_glibc(&self) -> Vec<&str> {
        self.needed.iter().map(String::as_str).filter(|n| !GLIBC_LIBRARIES.contains(n)).collect()
    }
}

fn u16_at(b: &[u8], o: usize) -> Result<u16, String> {
    b.get(o..o + 2).map(|s| u16::from_le_bytes(s.try_into().unwrap())).ok_or_else(|| format!("truncated at {o}"))
}
fn u32_at(b: &[u8], o: usize) -> Result<u32, String> {
    b.get(o..o + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap())).ok_or_else(|| format!("truncated at {o}"))
}
fn u64_at(b: &[u8], o: usize) -> Result<u64, String> {
    b.get(o..o + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap())).ok_or_else(|| format!("truncated at {o}"))
}
fn cstr_at(b: &[u8], o: usize) -> Result<String, String> {
    let s = b.get(o..).ok_or_else(|| format!("string offset {o} outside the file"))?;
    let end = s.iter().position(|&c| c == 0).ok_or("unterminated string")?;
    Ok(String::from_utf8_lossy(&s[..end]).into_owned())
}

struct Section {
    kind: u32,
    offset: usize,
    size: usize,
    link: usize,
}

const SHT_DYNAMIC: u32 = 6;
const SHT_GNU_VERNEED: u32 = 0x6fff_fffe;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;

/// Reads the dynamic needs of the ELF64 little-endian file `bytes`.
pub fn dynamic_needs(bytes: &[u8]) -> Result<DynamicNeeds, String> {
    if bytes.get(..4) != Some(b"\x7fELF") {
        return Err("not an ELF file".into());
    }
    if bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err("only 64-bit little-endian ELF is read".into());
    }
    let shoff = u64_at(bytes, 0x28)? as usize;
    let shentsize = u16_at(bytes, 0x3A)? as usize;
    let shnum = u16_at(bytes, 0x3C)? as usize;
    let mut sections = Vec::with_capacity(shnum);
    for i in 0..shnum {
        let h = shoff + i * shentsize;
        sections.push(Section {
            kind: u32_at(bytes, h + 4)?,
            offset: u64_at(bytes, h + 0x18)? as usize,
            size: u64_at(bytes, h + 0x20)? as usize,
            link: u32_at(bytes, h + 0x28)? as usize,
        });
    }
    let strtab = |s: &Section| sections.get(s.link).map(|t| t.offset).ok_or("bad sh_link");
    let mut needed = Vec::new();
    let mut versions = Vec::new();
    for s in &sections {
        match s.kind {
            SHT_DYNAMIC => {
                let str_off = strtab(s)?;
                for e in (s.offset..s.offset + s.size).step_by(16) {
                    match u64_at(bytes, e)? {
                        DT_NULL => break,
                        DT_NEEDED => needed.push(cstr_at(bytes, str_off + u64_at(bytes, e + 8)? as usize)?),
                        _ => {}
                    }
                }
            }
            SHT_GNU_VERNEED => {
                // Elf64_Verneed { vn_version: u16, vn_cnt: u16, vn_file: u32, vn_aux: u32, vn_next: u32 }
                // Elf64_Vernaux { vna_hash: u32, vna_flags: u16, vna_other: u16, vna_name: u32, vna_next: u32 }
                let str_off = strtab(s)?;
                let mut vn = s.offset;
                loop {
                    let cnt = u16_at(bytes, vn + 2)? as usize;
                    let mut aux = vn + u32_at(bytes, vn + 8)? as usize;
                    for _ in 0..cnt {
                        versions.push(cstr_at(bytes, str_off + u32_at(bytes, aux + 8)? as usize)?);
                        aux += u32_at(bytes, aux + 12)? as usize;
                    }
                    match u32_at(bytes, vn + 12)? {
                        0 => break,
                        next => vn += next as usize,
                    }
                }
            }
            _ => {}
        }
    }
    versions.sort();
    versions.dedup();
    Ok(DynamicNeeds { needed, versions })
}

/// [`dynamic_needs`] of the file at `path`.
pub fn dynamic_needs_of(path: &Path) -> Result<DynamicNeeds, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    dynamic_needs(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}
