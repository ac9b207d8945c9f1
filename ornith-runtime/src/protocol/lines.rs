//! Line reading with a size cap: a line longer than the cap is consumed (never stored whole) and
//! reported as `TooLong`, so a 100 MB line costs one pass over the bytes and bounded memory.

use std::io::{self, BufRead};

/// Bytes of an over-long line kept so that its `custom_id` can still be recovered.
pub const HEAD_KEEP: usize = 4096;

#[derive(Debug, PartialEq)]
pub enum RawLine {
    /// The line without its `\n` (and without a trailing `\r`).
    Bytes(Vec<u8>),
    /// The line exceeded the cap; `len` is its full length, `head` its first bytes.
    TooLong { len: u64, head: Vec<u8> },
}

pub struct LineReader<R> {
    inner: R,
    max: usize,
}

impl<R: BufRead> LineReader<R> {
    pub fn new(inner: R, max_line_bytes: usize) -> Self {
        LineReader { inner, max: max_line_bytes }
    }

    /// The next line, or `None` at end of input. A final line without `\n` still counts.
    pub fn next_line(&mut self) -> io::Result<Option<RawLine>> {
        let mut buf: Vec<u8> = Vec::new();
        let mut len: u64 = 0;
        let mut too_long = false;
        let mut any = false;
        loop {
            let chunk = match self.inner.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if chunk.is_empty() {
                if !any {
                    return Ok(None);
                }
                break;
            }
            any = true;
            let (part, used, done) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (&chunk[..i], i + 1, true),
                None => (chunk, chunk.len(), false),
            };
            len += part.len() as u64;
            // One byte of slack over the cap for a trailing `\r`.
            if len > self.max as u64 + 1 {
                too_long = true;
            }
            // Past the cap only the head is kept.
            let cap = if too_long { HEAD_KEEP } else { usize::MAX };
            let room = cap.saturating_sub(buf.len());
            buf.extend_from_slice(&part[..room.min(part.len())]);
            if too_long {
                buf.truncate(HEAD_KEEP);
            }
            self.inner.consume(used);
            if done {
                break;
            }
        }
        if !too_long && buf.last() == Some(&b'\r') {
            buf.pop();
            len -= 1;
        }
        if too_long || buf.len() > self.max {
            buf.truncate(HEAD_KEEP);
            return Ok(Some(RawLine::TooLong { len, head: buf }));
        }
        Ok(Some(RawLine::Bytes(buf)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[u8], max: usize) -> Vec<RawLine> {
        // A tiny BufReader capacity exercises lines spanning many buffer fills.
        let mut r = LineReader::new(io::BufReader::with_capacity(7, input), max);
        let mut v = Vec::new();
        while let Some(l) = r.next_line().unwrap() {
            v.push(l);
        }
        v
    }

    #[test]
    fn splits_lines_and_keeps_a_final_unterminated_line() {
        let v = all(b"ab\r\n\ncdefghijkl\nxyz", 100);
        assert_eq!(
            v,
            vec![
                RawLine::Bytes(b"ab".to_vec()),
                RawLine::Bytes(vec![]),
                RawLine::Bytes(b"cdefghijkl".to_vec()),
                RawLine::Bytes(b"xyz".to_vec())
            ]
        );
        assert!(all(b"", 10).is_empty());
        assert_eq!(all(b"a\n", 10).len(), 1);
    }

    #[test]
    fn over_long_lines_are_skipped_with_their_head() {
        let mut input = vec![b'x'; 10_000];
        input.extend_from_slice(b"\nok\n");
        let v = all(&input, 100);
        assert_eq!(v.len(), 2);
        match &v[0] {
            RawLine::TooLong { len, head } => {
                assert_eq!(*len, 10_000);
                assert_eq!(head.len(), HEAD_KEEP);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(v[1], RawLine::Bytes(b"ok".to_vec()));
        // Exactly at the cap is fine; one more byte is not.
        assert_eq!(all(b"abcd\n", 4), vec![RawLine::Bytes(b"abcd".to_vec())]);
        assert!(matches!(all(b"abcde\n", 4)[0], RawLine::TooLong { len: 5, .. }));
        assert_eq!(all(b"abcd\r\n", 4), vec![RawLine::Bytes(b"abcd".to_vec())]);
    }
}
