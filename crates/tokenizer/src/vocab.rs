//! The vocabulary: token texts, scores and kinds, a text -> id index and a trie of special tokens.

use crate::TokenizerError;

/// The kind of a vocabulary entry (`tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenKind {
    /// An ordinary piece (type 1, and the undefined type 0); `▁` stands for a space.
    Normal,
    /// The unknown token (type 2).
    Unknown,
    /// A control token such as `<bos>` or `<start_of_turn>` (type 3).
    Control,
    /// A user-defined token, matched literally in the input (type 4).
    UserDefined,
    /// An unused slot (type 5).
    Unused,
    /// A byte-fallback token `<0xXX>` (type 6) standing for this byte.
    Byte(u8),
}

impl TokenKind {
    /// Maps a GGUF token-type code to a kind; `text` is needed to get the byte of a byte token.
    pub(crate) fn from_code(id: u32, code: i32, text: &str) -> Result<TokenKind, TokenizerError> {
        Ok(match code {
            0 | 1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte(parse_byte_token(text).ok_or_else(|| TokenizerError::BadByteToken { id, text: text.to_owned() })?),
            _ => return Err(TokenizerError::BadTokenType { id, code }),
        })
    }

    /// Whether the input text is split on this token's text before the SentencePiece merges.
    pub(crate) fn is_matched_literally(self) -> bool {
        matches!(self, TokenKind::Unknown | TokenKind::Control | TokenKind::UserDefined)
    }

    /// Whether `skip_special` decoding drops this token.
    pub(crate) fn is_special(self) -> bool {
        matches!(self, TokenKind::Unknown | TokenKind::Control | TokenKind::Unused)
    }
}

/// Parses `<0xXX>` (two hex digits) into its byte.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Marks an empty slot of [`PieceIndex`].
const EMPTY: u64 = u64::MAX;

/// All token texts in one buffer.
#[derive(Debug)]
struct Texts {
    /// The concatenated texts.
    buf: String,
    /// Token `i` is `buf[bounds[i]..bounds[i + 1]]`.
    bounds: Vec<u32>,
}

impl Texts {
    /// Concatenates `pieces`; `None` if the text or the count does not fit u32 offsets.
    fn new<S: AsRef<str>>(pieces: &[S]) -> Option<Texts> {
        let total: usize = pieces.iter().map(|p| p.as_ref().len()).sum();
        u32::try_from(total).ok()?;
        u32::try_from(pieces.len()).ok()?;
        let mut buf = String::with_capacity(total);
        let mut bounds = Vec::with_capacity(pieces.len() + 1);
        bounds.push(0);
        for p in pieces {
            buf.push_str(p.as_ref());
            // Cannot truncate: checked against u32::MAX above.
            bounds.push(buf.len() as u32);
        }
        Some(Texts { buf, bounds })
    }

    /// Number of texts.
    fn len(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Text `id`.
    fn get(&self, id: u32) -> Option<&str> {
        let i = id as usize;
        let (&start, &end) = (self.bounds.get(i)?, self.bounds.get(i + 1)?);
        self.buf.get(start as usize..end as usize)
    }
}

/// An open-addressing hash index from token text to id; the texts stay in [`Texts`].
#[derive(Debug)]
struct PieceIndex {
    /// `(hash tag << 32) | id`, or [`EMPTY`]; the length is a power of two.
    slots: Vec<u64>,
}

/// FNV-1a over the bytes of `s`, finished with a multiplicative mix.
fn hash_str(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in s.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

impl PieceIndex {
    /// Indexes `texts`; when a text occurs twice, the later id wins (as in llama.cpp).
    fn build(texts: &Texts) -> PieceIndex {
        let cap = (texts.len() * 2).next_power_of_two().max(16);
        let mut index = PieceIndex { slots: vec![EMPTY; cap] };
        for id in 0..texts.len() as u32 {
            let text = texts.get(id).unwrap_or_default();
            let (slot, tag) = index.find_slot(texts, text);
            index.slots[slot] = (tag << 32) | u64::from(id);
        }
        index
    }

    /// The slot that holds `text`, or the empty slot where it would go; and the tag of `text`.
    fn find_slot(&self, texts: &Texts, text: &str) -> (usize, u64) {
        let h = hash_str(text);
        let tag = h >> 32;
        let mask = self.slots.len() - 1;
        // Truncation is intended: only the low bits select the slot.
        let mut slot = h as usize & mask;
        loop {
            let entry = self.slots[slot];
            if entry == EMPTY || (entry >> 32 == tag && texts.get(entry as u32) == Some(text)) {
                return (slot, tag);
            }
            slot = (slot + 1) & mask;
        }
    }

    /// The id of the token whose text is `text`.
    fn get(&self, texts: &Texts, text: &str) -> Option<u32> {
        let entry = self.slots[self.find_slot(texts, text).0];
        // The low 32 bits are the id.
        (entry != EMPTY).then_some(entry as u32)
    }
}

/// A byte trie over the texts of the literally matched (special and user-defined) tokens.
#[derive(Debug)]
struct SpecialTrie {
    /// Node 0 is the root.
    nodes: Vec<TrieNode>,
}

/// One node of [`SpecialTrie`].
#[derive(Debug, Default)]
struct TrieNode {
    /// Outgoing edges, sorted by byte: (byte, child node index).
    children: Vec<(u8, u32)>,
    /// The token whose text ends here.
    token: Option<u32>,
}

impl SpecialTrie {
    /// An empty trie.
    fn new() -> SpecialTrie {
        SpecialTrie { nodes: vec![TrieNode::default()] }
    }

    /// Adds `text` (non-empty) as token `id`, replacing an earlier token with the same text.
    fn insert(&mut self, text: &str, id: u32) {
        let mut node = 0usize;
        for &b in text.as_bytes() {
            let next_index = self.nodes.len() as u32;
            let children = &mut self.nodes[node].children;
            node = match children.binary_search_by_key(&b, |&(c, _)| c) {
                Ok(i) => children[i].1 as usize,
                Err(i) => {
                    children.insert(i, (b, next_index));
                    self.nodes.push(TrieNode::default());
                    next_index as usize
                }
            };
        }
        self.nodes[node].token = Some(id);
    }

    /// The longest token text that `bytes` starts with: (id, length in bytes).
    fn longest_prefix(&self, bytes: &[u8]) -> Option<(u32, usize)> {
        let mut node = 0usize;
        let mut best = None;
        for (i, b) in bytes.iter().enumerate() {
            let children = &self.nodes[node].children;
            match children.binary_search_by_key(b, |&(c, _)| c) {
                Ok(k) => node = children[k].1 as usize,
                Err(_) => break,
            }
            if let Some(id) = self.nodes[node].token {
                best = Some((id, i + 1));
            }
        }
        best
    }
}

/// A piece of input text after splitting on special tokens.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    /// Text to be tokenized by the SentencePiece merges.
    Text(&'a str),
    /// A special or user-defined token matched literally.
    Token(u32),
}

/// The vocabulary of a tokenizer.
#[derive(Debug)]
pub(crate) struct Vocab {
    /// Token texts, indexed by id.
    texts: Texts,
    /// Merge scores, indexed by id (higher merges first).
    scores: Vec<f32>,
    /// Token kinds, indexed by id.
    kinds: Vec<TokenKind>,
    /// Text -> id.
    index: PieceIndex,
    /// Literally matched tokens.
    specials: SpecialTrie,
}

impl Vocab {
    /// Builds a vocabulary; the three inputs must have the same length (checked by the caller).
    /// `None` if there are 2^32 or more tokens or bytes of token text.
    pub(crate) fn new<S: AsRef<str>>(pieces: &[S], scores: Vec<f32>, kinds: Vec<TokenKind>) -> Option<Vocab> {
        let texts = Texts::new(pieces)?;
        let index = PieceIndex::build(&texts);
        let mut specials = SpecialTrie::new();
        for (id, (piece, kind)) in (0u32..).zip(pieces.iter().zip(&kinds)) {
            let piece = piece.as_ref();
            if kind.is_matched_literally() && !piece.is_empty() {
                specials.insert(piece, id);
            }
        }
        Some(Vocab { texts, scores, kinds, index, specials })
    }

    /// Number of tokens.
    pub(crate) fn len(&self) -> usize {
        self.texts.len()
    }

    /// The text of token `id`.
    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.texts.get(id)
    }

    /// The kind of token `id`.
    pub(crate) fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The merge score of token `id` (which must be in range).
    pub(crate) fn score(&self, id: u32) -> f32 {
        self.scores[id as usize]
    }

    /// The id of the token whose text is exactly `text`.
    pub(crate) fn id_of(&self, text: &str) -> Option<u32> {
        self.index.get(&self.texts, text)
    }

    /// Splits `text` at the special and user-defined tokens it contains (leftmost-longest match).
    pub(crate) fn split_specials<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut start = 0;
        let mut pos = 0;
        while pos < bytes.len() {
            // A match starts with a UTF-8 lead byte, so `pos` is then a char boundary.
            match self.specials.longest_prefix(&bytes[pos..]) {
                Some((id, len)) => {
                    if start < pos {
                        out.push(Fragment::Text(&text[start..pos]));
                    }
                    out.push(Fragment::Token(id));
                    pos += len;
                    start = pos;
                }
                None => pos += 1,
            }
        }
        if start < bytes.len() {
            out.push(Fragment::Text(&text[start..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(entries: &[(&str, TokenKind)]) -> Vocab {
        let texts: Vec<&str> = entries.iter().map(|&(t, _)| t).collect();
        Vocab::new(&texts, vec![0.0; entries.len()], entries.iter().map(|&(_, k)| k).collect()).expect("small vocabulary")
    }

    #[test]
    fn byte_token_parsing() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x100>"), None);
        assert_eq!(parse_byte_token("<0x+1>"), None);
        assert_eq!(parse_byte_token("0x41"), None);
        assert!(matches!(TokenKind::from_code(7, 6, "A"), Err(TokenizerError::BadByteToken { id: 7, .. })));
        assert!(matches!(TokenKind::from_code(3, 9, "x"), Err(TokenizerError::BadTokenType { id: 3, code: 9 })));
    }

    #[test]
    fn index_finds_every_piece_and_nothing_else() {
        let pieces: Vec<String> = (0..1000).map(|i| format!("p{i}")).collect();
        let v = Vocab::new(&pieces, vec![0.0; 1000], vec![TokenKind::Normal; 1000]).expect("small");
        for (i, p) in pieces.iter().enumerate() {
            assert_eq!(v.id_of(p), Some(i as u32));
        }
        assert_eq!(v.id_of("p1000"), None);
        assert_eq!(v.id_of(""), None);
    }

    #[test]
    fn duplicate_text_last_id_wins() {
        let v = vocab(&[("a", TokenKind::Normal), ("a", TokenKind::Normal)]);
        assert_eq!(v.id_of("a"), Some(1));
    }

    #[test]
    fn split_leftmost_longest() {
        let v = vocab(&[
            ("<s>", TokenKind::Control),
            ("\n", TokenKind::UserDefined),
            ("\n\n", TokenKind::UserDefined),
            ("<s>x", TokenKind::Unknown),
            ("ab", TokenKind::Normal),
            ("", TokenKind::Control),
        ]);
        use Fragment::*;
        assert_eq!(v.split_specials(""), vec![]);
        assert_eq!(v.split_specials("ab"), vec![Text("ab")]);
        assert_eq!(v.split_specials("a<s>\n\n\nb<s>x<s"), vec![Text("a"), Token(0), Token(2), Token(1), Text("b"), Token(3), Text("<s")]);
        assert_eq!(v.split_specials("é\n"), vec![Text("é"), Token(1)]);
    }
}
