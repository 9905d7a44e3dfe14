//! A row's text as its tokens come: what can be handed back now, and where
//! a stop string ends it.

/// The text of a row's generated tokens, decoded whole each time (a token
/// alone may be part of a character, and byte-level vocabularies only
/// spell text in context), and how much of it was handed back.
#[derive(Debug, Default)]
pub(crate) struct RowText {
    stop: Vec<String>,
    /// Bytes of the text already handed back.
    sent: usize,
}

/// What a new token changes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Settled {
    /// Text to hand back now.
    pub text: String,
    /// Whether a stop string was met (the text ends before it).
    pub stopped: bool,
}

impl RowText {
    pub(crate) fn new(stop: Vec<String>) -> RowText {
        let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
        RowText { stop, sent: 0 }
    }

    /// Given the whole text decoded so far, what is settled: up to a stop
    /// string (and then the row stops), else all but what may still
    /// become one, or an incomplete character (decoders spell an
    /// incomplete UTF-8 sequence as U+FFFD). With `last`, everything.
    pub(crate) fn advance(&mut self, whole: &str, last: bool) -> Settled {
        // A stop string can start in text already sent, if held back.
        let search_from = floor_char(whole, self.sent.saturating_sub(self.longest_stop()));
        let found = self
            .stop
            .iter()
            .filter_map(|s| {
                whole[search_from..]
                    .find(s.as_str())
                    .map(|at| search_from + at)
            })
            .min();
        let (end, stopped) = match found {
            Some(at) => (at, true),
            None if last => (whole.len(), false),
            None => {
                let mut end = whole.len() - self.held_back(whole);
                if whole[..end].ends_with('\u{FFFD}') {
                    end -= '\u{FFFD}'.len_utf8();
                }
                (end, false)
            }
        };
        let end = floor_char(whole, end.max(self.sent));
        let text = whole.get(self.sent..end).unwrap_or_default().to_owned();
        self.sent = end;
        Settled { text, stopped }
    }

    fn longest_stop(&self) -> usize {
        self.stop.iter().map(String::len).max().unwrap_or(0)
    }

    /// Bytes at the end of `whole` that begin some stop string.
    fn held_back(&self, whole: &str) -> usize {
        let mut held = 0;
        for s in &self.stop {
            for n in (1..s.len()).rev() {
                if n <= held {
                    break;
                }
                if s.is_char_boundary(n) && whole.ends_with(&s[..n]) {
                    held = n;
                    break;
                }
            }
        }
        held
    }
}

fn floor_char(s: &str, mut at: usize) -> usize {
    at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stop: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut row = RowText::new(stop.iter().map(|s| s.to_string()).collect());
        let mut whole = String::new();
        let mut out = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            whole.push_str(piece);
            let s = row.advance(&whole, i + 1 == pieces.len());
            out.push(s.text);
            if s.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn text_is_handed_back_as_it_settles() {
        assert_eq!(
            run(&[], &["Hel", "lo"]),
            (vec!["Hel".into(), "lo".into()], false)
        );
        // An incomplete character (decoded as U+FFFD) waits for the rest;
        // the whole text is decoded again each time.
        let mut row = RowText::new(Vec::new());
        assert_eq!(row.advance("a\u{FFFD}", false).text, "a");
        assert_eq!(row.advance("a\u{e9}", false).text, "\u{e9}");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_even_across_tokens() {
        let (out, stopped) = run(&["END"], &["one E", "N", "D two"]);
        assert!(stopped);
        assert_eq!(out.concat(), "one ");
        // What looked like a stop string's start is handed back once it
        // is not one.
        let (out, stopped) = run(&["END"], &["one E", "X", " two"]);
        assert!(!stopped);
        assert_eq!(out, vec!["one ", "EX", " two"]);
        // The first of several.
        let (out, _) = run(&["b", "a"], &["xxab"]);
        assert_eq!(out.concat(), "xx");
    }
}
