//! Architectures: a config read from GGUF metadata plus a graph builder.

use kiln_gguf::GgufFile;
use kiln_ir::{Bucket, Graph, OutputMode};
use kiln_runtime::{KvLayout, KvType};

use crate::families::config_from_gguf;
use crate::ModelError;

/// A model family: hyperparameters and the graph builder for one bucket.
pub trait Architecture: Send + Sync {
    /// The `general.architecture` name.
    fn name(&self) -> &'static str;
    /// The graph for `bucket` producing `mode`'s output.
    fn build_graph(&self, bucket: Bucket, mode: OutputMode) -> Result<Graph, ModelError>;
    /// Per-layer KV cache layout for a context of `context` tokens stored as `elem`.
    fn kv_layout(&self, context: usize, elem: KvType) -> KvLayout;
    /// Vocabulary size (logits width).
    fn vocab_size(&self) -> usize;
    /// The context length the model was trained for.
    fn trained_context(&self) -> usize;
}

/// Reads the architecture named by `general.architecture` and its hyperparameters.
pub fn architecture_from_gguf(f: &GgufFile) -> Result<Box<dyn Architecture>, ModelError> {
    Ok(Box::new(config_from_gguf(f)?))
}
