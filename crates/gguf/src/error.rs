//! The error type of GGUF reading and writing.

use kiln_quant::GgmlType;
use std::path::PathBuf;

/// Everything that can go wrong reading, validating, querying or writing a GGUF file.
///
/// Every message names the field, key or tensor concerned and what was wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// An I/O operation on a file failed.
    #[error("cannot {action} '{path}': {source}")]
    Io {
        /// What was being done ("open", "map", "write", ...).
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with "GGUF".
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\" [47, 47, 55, 46]")]
    BadMagic {
        /// The first four bytes found.
        found: [u8; 4],
    },
    /// The format version is not 2 or 3.
    #[error("unsupported GGUF version {version}: {reason}")]
    UnsupportedVersion {
        /// The version found (or requested for writing).
        version: u32,
        /// Why it is not supported.
        reason: &'static str,
    },
    /// The file ends before a field is complete.
    #[error("truncated file: {what} at offset {offset} needs {needed} bytes, but only {available} remain")]
    Truncated {
        /// The field being read.
        what: String,
        /// Its file offset.
        offset: u64,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left in the file.
        available: u64,
    },
    /// An element count is larger than the rest of the file could hold.
    #[error("{what} is {count}, but the {available} bytes left at offset {offset} can hold at most {max}")]
    CountTooLarge {
        /// The count field.
        what: String,
        /// The count found.
        count: u64,
        /// Offset just after the count.
        offset: u64,
        /// Bytes left in the file.
        available: u64,
        /// The largest count those bytes could hold.
        max: u64,
    },
    /// A string is not valid UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// The string field.
        what: String,
        /// Its file offset.
        offset: u64,
    },
    /// A metadata value (or array element) has an unknown type id.
    #[error("key '{key}': unknown value type id {type_id}")]
    UnknownValueType {
        /// The metadata key.
        key: String,
        /// The type id found.
        type_id: u32,
    },
    /// A bool is stored as a byte other than 0 or 1.
    #[error("key '{key}': invalid bool byte {value} at offset {offset} (must be 0 or 1)")]
    InvalidBool {
        /// The metadata key.
        key: String,
        /// The byte found.
        value: u8,
        /// Its file offset.
        offset: u64,
    },
    /// Arrays are nested deeper than supported.
    #[error("key '{key}': arrays nested more than {max} levels deep")]
    NestingTooDeep {
        /// The metadata key.
        key: String,
        /// The deepest nesting allowed.
        max: usize,
    },
    /// Two metadata entries have the same key.
    #[error("duplicate metadata key '{key}'")]
    DuplicateKey {
        /// The repeated key.
        key: String,
    },
    /// Two tensors have the same name.
    #[error("duplicate tensor name '{name}'")]
    DuplicateTensor {
        /// The repeated name.
        name: String,
    },
    /// `general.alignment` is not a nonzero power of two that fits in u32.
    #[error("key 'general.alignment': must be a nonzero power of two (u32), got {value}")]
    BadAlignment {
        /// The value found, summarised.
        value: String,
    },
    /// A tensor has more dimensions than ggml supports.
    #[error("tensor '{name}': {n_dims} dimensions, at most {max} are supported")]
    TooManyDims {
        /// The tensor.
        name: String,
        /// Its dimension count.
        n_dims: u64,
        /// GGML_MAX_DIMS.
        max: usize,
    },
    /// A tensor's type id is not a known ggml type.
    #[error("tensor '{name}': unknown ggml type id {type_id}")]
    UnknownTensorType {
        /// The tensor.
        name: String,
        /// The type id found.
        type_id: u32,
    },
    /// A tensor's shape is invalid for its type (size overflow, row not a whole number of blocks, ...).
    #[error("tensor '{name}': {reason}")]
    InvalidTensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's data offset is not a multiple of the file's alignment.
    #[error("tensor '{name}': data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        /// The tensor.
        name: String,
        /// Its offset relative to the start of the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor's data lies (partly) beyond the end of the file.
    #[error("tensor '{name}': data [offset {offset}, {n_bytes} bytes] extends past end of file ({file_len} bytes)")]
    DataOutOfBounds {
        /// The tensor.
        name: String,
        /// Absolute file offset of its data (saturated on overflow).
        offset: u64,
        /// Bytes of data.
        n_bytes: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A metadata key was looked up but is not present.
    #[error("metadata key '{key}' not found")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value has a different type than requested.
    #[error("metadata key '{key}': expected {expected}, found {found}")]
    WrongType {
        /// The key.
        key: String,
        /// The type(s) requested.
        expected: &'static str,
        /// The type found.
        found: &'static str,
    },
    /// An integer metadata value does not fit the requested type.
    #[error("metadata key '{key}': value {value} does not fit in {target}")]
    OutOfRange {
        /// The key.
        key: String,
        /// The value found.
        value: i128,
        /// The requested type.
        target: &'static str,
    },
    /// Data given to the writer does not match the tensor's size.
    #[error("tensor '{name}': {actual} bytes of data given, but {ty} {dims:?} takes {expected} bytes")]
    DataSizeMismatch {
        /// The tensor.
        name: String,
        /// Its element type.
        ty: GgmlType,
        /// Its dimensions.
        dims: Vec<u64>,
        /// Bytes its shape takes.
        expected: u64,
        /// Bytes given.
        actual: usize,
    },
}
