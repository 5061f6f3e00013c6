//! Metadata values: [`MetaValue`], [`MetaArray`] and the GGUF value type ids.

/// GGUF value type ids (`gguf_type`).
pub(crate) mod type_id {
    /// u8.
    pub const U8: u32 = 0;
    /// i8.
    pub const I8: u32 = 1;
    /// u16.
    pub const U16: u32 = 2;
    /// i16.
    pub const I16: u32 = 3;
    /// u32.
    pub const U32: u32 = 4;
    /// i32.
    pub const I32: u32 = 5;
    /// f32.
    pub const F32: u32 = 6;
    /// bool (one byte, 0 or 1).
    pub const BOOL: u32 = 7;
    /// u64-length-prefixed UTF-8 string.
    pub const STRING: u32 = 8;
    /// Array: element type id, u64 count, elements.
    pub const ARRAY: u32 = 9;
    /// u64.
    pub const U64: u32 = 10;
    /// i64.
    pub const I64: u32 = 11;
    /// f64.
    pub const F64: u32 = 12;
}

/// Deepest array nesting accepted (an array of arrays is depth 2).
pub(crate) const MAX_ARRAY_DEPTH: usize = 8;

/// A typed metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Unsigned 8-bit integer.
    U8(u8),
    /// Signed 8-bit integer.
    I8(i8),
    /// Unsigned 16-bit integer.
    U16(u16),
    /// Signed 16-bit integer.
    I16(i16),
    /// Unsigned 32-bit integer.
    U32(u32),
    /// Signed 32-bit integer.
    I32(i32),
    /// 32-bit float.
    F32(f32),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values of one type.
    Array(MetaArray),
    /// Unsigned 64-bit integer.
    U64(u64),
    /// Signed 64-bit integer.
    I64(i64),
    /// 64-bit float.
    F64(f64),
}

/// A homogeneous metadata array.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    /// u8 elements.
    U8(Vec<u8>),
    /// i8 elements.
    I8(Vec<i8>),
    /// u16 elements.
    U16(Vec<u16>),
    /// i16 elements.
    I16(Vec<i16>),
    /// u32 elements.
    U32(Vec<u32>),
    /// i32 elements.
    I32(Vec<i32>),
    /// f32 elements.
    F32(Vec<f32>),
    /// bool elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// Nested arrays (each may have its own element type).
    Array(Vec<MetaArray>),
    /// u64 elements.
    U64(Vec<u64>),
    /// i64 elements.
    I64(Vec<i64>),
    /// f64 elements.
    F64(Vec<f64>),
}

/// The name of a GGUF value type id, as used in messages and summaries.
pub(crate) fn type_id_name(id: u32) -> &'static str {
    match id {
        type_id::U8 => "u8",
        type_id::I8 => "i8",
        type_id::U16 => "u16",
        type_id::I16 => "i16",
        type_id::U32 => "u32",
        type_id::I32 => "i32",
        type_id::F32 => "f32",
        type_id::BOOL => "bool",
        type_id::STRING => "string",
        type_id::ARRAY => "array",
        type_id::U64 => "u64",
        type_id::I64 => "i64",
        type_id::F64 => "f64",
        _ => "unknown",
    }
}

impl MetaValue {
    /// The GGUF type id of this value.
    pub(crate) fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => type_id::U8,
            MetaValue::I8(_) => type_id::I8,
            MetaValue::U16(_) => type_id::U16,
            MetaValue::I16(_) => type_id::I16,
            MetaValue::U32(_) => type_id::U32,
            MetaValue::I32(_) => type_id::I32,
            MetaValue::F32(_) => type_id::F32,
            MetaValue::Bool(_) => type_id::BOOL,
            MetaValue::String(_) => type_id::STRING,
            MetaValue::Array(_) => type_id::ARRAY,
            MetaValue::U64(_) => type_id::U64,
            MetaValue::I64(_) => type_id::I64,
            MetaValue::F64(_) => type_id::F64,
        }
    }

    /// The type name: "u8", "i32", "f32", "bool", "string", "array", ...
    pub fn type_name(&self) -> &'static str {
        type_id_name(self.type_id())
    }

    /// The value of any integer type, widened.
    pub(crate) fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value of any integer type that fits in u64.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_integer().and_then(|v| u64::try_from(v).ok())
    }

    /// The value of any integer type that fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_integer().and_then(|v| i64::try_from(v).ok())
    }

    /// The value of an F32 or F64, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a Bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a String.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value of an Array.
    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A one-line rendering: numbers as is, strings quoted, arrays as
    /// `[string; 262144] ["<pad>", "<eos>", ...]` with at most `max_items` elements shown.
    pub fn summary(&self, max_items: usize) -> String {
        match self {
            MetaValue::U8(v) => v.to_string(),
            MetaValue::I8(v) => v.to_string(),
            MetaValue::U16(v) => v.to_string(),
            MetaValue::I16(v) => v.to_string(),
            MetaValue::U32(v) => v.to_string(),
            MetaValue::I32(v) => v.to_string(),
            MetaValue::F32(v) => v.to_string(),
            MetaValue::Bool(v) => v.to_string(),
            MetaValue::String(s) => format!("{s:?}"),
            MetaValue::Array(a) => a.summary(max_items),
            MetaValue::U64(v) => v.to_string(),
            MetaValue::I64(v) => v.to_string(),
            MetaValue::F64(v) => v.to_string(),
        }
    }
}

/// Renders the first `max` items of `items` joined by ", ", with ", ..." when some are left out.
fn join_items<T>(items: &[T], max: usize, render: impl Fn(&T) -> String) -> String {
    let shown: Vec<String> = items.iter().take(max).map(render).collect();
    let mut out = shown.join(", ");
    if items.len() > max {
        out.push_str(if max == 0 { "..." } else { ", ..." });
    }
    out
}

impl MetaArray {
    /// The GGUF type id of the elements.
    pub(crate) fn elem_type_id(&self) -> u32 {
        match self {
            MetaArray::U8(_) => type_id::U8,
            MetaArray::I8(_) => type_id::I8,
            MetaArray::U16(_) => type_id::U16,
            MetaArray::I16(_) => type_id::I16,
            MetaArray::U32(_) => type_id::U32,
            MetaArray::I32(_) => type_id::I32,
            MetaArray::F32(_) => type_id::F32,
            MetaArray::Bool(_) => type_id::BOOL,
            MetaArray::String(_) => type_id::STRING,
            MetaArray::Array(_) => type_id::ARRAY,
            MetaArray::U64(_) => type_id::U64,
            MetaArray::I64(_) => type_id::I64,
            MetaArray::F64(_) => type_id::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type name: "u8", ..., "string", "array".
    pub fn type_name(&self) -> &'static str {
        type_id_name(self.elem_type_id())
    }

    /// Nesting depth: 1 for an array of scalars, 1 + the deepest element for an array of arrays.
    pub(crate) fn depth(&self) -> usize {
        match self {
            MetaArray::Array(v) => 1 + v.iter().map(MetaArray::depth).max().unwrap_or(0),
            _ => 1,
        }
    }

    /// The elements of a string array.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            MetaArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of an f32 array.
    pub fn as_f32s(&self) -> Option<&[f32]> {
        match self {
            MetaArray::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of an i32 array.
    pub fn as_i32s(&self) -> Option<&[i32]> {
        match self {
            MetaArray::I32(v) => Some(v),
            _ => None,
        }
    }

    /// A one-line rendering, `[type; len] [item, item, ...]`, showing at most `max_items` elements.
    pub fn summary(&self, max_items: usize) -> String {
        let items = match self {
            MetaArray::U8(v) => join_items(v, max_items, u8::to_string),
            MetaArray::I8(v) => join_items(v, max_items, i8::to_string),
            MetaArray::U16(v) => join_items(v, max_items, u16::to_string),
            MetaArray::I16(v) => join_items(v, max_items, i16::to_string),
            MetaArray::U32(v) => join_items(v, max_items, u32::to_string),
            MetaArray::I32(v) => join_items(v, max_items, i32::to_string),
            MetaArray::F32(v) => join_items(v, max_items, f32::to_string),
            MetaArray::Bool(v) => join_items(v, max_items, bool::to_string),
            MetaArray::String(v) => join_items(v, max_items, |s| format!("{s:?}")),
            MetaArray::Array(v) => join_items(v, max_items, |a| a.summary(max_items)),
            MetaArray::U64(v) => join_items(v, max_items, u64::to_string),
            MetaArray::I64(v) => join_items(v, max_items, i64::to_string),
            MetaArray::F64(v) => join_items(v, max_items, f64::to_string),
        };
        format!("[{}; {}] [{}]", self.type_name(), self.len(), items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_accessors_widen_and_check_range() {
        assert_eq!(MetaValue::U8(7).as_u64(), Some(7));
        assert_eq!(MetaValue::I32(-1).as_u64(), None);
        assert_eq!(MetaValue::I32(-1).as_i64(), Some(-1));
        assert_eq!(MetaValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(MetaValue::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(MetaValue::F32(1.0).as_u64(), None);
        assert_eq!(MetaValue::F32(1.5).as_f64(), Some(1.5));
        assert_eq!(MetaValue::U32(1).as_f64(), None);
        assert_eq!(MetaValue::Bool(true).as_bool(), Some(true));
        assert_eq!(MetaValue::String("x".into()).as_str(), Some("x"));
    }

    #[test]
    fn summaries() {
        let tokens = MetaValue::Array(MetaArray::String(vec!["<pad>".into(), "<eos>".into(), "<bos>".into()]));
        assert_eq!(tokens.summary(2), r#"[string; 3] ["<pad>", "<eos>", ...]"#);
        assert_eq!(tokens.summary(3), r#"[string; 3] ["<pad>", "<eos>", "<bos>"]"#);
        assert_eq!(tokens.summary(0), "[string; 3] [...]");
        assert_eq!(MetaValue::Array(MetaArray::U8(vec![])).summary(4), "[u8; 0] []");
        let nested = MetaArray::Array(vec![MetaArray::I32(vec![1, -2]), MetaArray::F32(vec![0.5])]);
        assert_eq!(nested.summary(4), "[array; 2] [[i32; 2] [1, -2], [f32; 1] [0.5]]");
        assert_eq!(nested.depth(), 2);
        assert_eq!(MetaValue::String("a\"b".into()).summary(1), r#""a\"b""#);
        assert_eq!(MetaValue::F32(1e-6).summary(1), "0.000001");
        assert_eq!(MetaValue::I64(-3).type_name(), "i64");
        assert_eq!(tokens.as_array().map(MetaArray::type_name), Some("string"));
    }
}
