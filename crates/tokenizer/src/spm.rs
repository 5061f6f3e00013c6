//! SentencePiece-style bigram merging (the algorithm of llama.cpp's `llm_tokenizer_spm`).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

/// No neighbour.
const NONE: usize = usize::MAX;

/// A run of text in the symbol chain.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    /// Byte offset into the fragment.
    start: usize,
    /// Length in bytes; 0 once merged into its left neighbour.
    len: usize,
    /// Previous live symbol, or [`NONE`].
    prev: usize,
    /// Next live symbol, or [`NONE`].
    next: usize,
}

/// A candidate merge of two adjacent symbols.
#[derive(Clone, Copy, Debug)]
struct Bigram {
    /// Score of the merged token.
    score: f32,
    /// Left symbol.
    left: usize,
    /// Right symbol.
    right: usize,
    /// Byte length of the merged text when the candidate was made (detects stale entries).
    len: usize,
}

impl Ord for Bigram {
    /// Higher score first; on ties the leftmost pair first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

/// Queues the merge of `left` and `right` if their concatenation is a token.
fn try_add_bigram(vocab: &Vocab, text: &str, symbols: &[Symbol], left: usize, right: usize, queue: &mut BinaryHeap<Bigram>) {
    if left == NONE || right == NONE {
        return;
    }
    let (l, r) = (symbols[left], symbols[right]);
    let merged = &text[l.start..r.start + r.len];
    if let Some(id) = vocab.id_of(merged) {
        queue.push(Bigram { score: vocab.score(id), left, right, len: merged.len() });
    }
}

/// Tokenizes one fragment (spaces already replaced by `▁`), appending ids to `out`.
///
/// Characters that end up in no token are emitted through `byte_ids` (byte fallback); bytes that
/// map to `None` there are dropped.
pub(crate) fn encode_fragment(vocab: &Vocab, byte_ids: &[Option<u32>; 256], text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = text
        .char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1).unwrap_or(NONE), next: i + 1 })
        .collect();
    let Some(last) = symbols.last_mut() else {
        return;
    };
    last.next = NONE;

    let mut queue = BinaryHeap::with_capacity(symbols.len());
    for i in 1..symbols.len() {
        try_add_bigram(vocab, text, &symbols, i - 1, i, &mut queue);
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if r.next != NONE {
            symbols[r.next].prev = b.left;
        }
        try_add_bigram(vocab, text, &symbols, l.prev, b.left, &mut queue);
        try_add_bigram(vocab, text, &symbols, b.left, r.next, &mut queue);
    }

    // Symbol 0 is never merged away, so the chain starts there. A merged symbol is always a
    // token; only single characters can be missing from the vocabulary.
    let mut i = 0;
    while i != NONE {
        let s = symbols[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id_of(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(|b| byte_ids[usize::from(b)])),
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::TokenKind;

    fn vocab(entries: &[(&str, f32)]) -> Vocab {
        let texts: Vec<&str> = entries.iter().map(|&(t, _)| t).collect();
        Vocab::new(&texts, entries.iter().map(|&(_, s)| s).collect(), vec![TokenKind::Normal; entries.len()]).expect("small vocabulary")
    }

    fn encode(v: &Vocab, text: &str) -> Vec<u32> {
        let mut bytes = [None; 256];
        for b in 0..=255u8 {
            bytes[usize::from(b)] = Some(1000 + u32::from(b));
        }
        let mut out = Vec::new();
        encode_fragment(v, &bytes, text, &mut out);
        out
    }

    #[test]
    fn highest_score_merges_first() {
        // "ab" (-1) beats "bc" (-2): a b c -> ab c -> abc is not a token -> [ab, c].
        let v = vocab(&[("a", 0.0), ("b", 0.0), ("c", 0.0), ("ab", -1.0), ("bc", -2.0)]);
        assert_eq!(encode(&v, "abc"), vec![3, 2]);
        // With the scores swapped, "bc" merges first.
        let v = vocab(&[("a", 0.0), ("b", 0.0), ("c", 0.0), ("ab", -2.0), ("bc", -1.0)]);
        assert_eq!(encode(&v, "abc"), vec![0, 4]);
    }

    #[test]
    fn ties_merge_leftmost_first() {
        let v = vocab(&[("a", 0.0), ("aa", -1.0)]);
        assert_eq!(encode(&v, "aaa"), vec![1, 0]);
        assert_eq!(encode(&v, "aaaaa"), vec![1, 1, 0]);
    }

    #[test]
    fn merges_chain_into_longer_tokens() {
        let v = vocab(&[("a", 0.0), ("b", 0.0), ("ab", -1.0), ("abab", -3.0), ("ba", -2.0)]);
        // a b a b -> ab a b -> ab ab -> abab ("ba" never wins over "ab").
        assert_eq!(encode(&v, "abab"), vec![3]);
    }

    #[test]
    fn byte_fallback_for_unknown_characters() {
        let v = vocab(&[("a", 0.0)]);
        // 'é' is 0xC3 0xA9 and not in the vocabulary.
        assert_eq!(encode(&v, "aéa"), vec![0, 1000 + 0xC3, 1000 + 0xA9, 0]);
        assert_eq!(encode(&v, ""), Vec::<u32>::new());
    }

    #[test]
    fn missing_byte_tokens_are_dropped() {
        let v = vocab(&[("a", 0.0)]);
        let mut out = Vec::new();
        encode_fragment(&v, &[None; 256], "xa", &mut out);
        assert_eq!(out, vec![0]);
    }

    #[test]
    fn nan_scores_do_not_panic() {
        let v = vocab(&[("a", 0.0), ("aa", f32::NAN), ("aaa", -1.0)]);
        assert!(!encode(&v, "aaaa").is_empty());
    }
}
