//! Incremental detokenization that only ever yields complete UTF-8 characters.

use crate::Tokenizer;

/// An incremental detokenizer: feed ids one at a time, get text as soon as it is complete.
///
/// The concatenation of everything [`push`](StreamDecoder::push) and
/// [`finish`](StreamDecoder::finish) return equals [`Tokenizer::decode`] of the same ids.
#[derive(Clone, Debug)]
pub struct StreamDecoder {
    /// Drop control, unknown and unused tokens.
    skip_special: bool,
    /// No token has produced output yet (see `Tokenizer::append_piece`).
    at_start: bool,
    /// Bytes received but not yet returned.
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder at the start of a sequence; `skip_special` as in [`Tokenizer::decode`].
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder { skip_special, at_start: true, pending: Vec::new() }
    }

    /// Adds token `id` and returns the newly completed text; bytes of an incomplete character are
    /// held back, invalid bytes come out as U+FFFD.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        tok.append_piece(id, self.skip_special, &mut self.at_start, &mut self.pending);
        let mut text = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    text.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is valid UTF-8 by construction; the lossy conversion never replaces here.
                    text.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(n) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let consumed = self.pending.len() - rest.len();
        self.pending.drain(..consumed);
        text
    }

    /// Returns whatever is still held back (an incomplete character becomes U+FFFD) and resets the
    /// decoder for a new sequence.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        self.at_start = true;
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::tiny;

    fn stream(t: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
        let mut d = StreamDecoder::new(skip);
        let mut out: Vec<String> = ids.iter().map(|&id| d.push(t, id)).collect();
        out.push(d.finish());
        out
    }

    fn byte_ids(t: &Tokenizer, s: &[u8]) -> Vec<u32> {
        s.iter().map(|b| t.token_id(&format!("<0x{b:02X}>")).expect("byte token")).collect()
    }

    #[test]
    fn holds_back_incomplete_characters() {
        let t = tiny(false);
        let ids = byte_ids(&t, "a€🙂".as_bytes());
        let parts = stream(&t, &ids, true);
        assert_eq!(parts, vec!["a", "", "", "€", "", "", "", "🙂", ""]);
        assert_eq!(parts.concat(), t.decode(&ids, true));
    }

    #[test]
    fn invalid_and_truncated_bytes_match_lossy_decode() {
        let t = tiny(false);
        for bytes in [&b"\xE2\x82"[..], b"\xFFa\xE2\x82\xACb", b"\xE2\x82a", b"\xF0\x9F\x99", b"\xC3\xC3\xA9", b"\xED\xA0\x80x"] {
            let ids = byte_ids(&t, bytes);
            let parts = stream(&t, &ids, false);
            assert_eq!(parts.concat(), t.decode(&ids, false), "bytes {bytes:?}");
        }
    }

    #[test]
    fn specials_and_space_prefix() {
        let t = tiny(true);
        let ids = t.encode("hello<end_of_turn>");
        assert_eq!(stream(&t, &ids, true).concat(), "hello");
        assert_eq!(stream(&t, &ids, false).concat(), t.decode(&ids, false));
        let mut d = StreamDecoder::new(true);
        d.push(&t, ids[1]);
        d.finish();
        assert_eq!(d.push(&t, ids[1]), "hello", "finish resets the leading-space state");
    }
}
