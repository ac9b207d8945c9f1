//! Stop strings over the decoded output: find the earliest occurrence, and while streaming hold
//! back a suffix that could still become one.

pub struct StopStrings {
    stops: Vec<String>,
    max_len: usize,
}

impl StopStrings {
    /// Empty strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopStrings { stops, max_len }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Earliest byte offset of a stop string in `text`, looking only at matches that end past
    /// `old_len` (text before it was already searched). Returns (offset, stop string).
    pub fn find(&self, text: &str, old_len: usize) -> Option<(usize, &str)> {
        if self.stops.is_empty() {
            return None;
        }
        let mut from = old_len.saturating_sub(self.max_len.saturating_sub(1)).min(text.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hay = &text[from..];
        self.stops.iter().filter_map(|s| hay.find(s.as_str()).map(|i| (from + i, s.as_str()))).min_by_key(|&(i, _)| i)
    }

    /// Length of the longest suffix of `text` that is a proper prefix of a stop string: that
    /// many trailing bytes must not be streamed yet.
    pub fn holdback(&self, text: &str) -> usize {
        let n = text.len();
        for k in (1..self.max_len.min(n + 1)).rev() {
            if !text.is_char_boundary(n - k) {
                continue;
            }
            let suffix = &text[n - k..];
            if self.stops.iter().any(|s| s.len() > k && s.starts_with(suffix)) {
                return k;
            }
        }
        0
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
pub fn partial_overlap(text: &str, tag: &str) -> usize {
    let n = text.len();
    for k in (1..tag.len().min(n + 1)).rev() {
        if text.is_char_boundary(n - k) && tag.starts_with(&text[n - k..]) {
            return k;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_earliest_and_respects_old_len() {
        let s = StopStrings::new(&["END".into(), "##".into(), String::new()]);
        assert_eq!(s.find("abc##xEND", 0), Some((3, "##")));
        // A match spanning the old/new boundary is found.
        assert_eq!(s.find("abcEN", 0), None);
        assert_eq!(s.find("abcEND", 5), Some((3, "END")));
        assert_eq!(StopStrings::new(&[]).find("x", 0), None);
    }

    #[test]
    fn holdback_covers_partial_stops_and_utf8() {
        let s = StopStrings::new(&["</answer>".into(), "é!".into()]);
        assert_eq!(s.holdback("text </ans"), 5);
        assert_eq!(s.holdback("text <"), 1);
        assert_eq!(s.holdback("text"), 0);
        assert_eq!(s.holdback("café"), 2);
        assert_eq!(partial_overlap("abc<tool_", "<tool_call>"), 6);
        assert_eq!(partial_overlap("abc", "<tool_call>"), 0);
    }
}
