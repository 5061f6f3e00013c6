//! Writer -> reader round trips of every metadata type (nested arrays included), v2 and v3, and
//! the typed accessors and writer validation.

use kiln_gguf::{GgufError, GgufFile, GgufWriter, MetaArray, MetaValue};
use kiln_quant::{quantize, GgmlType};

/// One metadata entry of every scalar type, every array element type, and nested arrays.
fn all_metadata() -> Vec<(String, MetaValue)> {
    let s = |x: &str| x.to_string();
    vec![
        (s("general.architecture"), MetaValue::String(s("test-arch"))),
        (s("t.u8"), MetaValue::U8(250)),
        (s("t.i8"), MetaValue::I8(-120)),
        (s("t.u16"), MetaValue::U16(65_000)),
        (s("t.i16"), MetaValue::I16(-32_000)),
        (s("t.u32"), MetaValue::U32(4_000_000_000)),
        (s("t.i32"), MetaValue::I32(-2_000_000_000)),
        (s("t.f32"), MetaValue::F32(-1.5e-7)),
        (s("t.bool_true"), MetaValue::Bool(true)),
        (s("t.bool_false"), MetaValue::Bool(false)),
        (s("t.string_empty"), MetaValue::String(String::new())),
        (s("t.string_unicode"), MetaValue::String(s("héllo ▁wörld 🦀\n\t\"q\""))),
        (s("t.u64"), MetaValue::U64(u64::MAX)),
        (s("t.i64"), MetaValue::I64(i64::MIN)),
        (s("t.f64"), MetaValue::F64(std::f64::consts::PI)),
        (s("a.u8"), MetaValue::Array(MetaArray::U8(vec![0, 1, 255]))),
        (s("a.i8"), MetaValue::Array(MetaArray::I8(vec![-128, 0, 127]))),
        (s("a.u16"), MetaValue::Array(MetaArray::U16(vec![1, 65_535]))),
        (s("a.i16"), MetaValue::Array(MetaArray::I16(vec![-1, i16::MIN]))),
        (s("a.u32"), MetaValue::Array(MetaArray::U32(vec![7, u32::MAX]))),
        (s("a.i32"), MetaValue::Array(MetaArray::I32(vec![-7, i32::MAX, 0]))),
        (s("a.f32"), MetaValue::Array(MetaArray::F32(vec![0.5, -0.0, f32::INFINITY, 1e-40]))),
        (s("a.bool"), MetaValue::Array(MetaArray::Bool(vec![true, false, true]))),
        (s("a.string"), MetaValue::Array(MetaArray::String(vec![s("a"), s(""), s("ünï")]))),
        (s("a.u64"), MetaValue::Array(MetaArray::U64(vec![u64::MAX, 0]))),
        (s("a.i64"), MetaValue::Array(MetaArray::I64(vec![i64::MIN, -1]))),
        (s("a.f64"), MetaValue::Array(MetaArray::F64(vec![1e300, -2.5]))),
        (s("a.empty"), MetaValue::Array(MetaArray::F32(vec![]))),
        (
            s("a.nested"),
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::I32(vec![1, 2, 3]),
                MetaArray::String(vec![s("x"), s("yz")]),
                MetaArray::Array(vec![MetaArray::Bool(vec![true]), MetaArray::Array(vec![])]),
                MetaArray::U8(vec![]),
            ])),
        ),
    ]
}

/// Tensors of several types, with data from the quantizers.
fn all_tensors() -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let x: Vec<f32> = (0..1024).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
    vec![
        ("norm.weight".into(), vec![64], GgmlType::F32, quantize(GgmlType::F32, &x[..64]).unwrap()),
        ("w.f16".into(), vec![16, 3], GgmlType::F16, quantize(GgmlType::F16, &x[..48]).unwrap()),
        ("w.q8_0".into(), vec![64, 2], GgmlType::Q8_0, quantize(GgmlType::Q8_0, &x[..128]).unwrap()),
        ("w.q4_k".into(), vec![256, 2, 2], GgmlType::Q4_K, quantize(GgmlType::Q4_K, &x).unwrap()),
        ("w.q6_k".into(), vec![256, 1, 1, 1], GgmlType::Q6_K, quantize(GgmlType::Q6_K, &x[..256]).unwrap()),
        ("scalar".into(), vec![], GgmlType::I32, 7i32.to_le_bytes().to_vec()),
        ("empty".into(), vec![32, 0], GgmlType::Q5_0, vec![]),
        ("w.iq2_xxs".into(), vec![256], GgmlType::IQ2_XXS, vec![0xab; 66]),
    ]
}

fn build(version: u32, extra: &[(String, MetaValue)]) -> GgufWriter {
    let mut w = GgufWriter::new(version).unwrap();
    for (k, v) in all_metadata().into_iter().chain(extra.iter().cloned()) {
        w.add_metadata(k, v).unwrap();
    }
    for (name, dims, ty, data) in all_tensors() {
        w.add_tensor(name, &dims, ty, data).unwrap();
    }
    w
}

fn check_round_trip(f: &GgufFile, version: u32, alignment: u64) {
    assert_eq!(f.version(), version);
    assert_eq!(f.alignment(), alignment);
    let meta = all_metadata();
    assert_eq!(&f.metadata()[..meta.len()], &meta[..]);
    for (k, v) in &meta {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    let tensors = all_tensors();
    assert_eq!(f.tensors().len(), tensors.len());
    for (t, (name, dims, ty, data)) in f.tensors().iter().zip(&tensors) {
        assert_eq!((&t.name, &t.dims, t.ty), (name, dims, *ty));
        assert_eq!(f.tensor_data(t), &data[..], "{name}");
        assert_eq!(t.offset % alignment, 0, "{name}");
        assert_eq!(f.tensor(name), Some(t));
    }
}

#[test]
fn every_type_round_trips_v3_and_v2() {
    for version in [2, 3] {
        let bytes = build(version, &[]).to_bytes();
        let f = GgufFile::from_bytes(bytes).unwrap();
        check_round_trip(&f, version, 32);
    }
}

#[test]
fn custom_alignment_round_trips() {
    for alignment in [1u32, 8, 64, 4096] {
        let w = build(3, &[("general.alignment".into(), MetaValue::U32(alignment))]);
        let bytes = w.to_bytes();
        let f = GgufFile::from_bytes(bytes).unwrap();
        check_round_trip(&f, 3, alignment.into());
    }
}

#[test]
fn write_to_disk_and_open_mapped() {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    build(3, &[]).write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    check_round_trip(&f, 3, 32);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "temporary file left behind");
    // Overwriting an existing file works too.
    build(2, &[]).write(&path).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap().version(), 2);
    let e = build(3, &[]).write(&dir.join("no/such/dir/x.gguf")).unwrap_err().to_string();
    assert!(e.starts_with("cannot write '") && e.contains("no/such/dir/x.gguf.tmp."), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    let e = GgufFile::open(&dir.join("missing.gguf")).unwrap_err().to_string();
    assert!(e.starts_with("cannot open '") && e.contains("missing.gguf"), "{e}");
}

#[test]
fn typed_accessors() {
    let f = GgufFile::from_bytes(build(3, &[]).to_bytes()).unwrap();
    assert_eq!(f.architecture().unwrap(), "test-arch");
    assert_eq!(f.get_u32("t.u8").unwrap(), 250);
    assert_eq!(f.get_u32("t.i16").unwrap_err().to_string(), "metadata key 't.i16': value -32000 does not fit in u32");
    assert_eq!(f.get_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_u32("t.u64").unwrap_err().to_string(), format!("metadata key 't.u64': value {} does not fit in u32", u64::MAX));
    assert_eq!(f.get_u32("t.f32").unwrap_err().to_string(), "metadata key 't.f32': expected an integer, found f32");
    assert_eq!(f.get_f32("t.f32").unwrap(), -1.5e-7);
    assert_eq!(f.get_f32("t.f64").unwrap(), std::f32::consts::PI);
    assert_eq!(f.get_f32("t.u8").unwrap_err().to_string(), "metadata key 't.u8': expected f32 or f64, found u8");
    assert!(f.get_bool("t.bool_true").unwrap());
    assert_eq!(f.get_bool("t.u8").unwrap_err().to_string(), "metadata key 't.u8': expected bool, found u8");
    assert_eq!(f.get_str("t.string_unicode").unwrap(), "héllo ▁wörld 🦀\n\t\"q\"");
    let a = f.get_array("a.string").unwrap();
    assert_eq!((a.len(), a.is_empty(), a.type_name()), (3, false, "string"));
    assert_eq!(a.as_strings().unwrap()[2], "ünï");
    assert!(a.as_f32s().is_none());
    assert!(f.get_array("a.empty").unwrap().is_empty());
    assert_eq!(f.get_array("a.i32").unwrap().as_i32s().unwrap(), &[-7, i32::MAX, 0]);
    assert_eq!(f.get_array("t.u8").unwrap_err().to_string(), "metadata key 't.u8': expected array, found u8");
    assert_eq!(f.get("a.nested").unwrap().summary(2), r#"[array; 4] [[i32; 3] [1, 2, ...], [string; 2] ["x", "yz"], ...]"#);
    let e = f.get_str("absent").unwrap_err();
    assert!(matches!(e, GgufError::MissingKey { .. }));
    let scalar = f.tensor("scalar").unwrap();
    assert_eq!((scalar.n_elements(), scalar.row_len(), scalar.n_rows()), (1, 1, 1));
    let q4k = f.tensor("w.q4_k").unwrap();
    assert_eq!((q4k.n_elements(), q4k.row_len(), q4k.n_rows(), q4k.n_bytes), (1024, 256, 4, 576));
}

#[test]
fn writer_rejects_invalid_input() {
    let e = GgufWriter::new(1).err().unwrap().to_string();
    assert_eq!(e, "unsupported GGUF version 1: the writer produces versions 2 and 3 only");
    let mut w = GgufWriter::new(3).unwrap();
    w.add_metadata("k", MetaValue::U8(1)).unwrap();
    assert_eq!(w.add_metadata("k", MetaValue::U8(2)).unwrap_err().to_string(), "duplicate metadata key 'k'");
    for bad in [MetaValue::U32(0), MetaValue::U32(48), MetaValue::String("32".into()), MetaValue::U64(1 << 33)] {
        let e = w.add_metadata("general.alignment", bad).unwrap_err().to_string();
        assert!(e.starts_with("key 'general.alignment': must be a nonzero power of two (u32), got"), "{e}");
    }
    // The reader accepts any integer type for the alignment, but llama.cpp needs u32.
    let e = w.add_metadata("general.alignment", MetaValue::U64(64)).unwrap_err().to_string();
    assert_eq!(e, "key 'general.alignment': must be a nonzero power of two (u32), got 64 (u64)");
    let e = w.write(std::path::Path::new("/")).unwrap_err().to_string();
    assert!(e.starts_with("cannot write '/'"), "{e}");
    let mut deep = MetaArray::U8(vec![1]);
    for _ in 0..8 {
        deep = MetaArray::Array(vec![deep]);
    }
    let e = w.add_metadata("deep", MetaValue::Array(deep)).unwrap_err().to_string();
    assert_eq!(e, "key 'deep': arrays nested more than 8 levels deep");

    w.add_tensor("t", &[32], GgmlType::Q8_0, vec![0; 34]).unwrap();
    assert_eq!(w.add_tensor("t", &[32], GgmlType::Q8_0, vec![0; 34]).unwrap_err().to_string(), "duplicate tensor name 't'");
    let e = w.add_tensor("u", &[32, 2], GgmlType::Q8_0, vec![0; 34]).unwrap_err().to_string();
    assert_eq!(e, "tensor 'u': 34 bytes of data given, but Q8_0 [32, 2] takes 68 bytes");
    let e = w.add_tensor("v", &[33], GgmlType::Q8_0, vec![]).unwrap_err().to_string();
    assert_eq!(e, "tensor 'v': row length 33 is not a multiple of the Q8_0 block size 32");
    let e = w.add_tensor("x", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]).unwrap_err().to_string();
    assert_eq!(e, "tensor 'x': 5 dimensions, at most 4 are supported");
    // Rejected entries leave the writer usable and unchanged.
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!((f.metadata().len(), f.tensors().len()), (1, 1));
}

#[test]
fn empty_file_round_trips() {
    for version in [2, 3] {
        let f = GgufFile::from_bytes(GgufWriter::new(version).unwrap().to_bytes()).unwrap();
        assert_eq!((f.version(), f.metadata().len(), f.tensors().len()), (version, 0, 0));
        assert!(matches!(f.architecture(), Err(GgufError::MissingKey { .. })));
    }
}
