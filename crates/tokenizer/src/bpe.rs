//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): GPT-2's byte-to-unicode alphabet, merges by
//! rank, and the pre-tokenizer regex that `tokenizer.ggml.pre` names.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use fancy_regex::Regex;

use crate::vocab::Vocab;
use crate::TokenizerError;

/// GPT-2's pre-tokenizer regex.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's pre-tokenizer regex (digits in groups of at most three).
const LLAMA3_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer regex (single digits).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` names (as llama.cpp groups them), their regex, and whether a word that is a
/// token is emitted without merging (llama.cpp's `ignore_merges`). `default` (also what an absent
/// key means) is GPT-2's regex; llama.cpp's own fallback for it is a different chain of regexes.
const PRE_TOKENIZERS: &[(&str, &str, bool)] = &[
    ("default", GPT2_REGEX, false),
    ("gpt-2", GPT2_REGEX, false),
    ("llama-bpe", LLAMA3_REGEX, true),
    ("llama3", LLAMA3_REGEX, true),
    ("llama-v3", LLAMA3_REGEX, true),
    ("qwen2", QWEN2_REGEX, false),
    ("deepseek-r1-qwen", QWEN2_REGEX, false),
];

/// The `tokenizer.ggml.pre` names kiln implements.
pub(crate) fn pre_tokenizer_names() -> Vec<&'static str> {
    PRE_TOKENIZERS.iter().map(|&(name, _, _)| name).collect()
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the others for
/// U+0100 onwards in byte order.
fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        // Codes are below 0x200, all valid scalar values.
        table[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// The byte a character of the byte-level alphabet stands for.
fn char_to_byte(c: char) -> Option<u8> {
    match u32::from(c) {
        code @ (0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF) => u8::try_from(code).ok(),
        // The 68 other bytes, in order (0x00..=0x20, 0x7F..=0xA0, 0xAD), map to U+0100..=U+0143.
        code @ 0x100..=0x120 => u8::try_from(code - 0x100).ok(),
        code @ 0x121..=0x142 => u8::try_from(code - 0x121 + 0x7F).ok(),
        0x143 => Some(0xAD),
        _ => None,
    }
}

/// Appends the bytes that the byte-level token text `text` stands for; characters outside the
/// byte-level alphabet are kept as their UTF-8.
pub(crate) fn decode_token_text(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}

/// A byte-level BPE model: merge ranks over token ids and the pre-tokenizer.
#[derive(Debug)]
pub(crate) struct Bpe {
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// The byte-level character of each byte.
    byte_chars: [char; 256],
    /// The token of each single byte (its byte-level character), if the vocabulary has one.
    byte_tokens: [Option<u32>; 256],
    /// Splits text into words before the merges.
    pre: Regex,
    /// Emit a whole word directly when it is a token (llama.cpp's `ignore_merges`, Llama 3).
    ignore_merges: bool,
}

/// A candidate merge of two adjacent symbols.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Candidate {
    /// Merge rank (lower merges first).
    rank: u32,
    /// Left symbol index.
    left: usize,
    /// Left token id when queued.
    left_id: u32,
    /// Right token id when queued.
    right_id: u32,
}

impl Ord for Candidate {
    /// Lowest rank first; on ties the leftmost pair first (max-heap order reversed).
    fn cmp(&self, other: &Self) -> Ordering {
        other.rank.cmp(&self.rank).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// No neighbour.
const NONE: usize = usize::MAX;

impl Bpe {
    /// Builds the model from `merges` ("left right" token texts, in rank order) and the
    /// pre-tokenizer named `pre`.
    pub(crate) fn new<S: AsRef<str>>(vocab: &Vocab, merges: &[S], pre: &str) -> Result<Bpe, TokenizerError> {
        let (pattern, ignore_merges) = PRE_TOKENIZERS
            .iter()
            .find(|&&(name, _, _)| name == pre)
            .map(|&(_, p, ignore)| (p, ignore))
            .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre.to_owned()))?;
        let regex = Regex::new(pattern).map_err(|e| TokenizerError::PreTokenizerRegex { name: pre.to_owned(), message: e.to_string() })?;

        let mut ranks = HashMap::with_capacity(merges.len());
        let mut merged = String::new();
        for (rank, m) in (0u32..).zip(merges) {
            let m = m.as_ref();
            let bad = || TokenizerError::BadMerge { rank, text: m.to_owned() };
            // As llama.cpp: the separator is the first space after the first character.
            let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i).ok_or_else(bad)?;
            let (left, right) = (&m[..split], &m[split + 1..]);
            let (Some(l), Some(r)) = (vocab.id_of(left), vocab.id_of(right)) else {
                return Err(bad());
            };
            merged.clear();
            merged.push_str(left);
            merged.push_str(right);
            // A merge whose result is not a token can never produce an id: skip it.
            if let Some(id) = vocab.id_of(&merged) {
                ranks.entry((l, r)).or_insert((rank, id));
            }
        }

        let table = byte_to_char();
        let mut byte_tokens = [None; 256];
        for (slot, c) in byte_tokens.iter_mut().zip(table) {
            *slot = vocab.id_of(c.encode_utf8(&mut [0; 4]));
        }
        Ok(Bpe { merges: ranks, byte_chars: table, byte_tokens, pre: regex, ignore_merges })
    }

    /// Tokenizes one fragment of text (no special tokens in it), appending ids to `out`. Bytes
    /// without a token become `unk` when there is one and are dropped otherwise.
    pub(crate) fn encode_fragment(&self, vocab: &Vocab, text: &str, unk: Option<u32>, out: &mut Vec<u32>) {
        let mut pos = 0;
        for m in self.pre.find_iter(text) {
            let Ok(m) = m else {
                // The regex engine gave up (backtracking limit): the rest is one word.
                break;
            };
            if m.start() > pos {
                self.encode_word(vocab, &text[pos..m.start()], unk, out);
            }
            self.encode_word(vocab, m.as_str(), unk, out);
            pos = m.end();
        }
        if pos < text.len() {
            self.encode_word(vocab, &text[pos..], unk, out);
        }
    }

    /// Applies the merges to one pre-tokenized word.
    fn encode_word(&self, vocab: &Vocab, word: &str, unk: Option<u32>, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges {
            let mapped: String = word.bytes().map(|b| self.byte_chars[usize::from(b)]).collect();
            if let Some(id) = vocab.id_of(&mapped) {
                out.push(id);
                return;
            }
        }
        let mut ids: Vec<u32> = Vec::with_capacity(word.len());
        for b in word.bytes() {
            match self.byte_tokens[usize::from(b)].or(unk) {
                Some(id) => ids.push(id),
                None => {
                    // No token for this byte and no unknown token: merge what is around it.
                    self.merge(&mut ids, out);
                }
            }
        }
        self.merge(&mut ids, out);
    }

    /// Merges the symbols `ids` by rank and appends the result to `out`; `ids` is left empty.
    fn merge(&self, ids: &mut Vec<u32>, out: &mut Vec<u32>) {
        let n = ids.len();
        if n == 0 {
            return;
        }
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.checked_sub(1).unwrap_or(NONE)).collect();
        let mut alive = vec![true; n];
        let mut queue = BinaryHeap::new();
        let push = |queue: &mut BinaryHeap<Candidate>, ids: &[u32], left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            if let Some(&(rank, _)) = self.merges.get(&(ids[left], ids[right])) {
                queue.push(Candidate { rank, left, left_id: ids[left], right_id: ids[right] });
            }
        };
        for i in 1..n {
            push(&mut queue, ids, i - 1, i);
        }
        while let Some(c) = queue.pop() {
            let right = next[c.left];
            if !alive[c.left] || right == NONE || ids[c.left] != c.left_id || ids[right] != c.right_id {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&(c.left_id, c.right_id)) else {
                continue;
            };
            ids[c.left] = merged;
            alive[right] = false;
            next[c.left] = next[right];
            if next[right] != NONE {
                prev[next[right]] = c.left;
            }
            push(&mut queue, ids, prev[c.left], c.left);
            push(&mut queue, ids, c.left, next[c.left]);
        }
        let mut i = 0;
        while i != NONE {
            out.push(ids[i]);
            i = next[i];
        }
        ids.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::TokenKind;

    #[test]
    fn byte_alphabet_round_trips() {
        let table = byte_to_char();
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(table[usize::from(b)]), Some(b), "byte {b}");
        }
        assert_eq!(table[usize::from(b' ')], 'Ġ');
        assert_eq!(table[usize::from(b'\n')], 'Ċ');
        assert_eq!(table[usize::from(b'a')], 'a');
        assert_eq!(char_to_byte('€'), None);
        let mut out = Vec::new();
        decode_token_text("ĠhiĊ€", &mut out);
        assert_eq!(out, " hi\n€".as_bytes());
    }

    /// A vocabulary of all 256 byte characters plus `extra` tokens, and the model for `merges`.
    fn model(extra: &[&str], merges: &[&str], pre: &str) -> (Vocab, Bpe) {
        let mut texts: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
        texts.extend(extra.iter().map(|s| s.to_string()));
        let n = texts.len();
        let vocab = Vocab::new(&texts, vec![0.0; n], vec![TokenKind::Normal; n]).expect("vocab");
        let bpe = Bpe::new(&vocab, merges, pre).expect("model");
        (vocab, bpe)
    }

    fn encode(vocab: &Vocab, bpe: &Bpe, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        bpe.encode_fragment(vocab, text, None, &mut out);
        out.iter().map(|&id| vocab.piece(id).expect("id").to_owned()).collect()
    }

    #[test]
    fn lowest_rank_merges_first_and_ties_go_left() {
        let (v, b) = model(&["ab", "bc", "abc", "aa"], &["b c", "a b", "a bc", "a a"], "default");
        // "b c" has the lower rank, then "a bc".
        assert_eq!(encode(&v, &b, "abc"), ["abc"]);
        let (v, b) = model(&["ab", "bc"], &["a b", "b c"], "default");
        assert_eq!(encode(&v, &b, "abc"), ["ab", "c"]);
        let (v, b) = model(&["aa"], &["a a"], "default");
        assert_eq!(encode(&v, &b, "aaa"), ["aa", "a"]);
        assert_eq!(encode(&v, &b, "aaaaa"), ["aa", "aa", "a"]);
    }

    #[test]
    fn pre_tokenizer_splits_words_before_merging() {
        // "a b" would merge across the space if words were not split first.
        let (v, b) = model(&["aĠ", "Ġb"], &["a Ġ", "Ġ b"], "default");
        assert_eq!(encode(&v, &b, "a b"), ["a", "Ġb"]);
        // Trailing whitespace run before a word keeps its last space for the word.
        assert_eq!(encode(&v, &b, "a   b"), ["a", "Ġ", "Ġ", "Ġb"]);
    }

    #[test]
    fn llama_bpe_digits_and_whole_word_tokens() {
        let (v, b) = model(&["12", "123", "bc", "abc"], &["1 2", "12 3", "b c"], "llama-bpe");
        assert_eq!(encode(&v, &b, "1234"), ["123", "4"]);
        // "abc" is a token, emitted whole; the merges alone give "a", "bc".
        assert_eq!(encode(&v, &b, "abc"), ["abc"]);
        let (v, b) = model(&["12", "123", "bc", "abc"], &["1 2", "12 3", "b c"], "qwen2");
        assert_eq!(encode(&v, &b, "1234"), ["1", "2", "3", "4"]);
        assert_eq!(encode(&v, &b, "abc"), ["a", "bc"]);
    }

    #[test]
    fn bad_merges_and_unknown_pre_tokenizers_are_errors() {
        let texts = ["a", "b", "ab"];
        let vocab = Vocab::new(&texts, vec![0.0; 3], vec![TokenKind::Normal; 3]).expect("vocab");
        assert!(matches!(Bpe::new(&vocab, &["ab"], "default"), Err(TokenizerError::BadMerge { rank: 0, .. })));
        assert!(matches!(Bpe::new(&vocab, &["a b", "a c"], "default"), Err(TokenizerError::BadMerge { rank: 1, .. })));
        let err = Bpe::new(&vocab, &["a b"], "starcoder").expect_err("unknown pre");
        assert!(err.to_string().contains("starcoder"), "{err}");
        // A merge whose result is not a token is skipped.
        let texts = ["a", "b"];
        let vocab = Vocab::new(&texts, vec![0.0; 2], vec![TokenKind::Normal; 2]).expect("vocab");
        assert!(Bpe::new(&vocab, &["a b"], "qwen2").is_ok());
    }

    #[test]
    fn bytes_without_tokens_use_unk_or_are_dropped() {
        let texts = ["a", "b", "ab", "<unk>"];
        let vocab = Vocab::new(&texts, vec![0.0; 4], vec![TokenKind::Normal; 4]).expect("vocab");
        let bpe = Bpe::new(&vocab, &["a b"], "default").expect("model");
        let mut out = Vec::new();
        bpe.encode_fragment(&vocab, "abcab", Some(3), &mut out);
        assert_eq!(out, vec![2, 3, 2]);
        out.clear();
        bpe.encode_fragment(&vocab, "acb", None, &mut out);
        assert_eq!(out, vec![0, 1]);
    }
}
