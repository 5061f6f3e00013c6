//! kiln's graph IR: a tiny static-shape dataflow graph that every model builder emits and every
//! backend's compiler lowers.
//!
//! A [`Graph`] is built for one shape [`Bucket`] (a fixed number of rows, and for decode an upper
//! bound on the past length). Every value's first dimension is the row count of the bucket; at run
//! time a plan processes only the *active* rows (the real length), so padding costs nothing.
//! Weights are referenced by name ([`Op::Weight`]) and never carried by the graph.

mod bucket;
mod graph;

pub use bucket::{Bucket, BucketPolicy};
pub use graph::{
    Among, DType, Graph, GraphBuilder, IrError, Node, NodeId, Op, OutputMode, RopeMode, RopeSpec, CANDIDATES, TOP_K_MAX_WIDTH,
};
