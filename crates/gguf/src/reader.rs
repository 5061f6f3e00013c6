//! GGUF parsing and validation, and the [`GgufFile`] handle.

use crate::tensor::{data_size, TensorInfo, MAX_DIMS};
use crate::value::{type_id, type_id_name, MetaArray, MetaValue, MAX_ARRAY_DEPTH};
use crate::GgufError;
use kiln_quant::GgmlType;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;

/// The four bytes every GGUF file starts with.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the data alignment.
pub(crate) const ALIGNMENT_KEY: &str = "general.alignment";

/// Fewest bytes one metadata entry can take: key length (8), value type (4), one-byte value.
const MIN_KV_BYTES: usize = 13;
/// Fewest bytes one tensor info can take: name length (8), dimension count (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 24;

/// Checks that `version` is one this crate reads (2 or 3), explaining why not otherwise.
pub(crate) fn check_version(version: u32) -> Result<(), GgufError> {
    let reason = match version {
        2 | 3 => return Ok(()),
        1 => "version 1 is the obsolete pre-release format (32-bit counts); re-convert the model with current tools",
        v if matches!(v.swap_bytes(), 2 | 3) => "the file looks big-endian; only little-endian GGUF files are supported",
        _ => "only versions 2 and 3 are supported",
    };
    Err(GgufError::UnsupportedVersion { version, reason })
}

/// The alignment a `general.alignment` value specifies, if valid (a nonzero power of two in u32).
pub(crate) fn alignment_from(value: &MetaValue) -> Result<u64, GgufError> {
    value
        .as_u64()
        .filter(|&a| a.is_power_of_two() && a <= u64::from(u32::MAX))
        .ok_or_else(|| GgufError::BadAlignment { value: format!("{} ({})", value.summary(4), value.type_name()) })
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Reader<'a> {
    /// The whole file.
    buf: &'a [u8],
    /// Current offset.
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Bytes left after the cursor.
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The error for a field of `needed` bytes that does not fit in the rest of the file.
    fn truncated(&self, what: String, needed: u64) -> GgufError {
        GgufError::Truncated { what, offset: self.pos as u64, needed, available: self.remaining() as u64 }
    }

    /// The next `n` bytes; `what` names the field for the error message.
    fn take(&mut self, n: usize, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what(), n as u64));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    /// The next `N` bytes as an array.
    fn bytes<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    /// A little-endian u32.
    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.bytes(what).map(u32::from_le_bytes)
    }

    /// A little-endian u64.
    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.bytes(what).map(u64::from_le_bytes)
    }

    /// A u64-length-prefixed UTF-8 string; the length is checked against the bytes left before allocating.
    fn string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(|| format!("{} length", what()))?;
        let start = self.pos as u64;
        let len = match usize::try_from(len) {
            Ok(n) if n <= self.remaining() => n,
            _ => return Err(self.truncated(format!("{} ({len}-byte string)", what()), len)),
        };
        let bytes = self.take(len, &what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { what: what(), offset: start }),
        }
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in the rest of the file.
    fn check_count(&self, count: u64, min_size: usize, what: impl FnOnce() -> String) -> Result<usize, GgufError> {
        let max = (self.remaining() / min_size) as u64;
        if count > max {
            return Err(GgufError::CountTooLarge { what: what(), count, offset: self.pos as u64, available: self.remaining() as u64, max });
        }
        Ok(count as usize)
    }
}

/// Decodes `bytes` as consecutive little-endian `N`-byte items.
fn le_items<const N: usize, T>(bytes: &[u8], decode: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            decode(a)
        })
        .collect()
}

/// Reads bool bytes, rejecting anything but 0 and 1.
fn read_bools(r: &mut Reader<'_>, n: usize, key: &str) -> Result<Vec<bool>, GgufError> {
    let start = r.pos as u64;
    let bytes = r.take(n, || format!("key '{key}': bool value"))?;
    bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| match b {
            0 | 1 => Ok(b == 1),
            _ => Err(GgufError::InvalidBool { key: key.to_string(), value: b, offset: start + i as u64 }),
        })
        .collect()
}

/// Reads a scalar or array value of GGUF type `ty` for metadata key `key`.
fn read_value(r: &mut Reader<'_>, ty: u32, key: &str) -> Result<MetaValue, GgufError> {
    let what = || format!("key '{key}': {} value", type_id_name(ty));
    Ok(match ty {
        type_id::U8 => MetaValue::U8(u8::from_le_bytes(r.bytes(what)?)),
        type_id::I8 => MetaValue::I8(i8::from_le_bytes(r.bytes(what)?)),
        type_id::U16 => MetaValue::U16(u16::from_le_bytes(r.bytes(what)?)),
        type_id::I16 => MetaValue::I16(i16::from_le_bytes(r.bytes(what)?)),
        type_id::U32 => MetaValue::U32(u32::from_le_bytes(r.bytes(what)?)),
        type_id::I32 => MetaValue::I32(i32::from_le_bytes(r.bytes(what)?)),
        type_id::F32 => MetaValue::F32(f32::from_le_bytes(r.bytes(what)?)),
        type_id::U64 => MetaValue::U64(u64::from_le_bytes(r.bytes(what)?)),
        type_id::I64 => MetaValue::I64(i64::from_le_bytes(r.bytes(what)?)),
        type_id::F64 => MetaValue::F64(f64::from_le_bytes(r.bytes(what)?)),
        type_id::BOOL => MetaValue::Bool(read_bools(r, 1, key)?[0]),
        type_id::STRING => MetaValue::String(r.string(what)?),
        type_id::ARRAY => MetaValue::Array(read_array(r, key, 1)?),
        _ => return Err(GgufError::UnknownValueType { key: key.to_string(), type_id: ty }),
    })
}

/// Reads an array (element type, count, elements) at nesting level `depth` (1 = outermost).
fn read_array(r: &mut Reader<'_>, key: &str, depth: usize) -> Result<MetaArray, GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep { key: key.to_string(), max: MAX_ARRAY_DEPTH });
    }
    let elem = r.u32(|| format!("key '{key}': array element type"))?;
    let count = r.u64(|| format!("key '{key}': array length"))?;
    let min_size = match elem {
        type_id::U8 | type_id::I8 | type_id::BOOL => 1,
        type_id::U16 | type_id::I16 => 2,
        type_id::U32 | type_id::I32 | type_id::F32 => 4,
        type_id::U64 | type_id::I64 | type_id::F64 | type_id::STRING => 8,
        type_id::ARRAY => 12,
        _ => return Err(GgufError::UnknownValueType { key: key.to_string(), type_id: elem }),
    };
    let n = r.check_count(count, min_size, || format!("key '{key}': {} array length", type_id_name(elem)))?;
    // `n * min_size` fits in the remaining bytes, so it cannot overflow.
    let what = || format!("key '{key}': {} array data", type_id_name(elem));
    Ok(match elem {
        type_id::U8 => MetaArray::U8(r.take(n, what)?.to_vec()),
        type_id::I8 => MetaArray::I8(le_items(r.take(n, what)?, i8::from_le_bytes)),
        type_id::U16 => MetaArray::U16(le_items(r.take(2 * n, what)?, u16::from_le_bytes)),
        type_id::I16 => MetaArray::I16(le_items(r.take(2 * n, what)?, i16::from_le_bytes)),
        type_id::U32 => MetaArray::U32(le_items(r.take(4 * n, what)?, u32::from_le_bytes)),
        type_id::I32 => MetaArray::I32(le_items(r.take(4 * n, what)?, i32::from_le_bytes)),
        type_id::F32 => MetaArray::F32(le_items(r.take(4 * n, what)?, f32::from_le_bytes)),
        type_id::U64 => MetaArray::U64(le_items(r.take(8 * n, what)?, u64::from_le_bytes)),
        type_id::I64 => MetaArray::I64(le_items(r.take(8 * n, what)?, i64::from_le_bytes)),
        type_id::F64 => MetaArray::F64(le_items(r.take(8 * n, what)?, f64::from_le_bytes)),
        type_id::BOOL => MetaArray::Bool(read_bools(r, n, key)?),
        type_id::STRING => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(r.string(|| format!("key '{key}': string element {i}"))?);
            }
            MetaArray::String(v)
        }
        _ => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(r, key, depth + 1)?);
            }
            MetaArray::Array(v)
        }
    })
}

/// The parsed, validated contents of a GGUF file (everything but the bytes).
struct Parsed {
    /// Format version.
    version: u32,
    /// Data alignment.
    alignment: u64,
    /// Metadata in file order.
    metadata: Vec<(String, MetaValue)>,
    /// Key -> index into `metadata`.
    key_index: HashMap<String, usize>,
    /// Tensor infos in file order, with absolute offsets.
    tensors: Vec<TensorInfo>,
    /// Name -> index into `tensors`.
    tensor_index: HashMap<String, usize>,
}

/// Parses and validates a whole GGUF file.
fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut r = Reader { buf, pos: 0 };
    let magic: [u8; 4] = r.bytes(|| "magic".to_string())?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32(|| "version".to_string())?;
    check_version(version)?;
    let n_tensors = r.u64(|| "tensor count".to_string())?;
    let n_kv = r.u64(|| "metadata key/value count".to_string())?;
    let n_kv = r.check_count(n_kv, MIN_KV_BYTES, || "metadata key/value count".to_string())?;
    let n_tensors = r.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, || "tensor count".to_string())?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut key_index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = r.string(|| format!("metadata key #{i}"))?;
        let ty = r.u32(|| format!("key '{key}': value type"))?;
        let value = read_value(&mut r, ty, &key)?;
        if key_index.insert(key.clone(), i).is_some() {
            return Err(GgufError::DuplicateKey { key });
        }
        metadata.push((key, value));
    }
    let alignment = match key_index.get(ALIGNMENT_KEY) {
        Some(&i) => alignment_from(&metadata[i].1)?,
        None => DEFAULT_ALIGNMENT,
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut tensor_index = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(|| format!("tensor #{i} name"))?;
        let n_dims = r.u32(|| format!("tensor '{name}': dimension count"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims { name, n_dims: n_dims.into(), max: MAX_DIMS });
        }
        let dims = (0..n_dims).map(|d| r.u64(|| format!("tensor '{name}': dimension {d}"))).collect::<Result<Vec<u64>, GgufError>>()?;
        let type_id = r.u32(|| format!("tensor '{name}': type"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), type_id })?;
        let offset = r.u64(|| format!("tensor '{name}': data offset"))?;
        let n_bytes = data_size(&name, &dims, ty)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor { name, offset, alignment });
        }
        if tensor_index.insert(name.clone(), i).is_some() {
            return Err(GgufError::DuplicateTensor { name });
        }
        tensors.push(TensorInfo { name, dims, ty, offset, n_bytes });
    }

    // The data section starts at the next multiple of the alignment; offsets are relative to it.
    let data_start = (r.pos as u64).next_multiple_of(alignment);
    let file_len = buf.len() as u64;
    for t in &mut tensors {
        let start = data_start.checked_add(t.offset);
        match start.and_then(|s| s.checked_add(t.n_bytes)) {
            Some(end) if end <= file_len => t.offset += data_start,
            _ => {
                return Err(GgufError::DataOutOfBounds {
                    name: t.name.clone(),
                    offset: start.unwrap_or(u64::MAX),
                    n_bytes: t.n_bytes,
                    file_len,
                })
            }
        }
    }
    Ok(Parsed { version, alignment, metadata, key_index, tensors, tensor_index })
}

/// The bytes of an open file.
enum Storage {
    /// A read-only memory map of the file.
    Mapped(memmap2::Mmap),
    /// Bytes in memory.
    Owned(Vec<u8>),
}

/// An open, validated GGUF file: metadata, tensor infos and (mapped) tensor data.
pub struct GgufFile {
    /// The file bytes.
    storage: Storage,
    /// Everything parsed from them.
    parsed: Parsed,
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |action| move |source| GgufError::Io { action, path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io("open"))?;
        let len = file.metadata().map_err(io("stat"))?.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this handle. As with every mmap-based model
            // loader, the file must not be truncated or rewritten while it is open.
            Storage::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io("map"))?)
        };
        Self::from_storage(storage)
    }

    /// Drops the resident pages of `bytes` (a view of this file's data) from the process's memory
    /// when the file is memory-mapped (the next read faults them back in from the file, unchanged,
    /// one page at a time: the range is marked as read at random, so no read-around maps its
    /// neighbours); returns whether it did. For data read once, e.g. to build a derived copy, and
    /// then only sparsely.
    pub fn release_pages(&self, bytes: &[u8]) -> bool {
        #[cfg(unix)]
        if let Storage::Mapped(m) = &self.storage {
            let (base, start) = (m.as_ptr() as usize, bytes.as_ptr() as usize);
            if start >= base && start + bytes.len() <= base + m.len() {
                // SAFETY: the map is read-only and private and never written, so dropping its pages
                // only makes later reads fault the same file contents back in; every reference into
                // it stays valid because the mapping itself stays.
                let advised = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start - base, bytes.len()) };
                return advised.is_ok() && m.advise_range(memmap2::Advice::Random, start - base, bytes.len()).is_ok();
            }
        }
        false
    }

    /// Validates a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::from_storage(Storage::Owned(bytes))
    }

    /// Parses `storage` and wraps it.
    fn from_storage(storage: Storage) -> Result<GgufFile, GgufError> {
        let parsed = parse(match &storage {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        })?;
        Ok(GgufFile { storage, parsed })
    }

    /// The whole file.
    fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.parsed.version
    }

    /// Data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.parsed.alignment
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.parsed.metadata
    }

    /// The value of metadata key `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.parsed.key_index.get(key).map(|&i| &self.parsed.metadata[i].1)
    }

    /// The value of `key`, or a `MissingKey` error.
    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }

    /// A `WrongType` error for `key`.
    fn wrong_type(key: &str, expected: &'static str, found: &MetaValue) -> GgufError {
        GgufError::WrongType { key: key.to_string(), expected, found: found.type_name() }
    }

    /// The string value of `key`.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong_type(key, "string", v))
    }

    /// The value of `key` as u32: any integer type whose value fits.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.require(key)?;
        let wide = v.as_integer().ok_or_else(|| Self::wrong_type(key, "an integer", v))?;
        u32::try_from(wide).map_err(|_| GgufError::OutOfRange { key: key.to_string(), value: wide, target: "u32" })
    }

    /// The value of `key` as f32 (an F32, or an F64 rounded to f32).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64().map(|x| x as f32).ok_or_else(|| Self::wrong_type(key, "f32 or f64", v))
    }

    /// The bool value of `key`.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong_type(key, "bool", v))
    }

    /// The array value of `key`.
    pub fn get_array(&self, key: &str) -> Result<&MetaArray, GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong_type(key, "array", v))
    }

    /// The model architecture (`general.architecture`).
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.parsed.tensors
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.parsed.tensor_index.get(name).map(|&i| &self.parsed.tensors[i])
    }

    /// The raw data of `t` (validated at open; empty for a `TensorInfo` not describing this file's bytes).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = usize::try_from(t.offset)
            .ok()
            .zip(usize::try_from(t.n_bytes).ok())
            .and_then(|(start, len)| Some(start..start.checked_add(len)?));
        range.and_then(|r| self.bytes().get(r)).unwrap_or(&[])
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.parsed.version)
            .field("alignment", &self.parsed.alignment)
            .field("n_bytes", &self.bytes().len())
            .field("n_metadata", &self.parsed.metadata.len())
            .field("n_tensors", &self.parsed.tensors.len())
            .finish()
    }
}
