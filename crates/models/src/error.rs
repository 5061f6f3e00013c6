//! Model errors.

/// Everything that can go wrong loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be read.
    #[error(transparent)]
    Gguf(#[from] kiln_gguf::GgufError),
    /// The tokenizer could not be built from the file's metadata.
    #[error(transparent)]
    Tokenizer(#[from] kiln_tokenizer::TokenizerError),
    /// Compiling or running a plan failed.
    #[error(transparent)]
    Runtime(#[from] kiln_runtime::RuntimeError),
    /// The graph builder produced a malformed graph.
    #[error(transparent)]
    Ir(#[from] kiln_ir::IrError),
    /// The file's architecture is not one kiln runs.
    #[error("unsupported architecture '{0}' (kiln runs: {supported})", supported = crate::families::SUPPORTED.join(", "))]
    UnsupportedArchitecture(String),
    /// A hyperparameter in the metadata is missing or inconsistent.
    #[error("bad model metadata: {0}")]
    Metadata(String),
    /// The tokens do not fit in the context.
    #[error("{needed} tokens do not fit in the context of {context} tokens; use a shorter prompt or a larger --context")]
    ContextOverflow {
        /// Positions the sequence would need.
        needed: usize,
        /// Context size.
        context: usize,
    },
    /// The model produced NaN or infinity.
    #[error("the model produced a non-finite value at position {position}; the weights may be corrupt")]
    NonFinite {
        /// Position of the row.
        position: usize,
    },
    /// A request parameter was invalid.
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),
}
