//! `cargo xtask dist`: the release `ornith` binary, stripped, in `<target>/dist/` with a short
//! README.txt, after checking that it links nothing beyond glibc's own libraries.

use crate::elf;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `CARGO_TARGET_DIR`, else `<workspace>/target`.
fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => root.join("target"),
    }
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    anyhow::ensure!(status.success(), "{cmd:?} failed ({status})");
    Ok(())
}

/// Builds, strips and checks the binary; returns the path of the copy in `<target>/dist/`.
pub fn dist(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(Command::new(&cargo).current_dir(root).args([
        "build",
        "--release",
        "-p",
        "ornith-runtime",
        "--bin",
        "ornith",
    ]))?;
    let target = target_dir(root);
    let built = target.join("release").join("ornith");
    let dist = target.join("dist");
    std::fs::create_dir_all(&dist).with_context(|| format!("creating {}", dist.display()))?;
    let out = dist.join("ornith");
    std::fs::copy(&built, &out).with_context(|| format!("copying {} to {}", built.display(), out.display()))?;
    run(Command::new("strip").arg(&out)).context("stripping the binary (binutils' strip)")?;

    let needs = elf::dynamic_needs_of(&out).map_err(anyhow::Error::msg)?;
    let beyond = needs.beyond_glibc();
    if !beyond.is_empty() {
        bail!("{} links {beyond:?} beyond glibc's own libraries; the shipped binary must not", out.display());
    }
    let glibc = needs.max_glibc().map_or_else(|| "any".to_string(), |(a, b)| format!("{a}.{b}"));
    let readme = format!(
        "ornith {version} ({arch}-linux)\n\
         \n\
         Links only glibc's libraries ({needed}); needs glibc {glibc} or newer.\n\
         The NVIDIA driver's libcuda.so is loaded at run time when a GPU is used (driver r580 /\n\
         CUDA 13.0 or newer); without it the CPU backend runs.\n\
         \n\
         The binary is compiled for one checkpoint (the one `cargo xtask gen` validated); run it as\n\
         \n\
         \x20   ornith --model /path/to/that/checkpoint < requests.jsonl > results.jsonl\n\
         \n\
         `ornith --help` lists the flags; the JSONL contract is in the project's README.md.\n",
        version = env!("CARGO_PKG_VERSION"),
        arch = std::env::consts::ARCH,
        needed = needs.needed.join(", "),
    );
    std::fs::write(dist.join("README.txt"), readme).context("writing README.txt")?;
    let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "{} ({:.1} MiB, stripped): needs {} (glibc >= {glibc}); README.txt beside it",
        out.display(),
        size as f64 / (1u64 << 20) as f64,
        needs.needed.join(", ")
    );
    Ok(out)
}
