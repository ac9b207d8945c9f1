//! The `ornith` binary embeds the typed graph of one checkpoint (`ornith_macros::model!()` reads
//! the spec). The macro's `include_bytes!` makes cargo rebuild when the spec file changes; this
//! makes it rebuild when `ORNITH_SPEC` points somewhere else.
fn main() {
    println!("cargo:rerun-if-env-changed=ORNITH_SPEC");
    println!("cargo:rerun-if-changed=build.rs");
}
