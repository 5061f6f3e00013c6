//! Tokenizers built from GGUF metadata.
//!
//! [`Tokenizer`] implements SentencePiece-style tokenization as llama.cpp does for
//! `tokenizer.ggml.model = "llama"`: the input is split on the texts of control and user-defined
//! tokens (leftmost-longest match), each remaining fragment has its spaces replaced by `▁`, is split
//! into characters and merged pairwise by highest token score, and characters outside the
//! vocabulary fall back to `<0xXX>` byte tokens. For `tokenizer.ggml.model = "gpt2"` it is a
//! byte-level BPE: the same special-token split, then the pre-tokenizer regex that
//! `tokenizer.ggml.pre` names, GPT-2's byte-to-unicode alphabet and merges by rank.
//! [`StreamDecoder`] detokenizes incrementally and
//! [`ChatTemplate`] renders the model's Jinja chat template (or [`gemma_chat_prompt`], Gemma's
//! turn format, when the file has none).

mod bpe;
mod chat;
mod gguf;
mod spm;
mod stream;
mod template;
mod tokenizer;
mod vocab;

pub use chat::{gemma_chat_prompt, ChatMessage};
pub use stream::StreamDecoder;
pub use template::{ChatTemplate, Conversation, TurnPrompt, CHAT_TEMPLATE_KEY};
pub use tokenizer::Tokenizer;

/// Errors from building a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata key is missing or has the wrong type.
    #[error("GGUF metadata key `{key}`: {source}")]
    Metadata {
        /// The key.
        key: &'static str,
        /// The underlying error.
        source: kiln_gguf::GgufError,
    },

    /// A metadata array has the wrong element type.
    #[error("GGUF metadata key `{key}` must be an array of {expected}")]
    ArrayType {
        /// The key.
        key: &'static str,
        /// The expected element type.
        expected: &'static str,
    },

    /// The tokenizer model named by `tokenizer.ggml.model` is not implemented.
    #[error("unsupported tokenizer model `{0}` (tokenizer.ggml.model); supported: `llama` (SentencePiece), `gpt2` (byte-level BPE)")]
    UnsupportedModel(String),

    /// The pre-tokenizer named by `tokenizer.ggml.pre` is not implemented.
    #[error("unsupported BPE pre-tokenizer `{0}` (tokenizer.ggml.pre); supported: {supported}", supported = bpe::pre_tokenizer_names().join(", "))]
    UnsupportedPreTokenizer(String),

    /// A pre-tokenizer regex failed to compile (a bug in kiln, reported rather than panicking).
    #[error("pre-tokenizer `{name}` regex: {message}")]
    PreTokenizerRegex {
        /// The pre-tokenizer name.
        name: String,
        /// The regex error.
        message: String,
    },

    /// A merge in `tokenizer.ggml.merges` is not two vocabulary tokens separated by a space.
    #[error("merge {rank} {text:?} in tokenizer.ggml.merges is not two vocabulary tokens separated by a space")]
    BadMerge {
        /// Its position (rank) in the merge list.
        rank: u32,
        /// Its text.
        text: String,
    },

    /// The vocabulary has no tokens.
    #[error("the vocabulary (tokenizer.ggml.tokens) is empty")]
    EmptyVocabulary,

    /// The vocabulary has 2^32 or more tokens or bytes of token text.
    #[error("the vocabulary ({0} tokens) is too large: at most 2^32 - 1 tokens and bytes of text are supported")]
    VocabularyTooLarge(usize),

    /// Scores or token types do not have one entry per token.
    #[error("{got} {what} for a vocabulary of {expected} tokens")]
    LengthMismatch {
        /// "scores" or "token types".
        what: &'static str,
        /// Number of entries found.
        got: usize,
        /// Number of tokens.
        expected: usize,
    },

    /// A special-token id is not in the vocabulary.
    #[error("the {name} token id {id} is out of range for a vocabulary of {n_vocab} tokens")]
    SpecialIdOutOfRange {
        /// "bos", "eos", "unk", "pad", "eot" or "eom".
        name: &'static str,
        /// The id.
        id: u32,
        /// Number of tokens.
        n_vocab: usize,
    },

    /// A token has a token-type code outside 0..=6.
    #[error("token {id} has unknown type {code} in tokenizer.ggml.token_type")]
    BadTokenType {
        /// The token id.
        id: u32,
        /// The type code.
        code: i32,
    },

    /// The chat template does not parse, or raised an error while rendering.
    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A byte token (type 6) whose text is not `<0xXX>`.
    #[error("byte token {id} has text {text:?}; expected <0xXX>")]
    BadByteToken {
        /// The token id.
        id: u32,
        /// Its text.
        text: String,
    },
}
