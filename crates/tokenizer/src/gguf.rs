//! Building a [`Tokenizer`] from the `tokenizer.ggml.*` metadata of a GGUF file.

use kiln_gguf::{GgufError, GgufFile};

use crate::tokenizer::SpecialConfig;
use crate::{Tokenizer, TokenizerError};

/// `tokenizer.ggml.model`.
const MODEL: &str = "tokenizer.ggml.model";
/// `tokenizer.ggml.tokens`.
const TOKENS: &str = "tokenizer.ggml.tokens";
/// `tokenizer.ggml.scores`.
const SCORES: &str = "tokenizer.ggml.scores";
/// `tokenizer.ggml.token_type`.
const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// `tokenizer.ggml.merges` (byte-level BPE).
const MERGES: &str = "tokenizer.ggml.merges";
/// `tokenizer.ggml.pre` (byte-level BPE pre-tokenizer name).
const PRE: &str = "tokenizer.ggml.pre";

/// Reads `key` with `get` if present; `Ok(None)` if absent.
fn optional<'f, T>(
    f: &'f GgufFile,
    key: &'static str,
    get: impl FnOnce(&'f GgufFile, &'static str) -> Result<T, GgufError>,
) -> Result<Option<T>, TokenizerError> {
    if f.get(key).is_none() {
        return Ok(None);
    }
    get(f, key).map(Some).map_err(|source| TokenizerError::Metadata { key, source })
}

/// Reads a special-token id; an absent key gives `default` if that is inside the vocabulary.
fn special_id(f: &GgufFile, key: &'static str, default: Option<u32>, n_vocab: usize) -> Result<Option<u32>, TokenizerError> {
    Ok(match optional(f, key, GgufFile::get_u32)? {
        Some(id) => Some(id),
        None => default.filter(|&id| (id as usize) < n_vocab),
    })
}

impl Tokenizer {
    /// Builds the tokenizer described by the `tokenizer.ggml.*` metadata of `f`.
    ///
    /// `tokenizer.ggml.model = "llama"` is SentencePiece; absent optional keys take llama.cpp's
    /// defaults: scores 0, all tokens normal, bos 1, eos 2, unk 0, no pad, BOS added, EOS not
    /// added, space prefix added. `"gpt2"` is byte-level BPE: `tokenizer.ggml.merges` is required,
    /// `tokenizer.ggml.pre` defaults to `"default"` (GPT-2's regex), special ids default to none,
    /// BOS is added only when `add_bos_token` says so, and no space prefix is added.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let model = f.get_str(MODEL).map_err(|source| TokenizerError::Metadata { key: MODEL, source })?;
        let byte_level = match model {
            "llama" => false,
            "gpt2" => true,
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        let pieces = f
            .get_array(TOKENS)
            .map_err(|source| TokenizerError::Metadata { key: TOKENS, source })?
            .as_strings()
            .ok_or(TokenizerError::ArrayType { key: TOKENS, expected: "strings" })?;
        let n = pieces.len();
        let scores = match optional(f, SCORES, GgufFile::get_array)? {
            Some(a) => a.as_f32s().ok_or(TokenizerError::ArrayType { key: SCORES, expected: "f32" })?.to_vec(),
            None => vec![0.0; n],
        };
        let default_types;
        let type_codes: &[i32] = match optional(f, TOKEN_TYPE, GgufFile::get_array)? {
            Some(a) => a.as_i32s().ok_or(TokenizerError::ArrayType { key: TOKEN_TYPE, expected: "i32" })?,
            None => {
                default_types = vec![1; n];
                &default_types
            }
        };
        let flag = |key: &'static str, default: bool| -> Result<bool, TokenizerError> {
            Ok(optional(f, key, GgufFile::get_bool)?.unwrap_or(default))
        };
        let spm_default = |id: u32| (!byte_level).then_some(id);
        let config = SpecialConfig {
            bos: special_id(f, "tokenizer.ggml.bos_token_id", spm_default(1), n)?,
            eos: special_id(f, "tokenizer.ggml.eos_token_id", spm_default(2), n)?,
            unk: special_id(f, "tokenizer.ggml.unknown_token_id", spm_default(0), n)?,
            pad: special_id(f, "tokenizer.ggml.padding_token_id", None, n)?,
            eot: special_id(f, "tokenizer.ggml.eot_token_id", None, n)?,
            eom: special_id(f, "tokenizer.ggml.eom_token_id", None, n)?,
            add_bos: flag("tokenizer.ggml.add_bos_token", !byte_level)?,
            add_eos: flag("tokenizer.ggml.add_eos_token", false)?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", !byte_level)?,
        };
        let tokenizer = Tokenizer::from_parts(pieces, scores, type_codes, config)?;
        if !byte_level {
            return Ok(tokenizer);
        }
        let merges = f
            .get_array(MERGES)
            .map_err(|source| TokenizerError::Metadata { key: MERGES, source })?
            .as_strings()
            .ok_or(TokenizerError::ArrayType { key: MERGES, expected: "strings" })?;
        let pre = optional(f, PRE, GgufFile::get_str)?.unwrap_or("default");
        tokenizer.into_byte_level(merges, pre)
    }
}
