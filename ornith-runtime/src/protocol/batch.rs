//! `ornith batch --input in.jsonl --output out.jsonl`: the JSONL front end over files, resumable.
//!
//! * A request's identity is its `custom_id` (or `id` for a bare body), else `line-N` (its
//!   1-based line in the input): the `custom_id` its result line echoes. A line without an id is
//!   therefore matched by position: edit the input only by appending, or give ids.
//! * Before running, the output is read back: every complete result line (a JSON object with a
//!   `response` key, ending in a newline) counts as done and its request is skipped; a last line
//!   without its newline (a kill in the middle of a write) is cut away, and so are `cancelled`
//!   lines (from a stop by signal), so that their requests run again and every request ends with
//!   exactly one result line. Anything else in the file is refused (it is not ours to cut).
//!   The rest of the results are appended, each written and flushed as its request finishes, so
//!   a kill loses at most the requests in flight.
//! * Only result lines are written (a request's `stream` is ignored).
//! * Sampling without a `seed` draws a fresh default seed per run (as `ornith run` does); give a
//!   `seed` (or `temperature: 0`) to get the same results whether or not the run was resumed.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;

use anyhow::Context;
use serde_json::Value;

/// What [`prepare_output`] found in an earlier run's output.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Prepared {
    /// Result lines kept, by `custom_id` (a duplicate id's lines are counted).
    pub done: HashMap<String, u32>,
    /// Result lines kept.
    pub kept: u64,
    /// `cancelled` lines removed (their requests run again).
    pub dropped_cancelled: u64,
    /// Bytes of an unfinished last line cut away.
    pub truncated_bytes: u64,
}

/// Whether `v` is a result line, and its `custom_id` and error code.
fn result_line(v: &Value) -> Option<(String, Option<&str>)> {
    let obj = v.as_object()?;
    obj.get("response")?;
    let id = obj.get("custom_id")?.as_str()?.to_string();
    Some((id, obj.get("error").and_then(|e| e.get("code")).and_then(Value::as_str)))
}

/// Reads the output of an earlier run (if any) and makes it a clean prefix of this one: cuts an
/// unfinished last line and the `cancelled` lines, refuses a file that holds anything other than
/// result lines. Returns what is done.
pub fn prepare_output(path: &Path) -> anyhow::Result<Prepared> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes).with_context(|| format!("reading {}", path.display()))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Prepared::default()),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    }
    let mut p = Prepared::default();
    // Everything after the last newline is an unfinished write.
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    p.truncated_bytes = (bytes.len() - complete) as u64;
    let mut keep: Vec<&[u8]> = Vec::new();
    for (i, line) in bytes[..complete].split_inclusive(|&b| b == b'\n').enumerate() {
        let line = &line[..line.len() - 1];
        let parsed = serde_json::from_slice::<Value>(line).ok();
        let Some((id, code)) = parsed.as_ref().and_then(result_line) else {
            anyhow::bail!(
                "{} line {} is not a result line of `ornith batch`; refusing to resume into it (give another --output, or \
                 remove the file to start over)",
                path.display(),
                i + 1
            );
        };
        if code == Some("cancelled") {
            p.dropped_cancelled += 1;
            continue;
        }
        *p.done.entry(id).or_default() += 1;
        p.kept += 1;
        keep.push(line);
    }
    if p.truncated_bytes > 0 && p.dropped_cancelled == 0 {
        // Only the tail goes: cut it in place.
        let f = OpenOptions::new().write(true).open(path).with_context(|| format!("opening {}", path.display()))?;
        f.set_len(complete as u64).with_context(|| format!("truncating {}", path.display()))?;
        f.sync_all()?;
    } else if p.dropped_cancelled > 0 {
        // Rewrite next to it, then rename over it: the file is the old one or the new one.
        let tmp = path.with_extension("jsonl.ornith-tmp");
        {
            let mut w = BufWriter::new(File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
            for l in &keep {
                w.write_all(l)?;
                w.write_all(b"\n")?;
            }
            w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        }
        fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    }
    Ok(p)
}

/// Lines in the input (for the progress line): newlines, plus an unterminated last line.
pub fn count_lines(path: &Path) -> anyhow::Result<u64> {
    let mut r =
        BufReader::with_capacity(1 << 20, File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let (mut n, mut last) = (0u64, b'\n');
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        n += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        last = *buf.last().expect("not empty");
        let len = buf.len();
        r.consume(len);
    }
    Ok(n + u64::from(last != b'\n'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ornith-batch-{}-{name}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("out.jsonl");
        fs::write(&p, text).unwrap();
        p
    }

    const OK_A: &str = r#"{"id":"x","custom_id":"a","response":{"status_code":200},"error":null}"#;
    const OK_B: &str = r#"{"id":"x","custom_id":"b","response":{"status_code":200},"error":null}"#;
    const CANCELLED_C: &str =
        r#"{"id":"x","custom_id":"c","response":null,"error":{"code":"cancelled","message":"m"}}"#;
    const BAD_JSON_D: &str =
        r#"{"id":"x","custom_id":"d","response":null,"error":{"code":"invalid_json","message":"m"}}"#;

    #[test]
    fn no_output_yet_means_nothing_done() {
        let p = std::env::temp_dir().join(format!("ornith-batch-none-{}.jsonl", std::process::id()));
        assert_eq!(prepare_output(&p).unwrap(), Prepared::default());
        assert!(!p.exists());
    }

    #[test]
    fn an_unfinished_last_line_is_cut_away() {
        let text = format!("{OK_A}\n{BAD_JSON_D}\n{}", &OK_B[..30]);
        let p = tmp("tail", &text);
        let r = prepare_output(&p).unwrap();
        assert_eq!(r.kept, 2);
        assert_eq!(r.truncated_bytes, 30);
        assert_eq!(r.done, HashMap::from([("a".into(), 1), ("d".into(), 1)]));
        assert_eq!(fs::read_to_string(&p).unwrap(), format!("{OK_A}\n{BAD_JSON_D}\n"));
        // Even a whole JSON object without its newline is unfinished.
        fs::write(&p, format!("{OK_A}\n{OK_B}")).unwrap();
        let r = prepare_output(&p).unwrap();
        assert_eq!((r.kept, r.truncated_bytes), (1, OK_B.len() as u64));
        assert_eq!(fs::read_to_string(&p).unwrap(), format!("{OK_A}\n"));
    }

    #[test]
    fn cancelled_lines_are_removed_so_they_run_again() {
        let p = tmp("cancelled", &format!("{OK_A}\n{CANCELLED_C}\n{OK_B}\n{OK_A}\n{CANCELLED_C}"));
        let r = prepare_output(&p).unwrap();
        assert_eq!((r.kept, r.dropped_cancelled), (3, 1), "the unfinished tail is not counted as cancelled");
        assert_eq!(r.done, HashMap::from([("a".into(), 2), ("b".into(), 1)]));
        assert_eq!(fs::read_to_string(&p).unwrap(), format!("{OK_A}\n{OK_B}\n{OK_A}\n"));
        assert!(!p.with_extension("jsonl.ornith-tmp").exists());
    }

    #[test]
    fn a_file_that_is_not_ours_is_refused_untouched() {
        for (name, text) in [
            ("notjson", format!("{OK_A}\nhello\n{OK_B}\n")),
            ("chunk", format!("{OK_A}\n{{\"custom_id\":\"a\",\"object\":\"chat.completion.chunk\"}}\n")),
        ] {
            let p = tmp(name, &text);
            let e = prepare_output(&p).unwrap_err().to_string();
            assert!(e.contains("line 2 is not a result line"), "{e}");
            assert_eq!(fs::read_to_string(&p).unwrap(), text);
        }
    }

    #[test]
    fn lines_are_counted_with_or_without_a_final_newline() {
        let p = tmp("count", "a\nb\n");
        assert_eq!(count_lines(&p).unwrap(), 2);
        fs::write(&p, "a\nb\nc").unwrap();
        assert_eq!(count_lines(&p).unwrap(), 3);
        fs::write(&p, "").unwrap();
        assert_eq!(count_lines(&p).unwrap(), 0);
    }
}
