//! [`GgufWriter`]: builds GGUF v2/v3 files in memory and writes them atomically.

use crate::reader::{alignment_from, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use crate::tensor::data_size;
use crate::value::{MetaArray, MetaValue, MAX_ARRAY_DEPTH};
use crate::GgufError;
use kiln_quant::GgmlType;
use std::collections::HashSet;
use std::path::Path;

/// A tensor queued for writing.
struct PendingTensor {
    /// Tensor name.
    name: String,
    /// Dimensions, ggml order.
    dims: Vec<u64>,
    /// Element type.
    ty: GgmlType,
    /// Raw data (size validated).
    data: Vec<u8>,
}

/// Builds a GGUF file: metadata and tensors in insertion order, data aligned to `general.alignment` (default 32).
pub struct GgufWriter {
    /// Format version to write (2 or 3).
    version: u32,
    /// Metadata in insertion order.
    metadata: Vec<(String, MetaValue)>,
    /// Keys already added.
    keys: HashSet<String>,
    /// Tensors in insertion order.
    tensors: Vec<PendingTensor>,
    /// Tensor names already added.
    names: HashSet<String>,
    /// Data alignment (from `general.alignment` when added).
    alignment: u64,
}

impl GgufWriter {
    /// An empty writer for format `version` (2 or 3).
    pub fn new(version: u32) -> Result<GgufWriter, GgufError> {
        if !matches!(version, 2 | 3) {
            return Err(GgufError::UnsupportedVersion { version, reason: "the writer produces versions 2 and 3 only" });
        }
        Ok(GgufWriter {
            version,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            alignment: DEFAULT_ALIGNMENT,
        })
    }

    /// Adds a metadata entry; rejects duplicate keys, arrays nested too deeply and an invalid `general.alignment`.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: MetaValue) -> Result<(), GgufError> {
        let key = key.into();
        if self.keys.contains(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        if let MetaValue::Array(a) = &value {
            if a.depth() > MAX_ARRAY_DEPTH {
                return Err(GgufError::NestingTooDeep { key, max: MAX_ARRAY_DEPTH });
            }
        }
        if key == ALIGNMENT_KEY {
            // The reader accepts any integer type, but llama.cpp requires u32: write only that.
            if !matches!(value, MetaValue::U32(_)) {
                return Err(GgufError::BadAlignment { value: format!("{} ({})", value.summary(4), value.type_name()) });
            }
            self.alignment = alignment_from(&value)?;
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(())
    }

    /// Adds a tensor; `data` must be exactly the size of `dims` elements of `ty`.
    pub fn add_tensor(&mut self, name: impl Into<String>, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Result<(), GgufError> {
        let name = name.into();
        let expected = data_size(&name, dims, ty)?;
        if data.len() as u64 != expected {
            return Err(GgufError::DataSizeMismatch { name, ty, dims: dims.to_vec(), expected, actual: data.len() });
        }
        if self.names.contains(&name) {
            return Err(GgufError::DuplicateTensor { name });
        }
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor { name, dims: dims.to_vec(), ty, data });
        Ok(())
    }

    /// The complete file. Each tensor's data is padded to the alignment, as llama.cpp and gguf-py write it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.next_multiple_of(self.alignment as usize);
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += align(t.data.len());
        }
        let data_start = align(out.len());
        out.reserve(data_start - out.len() + offset);
        out.resize(data_start, 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(align(out.len()), 0);
        }
        out
    }

    /// Writes the file to `path` via a temporary file in the same directory, renamed into place.
    pub fn write(&self, path: &Path) -> Result<(), GgufError> {
        let io = |action, p: &Path| {
            let p = p.to_path_buf();
            move |source| GgufError::Io { action, path: p, source }
        };
        let Some(file_name) = path.file_name() else {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path does not name a file");
            return Err(io("write", path)(e));
        };
        let mut tmp_name = file_name.to_os_string();
        tmp_name.push(format!(".tmp.{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let result = std::fs::write(&tmp, self.to_bytes())
            .map_err(io("write", &tmp))
            .and_then(|()| std::fs::rename(&tmp, path).map_err(io("rename temporary file onto", path)));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

/// Appends a u64-length-prefixed string.
fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends a value's payload (without its type id).
fn put_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::Array(a) => put_array(out, a),
        MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// Appends an array: element type id, u64 count, elements.
fn put_array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend_from_slice(&a.elem_type_id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    /// Appends each element's little-endian bytes.
    fn put_all<const N: usize, T: Copy>(out: &mut Vec<u8>, items: &[T], encode: fn(T) -> [u8; N]) {
        for &x in items {
            out.extend_from_slice(&encode(x));
        }
    }
    match a {
        MetaArray::U8(v) => out.extend_from_slice(v),
        MetaArray::I8(v) => put_all(out, v, i8::to_le_bytes),
        MetaArray::U16(v) => put_all(out, v, u16::to_le_bytes),
        MetaArray::I16(v) => put_all(out, v, i16::to_le_bytes),
        MetaArray::U32(v) => put_all(out, v, u32::to_le_bytes),
        MetaArray::I32(v) => put_all(out, v, i32::to_le_bytes),
        MetaArray::F32(v) => put_all(out, v, f32::to_le_bytes),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::String(v) => v.iter().for_each(|s| put_string(out, s)),
        MetaArray::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
        MetaArray::U64(v) => put_all(out, v, u64::to_le_bytes),
        MetaArray::I64(v) => put_all(out, v, i64::to_le_bytes),
        MetaArray::F64(v) => put_all(out, v, f64::to_le_bytes),
    }
}
