//! Precompiled PTX of the CUDA kernels (`kernels/cuda/*.cu`, compiled by `cargo xtask ptx`), the
//! kernel parameter structs bound from `kernels/include/ornith_kernels.h` (`cargo xtask bindgen`),
//! and the source digest that ties each committed PTX to the sources it was compiled from.
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code, clippy::all)]
pub mod bindings;

/// First line of every committed PTX: this prefix, then the hex sha256 of its sources.
pub const STAMP_PREFIX: &str = "// ornith-sources-sha256: ";

/// GPU architectures that PTX is shipped for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Hopper (H100/H200), compute capability 9.0.
    Sm90,
    /// DGX Spark (GB10), compute capability 12.1; also used for other 12.x devices.
    Sm121,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Sm90, Arch::Sm121];
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm90 => "sm_90",
            Arch::Sm121 => "sm_121",
        }
    }
}

/// One kernel source file = one PTX module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Module {
    Norm,
    Gemv,
    Moe,
    Gdn,
    Attention,
    Sample,
    Gemm,
    GdnChunk,
    FlashAttn,
    MoePrefill,
    Nvfp4,
}

impl Module {
    pub const ALL: [Module; 11] = [
        Module::Norm,
        Module::Gemv,
        Module::Moe,
        Module::Gdn,
        Module::Attention,
        Module::Sample,
        Module::Gemm,
        Module::GdnChunk,
        Module::FlashAttn,
        Module::MoePrefill,
        Module::Nvfp4,
    ];
    /// Source file stem in `kernels/cuda/`.
    pub fn stem(self) -> &'static str {
        match self {
            Module::Norm => "norm",
            Module::Gemv => "gemv",
            Module::Moe => "moe",
            Module::Gdn => "gdn",
            Module::Attention => "attention",
            Module::Sample => "sample",
            Module::Gemm => "gemm",
            Module::GdnChunk => "gdn_chunk",
            Module::FlashAttn => "flash_attn",
            Module::MoePrefill => "moe_prefill",
            Module::Nvfp4 => "nvfp4",
        }
    }
}

macro_rules! ptx_table {
    ($($m:ident => $f:literal),* $(,)?) => {
        /// The committed PTX text of `module` for `arch`.
        pub fn ptx(arch: Arch, module: Module) -> &'static str {
            match (arch, module) {
                $(
                    (Arch::Sm90, Module::$m) => include_str!(concat!("../ptx/sm_90/", $f, ".ptx")),
                    (Arch::Sm121, Module::$m) => include_str!(concat!("../ptx/sm_121/", $f, ".ptx")),
                )*
            }
        }
    };
}
ptx_table!(
    Norm => "norm", Gemv => "gemv", Moe => "moe", Gdn => "gdn", Attention => "attention", Sample => "sample",
    Gemm => "gemm", GdnChunk => "gdn_chunk", FlashAttn => "flash_attn", MoePrefill => "moe_prefill",
    Nvfp4 => "nvfp4",
);

/// The digest stamped in a PTX text (its first line), if present.
pub fn stamped_digest(ptx: &str) -> Option<&str> {
    ptx.lines().next()?.strip_prefix(STAMP_PREFIX).map(str::trim)
}

/// The file name of a cubin assembled from `ptx(arch, module)` (`cargo xtask cubin`), which
/// `ORNITH_CUBIN_DIR` serves to the runtime in place of the driver's JIT of that PTX (a test
/// machine's first start JITs every module, ~100 s on the device hosts): arch, module stem and the
/// first 16 hex digits of the sha256 of the PTX text itself, so a cubin is only ever found for the
/// exact PTX it was assembled from.
pub fn cubin_name(arch: Arch, module: Module) -> String {
    let d = Sha256::digest(ptx(arch, module).as_bytes());
    let hex: String = d.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{hex}.cubin", arch.name(), module.stem())
}

/// `kernels/cuda/*.cu`, sorted.
pub fn cuda_sources(kernels_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(kernels_dir.join("cuda"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    v.sort();
    Ok(v)
}

/// sha256 over the sources one PTX is compiled from: the `.cu` file, then every shared header
/// (`include/*.h`, `cuda/*.cuh`) in sorted order; each contributes its file name, a NUL and its bytes
/// (with `\r\n` read as `\n`, so a checkout's line endings do not matter).
pub fn source_digest(kernels_dir: &Path, cu: &Path) -> std::io::Result<String> {
    let mut files = vec![cu.to_path_buf()];
    let mut headers = Vec::new();
    for (dir, ext) in [("include", "h"), ("cuda", "cuh")] {
        for e in std::fs::read_dir(kernels_dir.join(dir))? {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == ext) {
                headers.push(p);
            }
        }
    }
    headers.sort();
    files.extend(headers);
    let mut h = Sha256::new();
    for f in files {
        let name = f.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let text = std::fs::read(&f)?;
        let text: Vec<u8> = String::from_utf8_lossy(&text).replace("\r\n", "\n").into_bytes();
        h.update(name.as_bytes());
        h.update([0u8]);
        h.update(&text);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kdir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    /// The committed PTX must come from the committed sources: recompute each source digest and
    /// compare it with the stamp of both arches' PTX. Fails after editing a `.cu`/header without
    /// running `cargo xtask ptx`.
    #[test]
    fn committed_ptx_matches_sources() {
        let sources = cuda_sources(&kdir()).unwrap();
        assert_eq!(sources.len(), Module::ALL.len(), "every .cu needs a Module entry: {sources:?}");
        for m in Module::ALL {
            let cu = kdir().join("cuda").join(format!("{}.cu", m.stem()));
            let want = source_digest(&kdir(), &cu).unwrap();
            for a in Arch::ALL {
                let got = stamped_digest(ptx(a, m));
                assert_eq!(
                    got,
                    Some(want.as_str()),
                    "{} PTX of {} is stale: run `cargo xtask ptx`",
                    a.name(),
                    m.stem()
                );
            }
        }
    }

    /// Each PTX targets its arch and an ISA the CUDA 13.0 driver loads (<= 9.0).
    #[test]
    fn ptx_targets_and_isa() {
        for m in Module::ALL {
            for a in Arch::ALL {
                let p = ptx(a, m);
                assert!(p.lines().any(|l| l.trim() == format!(".target {}", a.name())), "{:?} {:?}", a, m);
                let v = p.lines().find(|l| l.starts_with(".version ")).expect(".version line");
                let (maj, min) = v[9..].trim().split_once('.').unwrap();
                let v = (maj.parse::<u32>().unwrap(), min.parse::<u32>().unwrap());
                assert!(v <= (9, 0), "{:?} {:?}: PTX ISA {v:?} is newer than the r580 driver accepts", a, m);
            }
        }
    }

    /// The runtime launches every kernel with programmatic dependent launch (see `pdl_wait` in
    /// common.cuh): a kernel without `griddepcontrol.wait` could read its inputs before the
    /// previous kernel wrote them. Every entry point of every PTX must contain the wait.
    #[test]
    fn every_kernel_waits_for_its_predecessor() {
        let mut entries = 0;
        for m in Module::ALL {
            for a in Arch::ALL {
                let p = ptx(a, m);
                let mut parts = p.split(".entry ").skip(1).peekable();
                assert!(parts.peek().is_some(), "{:?} {:?}: no entry point", a, m);
                for body in parts {
                    let name: String = body.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    // the body runs to the next entry (or the end): functions are all inlined
                    assert!(
                        body.contains("griddepcontrol.wait"),
                        "{:?} {}: kernel {name} never executes griddepcontrol.wait",
                        a,
                        m.stem()
                    );
                    assert!(
                        body.contains("griddepcontrol.launch_dependents"),
                        "{:?} {}: kernel {name} never lets its dependents launch",
                        a,
                        m.stem()
                    );
                    entries += 1;
                }
            }
        }
        assert!(entries >= 2 * Module::ALL.len(), "found only {entries} entry points");
    }

    /// Cubin names are `<arch>-<stem>-<16 hex digits>.cubin`, the digests distinct across the PTX texts.
    #[test]
    fn cubin_names_are_per_ptx() {
        let mut names = std::collections::HashSet::new();
        for a in Arch::ALL {
            for m in Module::ALL {
                let n = cubin_name(a, m);
                let hex = n
                    .strip_prefix(&format!("{}-{}-", a.name(), m.stem()))
                    .and_then(|r| r.strip_suffix(".cubin"))
                    .unwrap_or_else(|| panic!("{n}: not <arch>-<stem>-<digest>.cubin"));
                assert!(hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{n}: digest");
                assert!(names.insert(hex.to_string()), "{a:?} {m:?}: two PTX texts with one digest");
            }
        }
    }

    /// The digest changes with any byte of the sources.
    #[test]
    fn digest_is_sensitive() {
        let dir = std::env::temp_dir().join(format!("ornith-digest-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("cuda")).unwrap();
        std::fs::create_dir_all(dir.join("include")).unwrap();
        std::fs::write(dir.join("include/a.h"), "x").unwrap();
        std::fs::write(dir.join("cuda/k.cu"), "int a;").unwrap();
        let d1 = source_digest(&dir, &dir.join("cuda/k.cu")).unwrap();
        std::fs::write(dir.join("include/a.h"), "y").unwrap();
        let d2 = source_digest(&dir, &dir.join("cuda/k.cu")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_ne!(d1, d2);
        assert_eq!(d1.len(), 64);
    }
}
