//! Randomised robustness: garbage and mutated headers, configs and indexes must give errors,
//! never panics. Seeded and bounded (a few thousand header cases, a few hundred checkpoints).
// The closures return model-spec's `Result` as is (its error type is large by design).
#![allow(clippy::result_large_err)]

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use xtask::synth::{self, Contents, Preset, SynthOptions};

fn weird_value(rng: &mut ChaCha8Rng) -> Value {
    match rng.random_range(0..16) {
        0 => json!(u64::MAX),
        1 => json!(i64::MIN),
        2 => json!(-1),
        3 => json!(1e300),
        4 => json!(0),
        5 => json!(1.5),
        6 => Value::Null,
        7 => json!(true),
        8 => json!("x"),
        9 => json!(weird_string(rng)),
        10 => json!([]),
        11 => json!({}),
        12 => json!([u64::MAX, u64::MAX]),
        13 => json!((1u64 << 53) + 1),
        14 => json!([1, -1]),
        _ => json!(rng.random_range(0..100_000u64)),
    }
}

fn weird_string(rng: &mut ChaCha8Rng) -> String {
    let pieces = [
        "",
        "\u{0}",
        "é",
        "🦀",
        "\u{202e}",
        "__metadata__",
        "../x",
        "/etc/passwd",
        "model.language_model.layers.0",
        "a\nb",
        "\"",
        "\\",
        "Ω≈ç√",
    ];
    (0..rng.random_range(1..4)).map(|_| *pieces.choose(rng).unwrap()).collect()
}

/// Replaces one number literal of the JSON text with an out-of-range or odd literal.
fn mangle_number(text: &str, rng: &mut ChaCha8Rng) -> String {
    let starts: Vec<usize> = text
        .char_indices()
        .filter(|&(i, c)| c.is_ascii_digit() && (i == 0 || !text.as_bytes()[i - 1].is_ascii_digit()))
        .map(|(i, _)| i)
        .collect();
    let Some(&s) = starts.choose(rng) else { return text.to_string() };
    let e = s + text[s..].find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len() - s);
    let lit = ["99999999999999999999999999", "1e400", "-0", "-5", "18446744073709551616", "3.7", "0x10", "NaN"]
        .choose(rng)
        .unwrap();
    format!("{}{}{}", &text[..s], lit, &text[e..])
}

/// Applies one random edit somewhere in a JSON tree: walks down a random path, then removes,
/// renames or replaces the key (or element) it stops at.
fn mutate_json(v: &mut Value, rng: &mut ChaCha8Rng) {
    let descend = rng.random_bool(0.6);
    match v {
        Value::Array(a) if !a.is_empty() && descend => {
            let i = rng.random_range(0..a.len());
            mutate_json(&mut a[i], rng);
        }
        Value::Object(m) if !m.is_empty() && descend => {
            let k = m.keys().nth(rng.random_range(0..m.len())).unwrap().clone();
            let container = m[&k].is_object() || m[&k].is_array();
            if container && rng.random_bool(0.5) {
                mutate_json(m.get_mut(&k).unwrap(), rng);
                return;
            }
            match rng.random_range(0..4) {
                0 => {
                    m.shift_remove(&k);
                }
                1 => {
                    let val = m.shift_remove(&k).unwrap();
                    m.insert(weird_string(rng), val);
                }
                _ => m[&k] = weird_value(rng),
            }
        }
        _ => *v = weird_value(rng),
    }
}

fn file_bytes(header: &[u8], data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.resize(out.len() + data_len, 0);
    out
}

/// A small valid shard: the tensors of the tiny checkpoint other than the two 32 MB matrices.
fn small_shard() -> (Map<String, Value>, usize) {
    let plan = synth::plan(Preset::Tiny, 0);
    let mut h = Map::new();
    h.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut pos = 0u64;
    for (_, t) in plan.tensors().filter(|(_, t)| t.nbytes() < 100_000).take(40) {
        h.insert(
            t.name.clone(),
            json!({"dtype": t.dtype.as_str(), "shape": t.shape, "data_offsets": [pos, pos + t.nbytes()]}),
        );
        pos += t.nbytes();
    }
    (h, pos as usize)
}

/// One mutated safetensors file.
fn mutated_shard(base: &Map<String, Value>, data_len: usize, rng: &mut ChaCha8Rng) -> (Vec<u8>, &'static str) {
    let header = serde_json::to_vec(base).unwrap();
    match rng.random_range(0..7) {
        0 => ((0..rng.random_range(0..64)).map(|_| rng.random()).collect(), "random bytes"),
        1 => {
            let mut b = file_bytes(&header, data_len);
            let n = match rng.random_range(0..3) {
                0 => rng.random::<u64>(),
                1 => header.len() as u64 ^ (1 << rng.random_range(0..64)),
                _ => header.len() as u64 + rng.random_range(1..16),
            };
            b[..8].copy_from_slice(&n.to_le_bytes());
            (b, "length prefix")
        }
        2 => {
            let mut b = file_bytes(&header, data_len);
            for _ in 0..rng.random_range(1..6) {
                let i = rng.random_range(8..8 + header.len());
                b[i] = rng.random();
            }
            (b, "header byte flips")
        }
        3 => {
            let mut b = file_bytes(&header, data_len);
            b.truncate(rng.random_range(0..b.len()));
            (b, "truncated")
        }
        4 => {
            let text = mangle_number(std::str::from_utf8(&header).unwrap(), rng);
            (file_bytes(text.as_bytes(), data_len), "number literal")
        }
        _ => {
            let mut v = Value::Object(base.clone());
            for _ in 0..rng.random_range(1..4) {
                mutate_json(&mut v, rng);
            }
            let extra: i64 = if rng.random_bool(0.5) { 0 } else { rng.random_range(-64..64) };
            (file_bytes(&serde_json::to_vec(&v).unwrap(), (data_len as i64 + extra).max(0) as usize), "JSON edit")
        }
    }
}

#[test]
fn parse_header_never_panics() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5afe);
    let (base, data_len) = small_shard();
    let path = Path::new("fuzz.safetensors");
    let ok = model_spec::header::parse_header(path, &file_bytes(&serde_json::to_vec(&base).unwrap(), data_len));
    assert_eq!(ok.expect("the unmutated shard parses").tensors.len(), 40);
    let (mut oks, mut errs) = (0, 0);
    for i in 0..4000 {
        let (bytes, what) = mutated_shard(&base, data_len, &mut rng);
        match catch_unwind(AssertUnwindSafe(|| model_spec::header::parse_header(path, &bytes))) {
            Ok(Ok(h)) => {
                oks += 1;
                for (n, e) in &h.tensors {
                    assert!(
                        8 + h.header_len + e.data_offsets.1 <= bytes.len() as u64,
                        "case {i} ({what}): {n} out of bounds accepted"
                    );
                }
            }
            Ok(Err(e)) => {
                errs += 1;
                assert!(e.to_string().contains("fuzz.safetensors"), "case {i}: {e}");
            }
            Err(_) => panic!(
                "case {i} ({what}) panicked; input {:?}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(400)])
            ),
        }
    }
    // Both outcomes occur: the mutations are neither all fatal nor all harmless.
    assert!(oks > 50 && errs > 1000, "ok {oks} err {errs}");
}

#[test]
fn load_checkpoint_never_panics() {
    let base = tempfile::tempdir().unwrap();
    let opts = SynthOptions { contents: Contents::HeadersOnly, ..SynthOptions::new(Preset::Tiny, 0) };
    synth::synth(base.path(), opts).unwrap();
    let names: Vec<String> =
        std::fs::read_dir(base.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    let shards: Vec<&String> = names.iter().filter(|n| n.ends_with(".safetensors")).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(0xc0ffee);
    let (mut oks, mut errs) = (0, 0);
    for i in 0..300 {
        let dir = tempfile::tempdir().unwrap();
        let target = match rng.random_range(0..3) {
            0 => "config.json".to_string(),
            1 => "model.safetensors.index.json".to_string(),
            _ => (*shards.choose(&mut rng).unwrap()).clone(),
        };
        for n in &names {
            if *n != target {
                std::fs::hard_link(base.path().join(n), dir.path().join(n)).unwrap();
            }
        }
        let what;
        if target.ends_with(".safetensors") {
            let bytes = std::fs::read(base.path().join(&target)).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let (b, w) = mutated_shard(&header, 0, &mut rng);
            what = w;
            // Keep the data section's length (a hole) unless the mutation changed the header.
            std::fs::write(dir.path().join(&target), &b).unwrap();
            let f = std::fs::OpenOptions::new().write(true).open(dir.path().join(&target)).unwrap();
            f.set_len(b.len() as u64 + (bytes.len() - 8 - n) as u64).unwrap();
        } else {
            let text = std::fs::read_to_string(base.path().join(&target)).unwrap();
            let out = match rng.random_range(0..4) {
                0 => {
                    what = "number literal";
                    mangle_number(&text, &mut rng)
                }
                1 if rng.random_bool(0.2) => {
                    what = "random bytes";
                    (0..rng.random_range(0..64)).map(|_| rng.random_range(0x20u8..0x7f) as char).collect()
                }
                _ => {
                    what = "JSON edit";
                    let mut v: Value = serde_json::from_str(&text).unwrap();
                    for _ in 0..rng.random_range(1..4) {
                        mutate_json(&mut v, &mut rng);
                    }
                    serde_json::to_string(&v).unwrap()
                }
            };
            std::fs::write(dir.path().join(&target), out).unwrap();
        }
        match catch_unwind(AssertUnwindSafe(|| model_spec::load_checkpoint(dir.path()))) {
            Ok(Ok(_)) => oks += 1,
            Ok(Err(e)) => {
                errs += 1;
                assert!(
                    e.to_string().contains("Fix:") || e.to_string().contains("invalid ignore pattern"),
                    "case {i} ({what} of {target}): no fix in {e}"
                );
            }
            Err(_) => panic!("case {i}: load_checkpoint panicked on a {what} of {target}"),
        }
    }
    assert!(errs > 100 && oks > 5, "ok {oks} err {errs}");
}
