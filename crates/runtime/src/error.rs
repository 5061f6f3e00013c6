//! Runtime errors.

use kiln_quant::GgmlType;

/// Everything that can go wrong while compiling or running a plan.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The graph names a weight the model file does not contain.
    #[error("the model file has no tensor '{0}' (is this the right architecture?)")]
    MissingWeight(String),
    /// A weight's shape differs from what the model builder expects.
    #[error("tensor '{name}' has shape {found:?} but the model expects {expected:?}")]
    WeightShape {
        /// Tensor name.
        name: String,
        /// Shape the graph expects ([n, k] or [k]).
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A weight is stored in a block format this runtime cannot compute with.
    #[error("tensor '{name}' is stored as {ty:?}, which kiln cannot compute with")]
    UnsupportedWeightType {
        /// Tensor name.
        name: String,
        /// Its format.
        ty: GgmlType,
    },
    /// A tensor in the file has more dimensions than a weight can have.
    #[error("tensor '{name}' has {dims} dimensions; weights must have at most 4")]
    WeightRank {
        /// Tensor name.
        name: String,
        /// Its number of dimensions.
        dims: usize,
    },
    /// The graph was malformed.
    #[error(transparent)]
    Ir(#[from] kiln_ir::IrError),
    /// The graph uses an op in a way the compiler cannot lower.
    #[error("cannot compile graph: {0}")]
    Compile(String),
    /// A step was given more tokens than its plan has rows, or positions past the plan's bounds.
    #[error("step does not fit its plan: {0}")]
    StepShape(String),
    /// The KV cache cannot hold the positions a step needs.
    #[error("the KV cache holds {capacity} positions; this step needs {needed}")]
    KvFull {
        /// Capacity of the cache.
        capacity: usize,
        /// Positions needed.
        needed: usize,
    },
    /// A token id was outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A block-format error while reading weights.
    #[error(transparent)]
    Quant(#[from] kiln_quant::QuantError),
    /// The backend does not implement an operation.
    #[error("{0} is not supported by this backend")]
    Unsupported(String),
    /// The backend failed.
    #[error("{backend} backend: {msg}")]
    Backend {
        /// Backend name.
        backend: String,
        /// What failed.
        msg: String,
    },
}
