//! The [`Tokenizer`]: encoding (special-token split + SentencePiece merges) and decoding.

use crate::bpe::{decode_token_text, Bpe};
use crate::spm::encode_fragment;
use crate::vocab::{Fragment, TokenKind, Vocab};
use crate::TokenizerError;

/// The SentencePiece meta-symbol that stands for a space (U+2581).
const SPACE_SYMBOL: &str = "\u{2581}";

/// Special ids and flags, as read from the metadata (ids already validated against the vocabulary).
#[derive(Clone, Debug, Default)]
pub(crate) struct SpecialConfig {
    /// Beginning-of-sequence token.
    pub(crate) bos: Option<u32>,
    /// End-of-sequence token.
    pub(crate) eos: Option<u32>,
    /// Unknown token.
    pub(crate) unk: Option<u32>,
    /// Padding token.
    pub(crate) pad: Option<u32>,
    /// End-of-turn token.
    pub(crate) eot: Option<u32>,
    /// End-of-message token.
    pub(crate) eom: Option<u32>,
    /// Prepend BOS when encoding with special tokens.
    pub(crate) add_bos: bool,
    /// Append EOS when encoding with special tokens.
    pub(crate) add_eos: bool,
    /// Prepend a space to text that starts the input or follows a special token.
    pub(crate) add_space_prefix: bool,
}

/// A tokenizer built from GGUF metadata: SentencePiece-style (llama.cpp's SPM algorithm) or
/// byte-level BPE.
#[derive(Debug)]
pub struct Tokenizer {
    /// Token texts, scores and kinds.
    vocab: Vocab,
    /// The byte-level BPE model; `None` for SentencePiece.
    bpe: Option<Bpe>,
    /// Token to emit for each byte that no merged piece covers.
    byte_ids: [Option<u32>; 256],
    /// Special ids and flags.
    config: SpecialConfig,
    /// Tokens that end generation.
    eog: Vec<u32>,
}

impl Tokenizer {
    /// Builds a tokenizer from parallel vectors of token texts, scores and GGUF token-type codes.
    pub(crate) fn from_parts<S: AsRef<str>>(
        pieces: &[S],
        scores: Vec<f32>,
        type_codes: &[i32],
        config: SpecialConfig,
    ) -> Result<Tokenizer, TokenizerError> {
        let n = pieces.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if scores.len() != n {
            return Err(TokenizerError::LengthMismatch { what: "scores", got: scores.len(), expected: n });
        }
        if type_codes.len() != n {
            return Err(TokenizerError::LengthMismatch { what: "token types", got: type_codes.len(), expected: n });
        }
        for (name, id) in
            [("bos", config.bos), ("eos", config.eos), ("unk", config.unk), ("pad", config.pad), ("eot", config.eot), ("eom", config.eom)]
        {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::SpecialIdOutOfRange { name, id, n_vocab: n });
            }
        }
        let kinds = (0u32..)
            .zip(type_codes.iter().zip(pieces))
            .map(|(id, (&code, text))| TokenKind::from_code(id, code, text.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let vocab = Vocab::new(pieces, scores, kinds).ok_or(TokenizerError::VocabularyTooLarge(n))?;

        // Byte fallback: the <0xXX> token, else a token that is the byte itself (ASCII), else unk.
        let mut byte_ids = [None; 256];
        for b in 0..=255u8 {
            byte_ids[usize::from(b)] = b.is_ascii().then(|| vocab.id_of(char::from(b).encode_utf8(&mut [0; 4]))).flatten().or(config.unk);
        }
        for id in 0..n as u32 {
            if let Some(TokenKind::Byte(b)) = vocab.kind(id) {
                byte_ids[usize::from(b)] = Some(id);
            }
        }

        let mut eog = Vec::new();
        for id in [config.eos, config.eot, config.eom, vocab.id_of("<end_of_turn>")].into_iter().flatten() {
            if !eog.contains(&id) {
                eog.push(id);
            }
        }
        Ok(Tokenizer { vocab, bpe: None, byte_ids, config, eog })
    }

    /// Makes this a byte-level BPE tokenizer with `merges` ("left right", in rank order) and the
    /// pre-tokenizer named `pre`. No space prefix is added.
    pub(crate) fn into_byte_level<S: AsRef<str>>(mut self, merges: &[S], pre: &str) -> Result<Tokenizer, TokenizerError> {
        self.bpe = Some(Bpe::new(&self.vocab, merges, pre)?);
        self.config.add_space_prefix = false;
        Ok(self)
    }

    /// Encodes `text`, adding BOS/EOS as the model's metadata says (`add_bos_token`, `add_eos_token`).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, true)
    }

    /// Encodes `text`; with `add_special` false no BOS/EOS is added. Special-token text is always parsed.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.config.add_bos {
            out.extend(self.config.bos);
        }
        let mut buf = String::new();
        let mut after_special = true;
        for fragment in self.vocab.split_specials(text) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    if let Some(bpe) = &self.bpe {
                        bpe.encode_fragment(&self.vocab, t, self.config.unk, &mut out);
                        continue;
                    }
                    buf.clear();
                    if self.config.add_space_prefix && after_special {
                        buf.push_str(SPACE_SYMBOL);
                    }
                    for (i, part) in t.split(' ').enumerate() {
                        if i > 0 {
                            buf.push_str(SPACE_SYMBOL);
                        }
                        buf.push_str(part);
                    }
                    encode_fragment(&self.vocab, &self.byte_ids, &buf, &mut out);
                    after_special = false;
                }
            }
        }
        if add_special && self.config.add_eos {
            out.extend(self.config.eos);
        }
        out
    }

    /// Decodes `ids` to text: `▁` becomes a space (byte-level BPE: each character its byte), byte tokens become bytes, invalid UTF-8 is replaced
    /// by U+FFFD. With `skip_special`, control, unknown and unused tokens are dropped; otherwise their
    /// text is kept. Ids outside the vocabulary are ignored.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut at_start = true;
        for &id in ids {
            self.append_piece(id, skip_special, &mut at_start, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Appends the bytes that token `id` decodes to. `at_start` is true until the first token that
    /// is not dropped; with `add_space_prefix`, that token loses one leading space.
    pub(crate) fn append_piece(&self, id: u32, skip_special: bool, at_start: &mut bool, out: &mut Vec<u8>) {
        let (Some(kind), Some(text)) = (self.vocab.kind(id), self.vocab.piece(id)) else {
            return;
        };
        if skip_special && kind.is_special() {
            return;
        }
        let strip = std::mem::replace(at_start, false) && self.config.add_space_prefix;
        match kind {
            TokenKind::Normal if self.bpe.is_some() => decode_token_text(text, out),
            TokenKind::Normal => {
                let mut parts = text.split(SPACE_SYMBOL).enumerate();
                if let Some((_, first)) = parts.next() {
                    out.extend_from_slice(first.as_bytes());
                }
                for (i, part) in parts {
                    if !(i == 1 && strip && text.starts_with(SPACE_SYMBOL)) {
                        out.push(b' ');
                    }
                    out.extend_from_slice(part.as_bytes());
                }
            }
            TokenKind::Byte(b) => out.push(b),
            TokenKind::Unknown | TokenKind::Control | TokenKind::UserDefined | TokenKind::Unused => {
                out.extend_from_slice(text.as_bytes());
            }
        }
    }

    /// Appends the bytes token `id` adds to a text after its first token (control, unknown and
    /// unused tokens add none).
    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        self.append_piece(id, true, &mut false, out);
    }

    /// The text of token `id` as stored in the vocabulary (`▁` for spaces, `<0xXX>` for bytes).
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.vocab.piece(id)
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id_of(text)
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The beginning-of-sequence token.
    pub fn bos_id(&self) -> Option<u32> {
        self.config.bos
    }

    /// The end-of-sequence token.
    pub fn eos_id(&self) -> Option<u32> {
        self.config.eos
    }

    /// The unknown token.
    pub fn unk_id(&self) -> Option<u32> {
        self.config.unk
    }

    /// The padding token.
    pub fn pad_id(&self) -> Option<u32> {
        self.config.pad
    }

    /// Whether `id` ends generation (eos, eot/eom when set, `<end_of_turn>` when in the vocabulary).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The tokens that end generation.
    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether `id` is a control token (`<bos>`, `<eos>`, `<pad>`, `<start_of_turn>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.kind(id) == Some(TokenKind::Control)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tiny SentencePiece vocabulary: control, user-defined, byte and scored normal tokens.
    pub(crate) fn tiny(add_space_prefix: bool) -> Tokenizer {
        let mut entries: Vec<(String, f32, i32)> = vec![
            ("<pad>".into(), 0.0, 3),
            ("<eos>".into(), 0.0, 3),
            ("<bos>".into(), 0.0, 3),
            ("<unk>".into(), 0.0, 2),
            ("<start_of_turn>".into(), 0.0, 3),
            ("<end_of_turn>".into(), 0.0, 3),
            ("\n".into(), 0.0, 4),
            ("\n\n".into(), 0.0, 4),
            ("  ".into(), 0.0, 4),
        ];
        for b in 0..=255u8 {
            entries.push((format!("<0x{b:02X}>"), 0.0, 6));
        }
        for (i, t) in ["▁", "h", "e", "l", "o", "he", "▁h", "ll", "llo", "hello", "▁hello", "w", "é"].iter().enumerate() {
            entries.push((t.to_string(), -(i as f32), 1));
        }
        let types: Vec<i32> = entries.iter().map(|e| e.2).collect();
        let config = SpecialConfig {
            bos: Some(2),
            eos: Some(1),
            unk: Some(3),
            pad: Some(0),
            add_bos: true,
            add_space_prefix,
            ..SpecialConfig::default()
        };
        Tokenizer::from_parts(
            &entries.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
            entries.iter().map(|e| e.1).collect(),
            &types,
            config,
        )
        .expect("tiny vocabulary is valid")
    }

    fn ids(t: &Tokenizer, pieces: &[&str]) -> Vec<u32> {
        pieces.iter().map(|p| t.token_id(p).unwrap_or_else(|| panic!("no token {p:?}"))).collect()
    }

    #[test]
    fn encode_merges_and_specials() {
        let t = tiny(false);
        assert_eq!(t.encode(""), vec![2]);
        assert_eq!(t.encode_with("", false), Vec::<u32>::new());
        assert_eq!(t.encode_with("hello", false), ids(&t, &["hello"]));
        assert_eq!(t.encode_with(" hello", false), ids(&t, &["▁hello"]));
        assert_eq!(
            t.encode("<start_of_turn>hello\n\n\nhe<end_of_turn>  w<bos>"),
            ids(&t, &["<bos>", "<start_of_turn>", "hello", "\n\n", "\n", "he", "<end_of_turn>", "  ", "w", "<bos>"])
        );
        // "<start_of_tur" is not special: plain characters, all via byte fallback except 'e' ... 'o'.
        let partial = t.encode_with("<end", false);
        assert_eq!(partial, ids(&t, &["<0x3C>", "e", "<0x6E>", "<0x64>"]));
    }

    #[test]
    fn encode_byte_fallback() {
        let t = tiny(false);
        assert_eq!(t.encode_with("é€", false), ids(&t, &["é", "<0xE2>", "<0x82>", "<0xAC>"]));
    }

    #[test]
    fn space_prefix_at_start_and_after_specials() {
        let t = tiny(true);
        assert_eq!(t.encode_with("hello", false), ids(&t, &["▁hello"]));
        assert_eq!(t.encode_with("hello<eos>hello", false), ids(&t, &["▁hello", "<eos>", "▁hello"]));
        assert_eq!(t.decode(&t.encode("hello hello"), true), "hello hello");
        assert_eq!(t.decode(&t.encode_with("hello", false), false), "hello");
        assert_eq!(t.decode(&ids(&t, &["<bos>", "▁hello"]), false), "<bos> hello");
        let t = tiny(false);
        assert_eq!(t.decode(&ids(&t, &["▁hello", "▁hello"]), true), " hello hello");
    }

    #[test]
    fn decode_specials_bytes_and_unknown_ids() {
        let t = tiny(false);
        let x = ids(&t, &["<bos>", "<start_of_turn>", "▁hello", "\n", "<0xC3>", "<0xA9>", "<eos>"]);
        assert_eq!(t.decode(&x, false), "<bos><start_of_turn> hello\né<eos>");
        assert_eq!(t.decode(&x, true), " hello\né");
        assert_eq!(t.decode(&[u32::MAX, 100_000, t.vocab_size() as u32], false), "");
        let e = t.token_id("<0xE2>").expect("byte token");
        assert_eq!(t.decode(&[e, t.token_id("h").expect("h")], false), "\u{FFFD}h");
        assert_eq!(t.decode(&ids(&t, &["<unk>"]), false), "<unk>");
        assert_eq!(t.decode(&ids(&t, &["<unk>"]), true), "");
    }

    #[test]
    fn accessors() {
        let t = tiny(false);
        assert_eq!((t.bos_id(), t.eos_id(), t.unk_id(), t.pad_id()), (Some(2), Some(1), Some(3), Some(0)));
        assert_eq!(t.end_of_generation_ids(), &[1, 5]);
        assert!(t.is_end_of_generation(5) && t.is_end_of_generation(1) && !t.is_end_of_generation(2));
        assert!(t.is_control(2) && !t.is_control(3) && !t.is_control(6) && !t.is_control(u32::MAX));
        assert_eq!(t.piece(4), Some("<start_of_turn>"));
        assert_eq!(t.piece(u32::MAX), None);
        assert_eq!(t.token_id("nope"), None);
    }

    #[test]
    fn from_parts_validation() {
        let p = ["a", "b"];
        let ok = |c: SpecialConfig| Tokenizer::from_parts(&p, vec![0.0; 2], &[1, 1], c);
        assert!(ok(SpecialConfig::default()).is_ok());
        assert!(matches!(
            ok(SpecialConfig { eos: Some(2), ..SpecialConfig::default() }),
            Err(TokenizerError::SpecialIdOutOfRange { name: "eos", id: 2, n_vocab: 2 })
        ));
        assert!(matches!(
            Tokenizer::from_parts(&p, vec![0.0; 1], &[1, 1], SpecialConfig::default()),
            Err(TokenizerError::LengthMismatch { what: "scores", .. })
        ));
        assert!(matches!(
            Tokenizer::from_parts(&p, vec![0.0; 2], &[1], SpecialConfig::default()),
            Err(TokenizerError::LengthMismatch { what: "token types", .. })
        ));
        assert!(matches!(Tokenizer::from_parts::<&str>(&[], vec![], &[], SpecialConfig::default()), Err(TokenizerError::EmptyVocabulary)));
    }

    #[test]
    fn byte_fallback_without_byte_tokens_uses_ascii_tokens_then_unk() {
        let pieces = ["<unk>", "x"];
        let config = SpecialConfig { unk: Some(0), ..SpecialConfig::default() };
        let t = Tokenizer::from_parts(&pieces, vec![0.0; 2], &[2, 1], config).expect("valid");
        // 'x' is a token; 'y' and 'é' fall back to unk per byte.
        assert_eq!(t.encode_with("xyé", false), vec![1, 0, 0, 0]);
    }
}
