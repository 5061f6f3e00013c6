//! GGUF container reading (v2 and v3, memory-mapped, validated against hostile input) and writing.
//!
//! [`GgufFile::open`] maps a file and checks every count, length, offset and size before using it;
//! [`GgufWriter`] produces files the reader (and llama.cpp / gguf-py) accept.

mod error;
mod reader;
mod tensor;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::GgufFile;
pub use tensor::{TensorInfo, MAX_DIMS};
pub use value::{MetaArray, MetaValue};
pub use writer::GgufWriter;
