//! Hostile and malformed files: every one is rejected with an error naming the problem, never a panic
//! or an allocation sized by an unchecked header field.

use kiln_gguf::{GgufError, GgufFile, GgufWriter, MetaArray, MetaValue};
use kiln_quant::GgmlType;

/// A hand-assembled GGUF byte stream.
struct Raw(Vec<u8>);

impl Raw {
    /// Magic, version, tensor count and key/value count.
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }
    fn u8(mut self, v: u8) -> Raw {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Raw {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Raw {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A u32 metadata entry.
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(4).u32(v)
    }
    /// A tensor info.
    fn tensor(self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(type_id).u64(offset)
    }
    /// Zero padding up to a multiple of 32, then `n` data bytes.
    fn data(mut self, n: usize) -> Raw {
        self.0.resize(self.0.len().next_multiple_of(32) + n, 0);
        self
    }
    fn open(self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(self.0)
    }
    fn err(self) -> String {
        self.open().unwrap_err().to_string()
    }
}

/// A small valid file with varied metadata and three tensors whose data ends exactly at EOF.
fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new(3).unwrap();
    w.add_metadata("general.architecture", MetaValue::String("tiny".into())).unwrap();
    w.add_metadata("tiny.block_count", MetaValue::U32(2)).unwrap();
    w.add_metadata("tiny.eps", MetaValue::F64(1e-6)).unwrap();
    w.add_metadata("tiny.flag", MetaValue::Bool(true)).unwrap();
    let tokens = MetaArray::String(vec!["<pad>".into(), "a".into(), "bc".into()]);
    w.add_metadata("tokenizer.ggml.tokens", MetaValue::Array(tokens)).unwrap();
    w.add_metadata("tokenizer.ggml.scores", MetaValue::Array(MetaArray::F32(vec![0.0, -1.0, -2.0]))).unwrap();
    let nested = MetaArray::Array(vec![MetaArray::I16(vec![1, 2]), MetaArray::String(vec!["x".into()])]);
    w.add_metadata("tiny.nested", MetaValue::Array(nested)).unwrap();
    w.add_tensor("norm", &[8], GgmlType::F32, vec![1; 32]).unwrap();
    w.add_tensor("w.q8", &[32, 2], GgmlType::Q8_0, vec![2; 68]).unwrap();
    w.add_tensor("w.f16", &[16], GgmlType::F16, vec![3; 32]).unwrap();
    w.to_bytes()
}

#[test]
fn truncation_at_every_length_is_an_error() {
    let bytes = small_valid_file();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let last = f.tensors().last().unwrap();
    assert_eq!(last.offset + last.n_bytes, bytes.len() as u64, "no trailing padding");
    let data_start = f.tensors()[0].offset as usize;
    for len in 0..bytes.len() {
        let e = GgufFile::from_bytes(bytes[..len].to_vec()).unwrap_err();
        let msg = e.to_string();
        if len < data_start - 32 {
            // Cut inside the header, metadata or tensor infos.
            assert!(matches!(e, GgufError::Truncated { .. } | GgufError::CountTooLarge { .. }), "cut at {len}: {msg}");
        } else if len >= data_start {
            assert!(matches!(e, GgufError::DataOutOfBounds { .. }), "cut at {len}: {msg}");
            assert!(msg.contains(&format!("extends past end of file ({len} bytes)")), "{msg}");
        }
    }
    let e = GgufFile::from_bytes(bytes[..2].to_vec()).unwrap_err().to_string();
    assert_eq!(e, "truncated file: magic at offset 0 needs 4 bytes, but only 2 remain");
    let e = GgufFile::from_bytes(Vec::new()).unwrap_err().to_string();
    assert_eq!(e, "truncated file: magic at offset 0 needs 4 bytes, but only 0 remain");
}

#[test]
fn random_corruption_never_panics() {
    let bytes = small_valid_file();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let header_len = GgufFile::from_bytes(bytes.clone()).unwrap().tensors()[0].offset as usize;
    let (mut ok, mut err) = (0, 0);
    for _ in 0..20_000 {
        let mut b = bytes.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % header_len as u64) as usize;
            b[i] = match next() % 4 {
                0 => 0xff,
                1 => 0,
                2 => b[i] ^ (1 << (next() % 8)),
                _ => next() as u8,
            };
        }
        if next() % 8 == 0 {
            b.truncate((next() % b.len() as u64) as usize);
        }
        match GgufFile::from_bytes(b) {
            Ok(f) => {
                ok += 1;
                for t in f.tensors() {
                    assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
                }
            }
            Err(e) => {
                err += 1;
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(err > 10_000 && ok > 0, "ok {ok}, err {err}");
}

#[test]
fn bad_magic() {
    let mut b = small_valid_file();
    b[..4].copy_from_slice(b"GGML");
    let e = GgufFile::from_bytes(b).unwrap_err().to_string();
    assert_eq!(e, "not a GGUF file: magic bytes are [47, 47, 4d, 4c], expected \"GGUF\" [47, 47, 55, 46]");
}

#[test]
fn unsupported_versions() {
    let e = Raw::header(1, 0, 0).err();
    assert!(e.starts_with("unsupported GGUF version 1: version 1 is the obsolete"), "{e}");
    let e = Raw::header(4, 0, 0).err();
    assert_eq!(e, "unsupported GGUF version 4: only versions 2 and 3 are supported");
    let e = Raw::header(0, 0, 0).err();
    assert_eq!(e, "unsupported GGUF version 0: only versions 2 and 3 are supported");
    let e = Raw::header(3u32.swap_bytes(), 0, 0).err();
    assert!(e.contains("version 50331648") && e.contains("big-endian"), "{e}");
    assert!(Raw::header(2, 0, 0).open().is_ok());
    assert!(Raw::header(3, 0, 0).open().is_ok());
}

#[test]
fn unknown_tensor_type() {
    let e = Raw::header(3, 1, 0).tensor("blk.0.w", &[32], 99, 0).data(64).err();
    assert_eq!(e, "tensor 'blk.0.w': unknown ggml type id 99");
    let e = Raw::header(3, 1, 0).tensor("old", &[32], 4, 0).data(64).err();
    assert_eq!(e, "tensor 'old': unknown ggml type id 4");
}

#[test]
fn absurd_counts_are_rejected_before_allocating() {
    let e = Raw::header(3, 1 << 60, 0).err();
    assert_eq!(e, "tensor count is 1152921504606846976, but the 0 bytes left at offset 24 can hold at most 0");
    let e = Raw::header(3, 0, 1 << 60).kv_u32("a", 1).err();
    assert!(e.starts_with("metadata key/value count is 1152921504606846976, but the 17 bytes left"), "{e}");
    // Array of 2^62 u8, u64 and strings.
    for (elem, name) in [(0u32, "u8"), (10, "u64"), (8, "string"), (9, "array")] {
        let e = Raw::header(3, 0, 1).str("arr").u32(9).u32(elem).u64(1 << 62).bytes(&[0; 40]).err();
        assert!(e.starts_with(&format!("key 'arr': {name} array length is 4611686018427387904, but the 40 bytes left")), "{e}");
    }
    // String value of length 2^63.
    let e = Raw::header(3, 0, 1).str("s").u32(8).u64(1 << 63).bytes(b"abc").err();
    assert_eq!(
        e,
        "truncated file: key 's': string value (9223372036854775808-byte string) at offset 45 \
         needs 9223372036854775808 bytes, but only 3 remain"
    );
    // Key and tensor name lengths of 2^63.
    let e = Raw::header(3, 0, 1).u64(1 << 63).bytes(&[0; 20]).err();
    assert!(e.starts_with("truncated file: metadata key #0 (9223372036854775808-byte string)"), "{e}");
    let e = Raw::header(3, 1, 0).u64(u64::MAX).bytes(&[0; 30]).err();
    assert!(e.starts_with("truncated file: tensor #0 name (18446744073709551615-byte string)"), "{e}");
    // A string element of a string array.
    let e = Raw::header(3, 0, 1).str("toks").u32(9).u32(8).u64(2).str("ok").u64(1 << 63).err();
    assert!(e.starts_with("truncated file: key 'toks': string element 1 (9223372036854775808-byte string)"), "{e}");
    // Dimension count and dimensions.
    let e = Raw::header(3, 1, 0).str("w").u32(u32::MAX).bytes(&[0; 64]).err();
    assert_eq!(e, "tensor 'w': 4294967295 dimensions, at most 4 are supported");
    let e = Raw::header(3, 1, 0).tensor("w", &[1 << 40, 1 << 40], 0, 0).err();
    assert_eq!(e, "tensor 'w': element count of dimensions [1099511627776, 1099511627776] overflows");
    let e = Raw::header(3, 1, 0).tensor("w", &[u64::MAX], 0, 0).err();
    assert!(e.starts_with("tensor 'w': dimension 0 is 18446744073709551615"), "{e}");
}

#[test]
fn data_past_end_of_file() {
    let e = Raw::header(3, 1, 0).tensor("blk.0.attn_q.weight", &[64], 0, 1 << 40).data(256).err();
    assert_eq!(e, "tensor 'blk.0.attn_q.weight': data [offset 1099511627872, 256 bytes] extends past end of file (352 bytes)");
    // Partly inside the file.
    let e = Raw::header(3, 1, 0).tensor("w", &[64], 0, 0).data(255).err();
    assert_eq!(e, "tensor 'w': data [offset 64, 256 bytes] extends past end of file (319 bytes)");
    // Offset + size overflows u64.
    let e = Raw::header(3, 1, 0).tensor("w", &[64], 0, u64::MAX - 31).data(256).err();
    assert_eq!(e, format!("tensor 'w': data [offset {}, 256 bytes] extends past end of file (320 bytes)", u64::MAX));
    // Exactly fitting is fine, and a zero-byte tensor at the end of the file too.
    assert!(Raw::header(3, 1, 0).tensor("w", &[64], 0, 0).data(256).open().is_ok());
    assert!(Raw::header(3, 1, 0).tensor("w", &[64, 0], 0, 0).data(0).open().is_ok());
}

#[test]
fn misaligned_offset() {
    let e = Raw::header(3, 1, 0).tensor("w", &[4], 0, 7).data(64).err();
    assert_eq!(e, "tensor 'w': data offset 7 is not a multiple of the alignment 32");
    // With general.alignment = 8, offset 8 is fine and 12 is not.
    let ok = Raw::header(3, 1, 1).kv_u32("general.alignment", 8).tensor("w", &[4], 0, 8).data(64).open().unwrap();
    assert_eq!(ok.alignment(), 8);
    let e = Raw::header(3, 1, 1).kv_u32("general.alignment", 8).tensor("w", &[4], 0, 12).data(64).err();
    assert_eq!(e, "tensor 'w': data offset 12 is not a multiple of the alignment 8");
}

#[test]
fn bad_alignment_values() {
    for (v, shown) in [(0u32, "0 (u32)"), (3, "3 (u32)"), (48, "48 (u32)")] {
        let e = Raw::header(3, 0, 1).kv_u32("general.alignment", v).err();
        assert_eq!(e, format!("key 'general.alignment': must be a nonzero power of two (u32), got {shown}"));
    }
    let e = Raw::header(3, 0, 1).str("general.alignment").u32(8).str("32").err();
    assert_eq!(e, "key 'general.alignment': must be a nonzero power of two (u32), got \"32\" (string)");
    let e = Raw::header(3, 0, 1).str("general.alignment").u32(10).u64(1 << 33).err();
    assert_eq!(e, "key 'general.alignment': must be a nonzero power of two (u32), got 8589934592 (u64)");
    let e = Raw::header(3, 0, 1).str("general.alignment").u32(5).u32(-32i32 as u32).err();
    assert!(e.contains("got -32 (i32)"), "{e}");
}

#[test]
fn duplicate_names() {
    let e = Raw::header(3, 0, 2).kv_u32("a.b", 1).kv_u32("a.b", 2).err();
    assert_eq!(e, "duplicate metadata key 'a.b'");
    let e = Raw::header(3, 2, 0).tensor("w", &[8], 0, 0).tensor("w", &[8], 0, 32).data(64).err();
    assert_eq!(e, "duplicate tensor name 'w'");
}

#[test]
fn bad_values() {
    let e = Raw::header(3, 0, 1).str("k").u32(13).u32(0).err();
    assert_eq!(e, "key 'k': unknown value type id 13");
    let e = Raw::header(3, 0, 1).str("k").u32(9).u32(99).u64(1).u32(0).err();
    assert_eq!(e, "key 'k': unknown value type id 99");
    let e = Raw::header(3, 0, 1).str("flag").u32(7).u8(2).err();
    assert_eq!(e, "key 'flag': invalid bool byte 2 at offset 40 (must be 0 or 1)");
    let e = Raw::header(3, 0, 1).str("flags").u32(9).u32(7).u64(3).bytes(&[1, 0, 7]).err();
    assert_eq!(e, "key 'flags': invalid bool byte 7 at offset 55 (must be 0 or 1)");
    let e = Raw::header(3, 0, 1).u64(2).bytes(&[0xc3, 0x28]).u32(4).u32(0).err();
    assert_eq!(e, "metadata key #0 at offset 32 is not valid UTF-8");
    let e = Raw::header(3, 0, 1).str("s").u32(8).u64(1).u8(0xff).err();
    assert_eq!(e, "key 's': string value at offset 45 is not valid UTF-8");
    let e = Raw::header(3, 1, 0).u64(1).u8(0x80).u32(1).u64(8).u32(0).u64(0).data(32).err();
    assert_eq!(e, "tensor #0 name at offset 32 is not valid UTF-8");
    // Nine levels of nested arrays.
    let mut r = Raw::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..9 {
        r = r.u32(9).u64(1);
    }
    let e = r.u32(0).u64(0).err();
    assert_eq!(e, "key 'deep': arrays nested more than 8 levels deep");
    // Eight levels are fine.
    let mut r = Raw::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..7 {
        r = r.u32(9).u64(1);
    }
    assert!(r.u32(0).u64(0).open().is_ok());
}

#[test]
fn row_length_not_a_multiple_of_the_block_size() {
    let e = Raw::header(3, 1, 0).tensor("w", &[100, 2], GgmlType::Q4_K.id(), 0).data(1024).err();
    assert_eq!(e, "tensor 'w': row length 100 is not a multiple of the Q4_K block size 256");
}
