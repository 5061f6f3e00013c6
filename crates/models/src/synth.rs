//! Synthetic Gemma 3 models: random-weight GGUF files of any Gemma 3 shape, in a Q4_K_M-like mix
//! of block formats, so speed can be measured where no real weights exist. Quantized blocks are
//! written directly as random bytes with sane random scales (never zero); no float quantizer runs
//! over billions of values.

use std::path::Path;

use kiln_gguf::{GgufError, GgufWriter, MetaArray, MetaValue};
use kiln_quant::GgmlType;

/// splitmix64: reproducible random numbers.
#[derive(Clone, Debug)]
pub struct SynthRng(pub u64);

impl SynthRng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Random sign, magnitude uniform in [0.2·a, a]: never zero.
    pub fn weight(&mut self, a: f32) -> f32 {
        let m = a * (0.2 + 0.8 * self.unit());
        if self.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }

    /// Fills `out` with random bytes.
    pub fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// One tensor of a synthetic model.
#[derive(Clone, Debug)]
pub struct SynthTensor {
    /// Tensor name.
    pub name: String,
    /// ggml order: dims[0] is the row length.
    pub dims: Vec<u64>,
    /// Block format.
    pub ty: GgmlType,
    /// Packed bytes.
    pub data: Vec<u8>,
}

/// The contents of a model file, editable before it is written.
#[derive(Clone, Debug, Default)]
pub struct SynthModel {
    /// Metadata key/values in file order.
    pub meta: Vec<(String, MetaValue)>,
    /// Tensors in file order.
    pub tensors: Vec<SynthTensor>,
}

impl SynthModel {
    /// Sets (or adds) a metadata value.
    pub fn set_meta(&mut self, key: &str, value: MetaValue) {
        match self.meta.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.meta.push((key.to_string(), value)),
        }
    }

    /// Writes the model as a GGUF v3 file.
    pub fn write(&self, path: &Path) -> Result<(), GgufError> {
        let mut w = GgufWriter::new(3)?;
        for (k, v) in &self.meta {
            w.add_metadata(k.clone(), v.clone())?;
        }
        for t in &self.tensors {
            w.add_tensor(t.name.clone(), &t.dims, t.ty, t.data.clone())?;
        }
        w.write(path)
    }

    /// Bytes of tensor data.
    pub fn tensor_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}

/// A Gemma 3 shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemma3Shape {
    /// Hidden size.
    pub hidden: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head size.
    pub head_dim: usize,
    /// MLP inner size.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Sliding window of local layers.
    pub window: usize,
    /// Trained context length.
    pub context: usize,
}

impl Gemma3Shape {
    /// The shapes of the released Gemma 3 models (`270m`, `1b`, `4b`, `12b`, `27b`).
    pub fn preset(name: &str) -> Option<Gemma3Shape> {
        let s = |hidden, layers, q_heads, kv_heads, head_dim, ffn, window, context| Gemma3Shape {
            hidden,
            layers,
            q_heads,
            kv_heads,
            head_dim,
            ffn,
            vocab: 262_144,
            window,
            context,
        };
        Some(match name {
            "270m" => s(640, 18, 4, 1, 256, 2048, 512, 32_768),
            "1b" => s(1152, 26, 4, 1, 256, 6912, 512, 32_768),
            "4b" => s(2560, 34, 8, 4, 256, 10_240, 1024, 131_072),
            "12b" => s(3840, 48, 16, 8, 256, 15_360, 1024, 131_072),
            "27b" => s(5376, 62, 32, 16, 128, 21_504, 1024, 131_072),
            _ => return None,
        })
    }

    /// Names of the presets.
    pub const PRESETS: [&'static str; 5] = ["270m", "1b", "4b", "12b", "27b"];
}

/// Random bytes of `rows` rows of `k` elements in format `ty`, whose dequantized values have a
/// magnitude of about `a`: scale fields are set to sane random f16 values (never zero).
pub fn random_blocks(rng: &mut SynthRng, ty: GgmlType, k: usize, rows: usize, a: f32) -> Vec<u8> {
    let row_bytes = ty.row_bytes(k).expect("k is a whole number of blocks");
    let mut data = vec![0u8; row_bytes * rows];
    rng.fill(&mut data);
    let f16 = |v: f32| kiln_quant::f32_to_f16(v).to_le_bytes();
    // (block bytes, [(offset of an f16 scale, its typical value)]).
    let (block, fields): (usize, Vec<(usize, f32)>) = match ty {
        GgmlType::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.weight(a).to_le_bytes());
            }
            return data;
        }
        GgmlType::F16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&f16(rng.weight(a)));
            }
            return data;
        }
        GgmlType::BF16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&kiln_quant::f32_to_bf16(rng.weight(a)).to_le_bytes());
            }
            return data;
        }
        GgmlType::Q8_K => {
            for c in data.chunks_exact_mut(292) {
                c[..4].copy_from_slice(&(a / 74.0 * (0.5 + rng.unit())).to_le_bytes());
            }
            return data;
        }
        GgmlType::Q4_0 => (18, vec![(0, a / 4.6)]),
        GgmlType::Q4_1 => (20, vec![(0, a / 4.6), (2, -7.5 * a / 4.6)]),
        GgmlType::Q5_0 => (22, vec![(0, a / 9.2)]),
        GgmlType::Q5_1 => (24, vec![(0, a / 9.2), (2, -15.5 * a / 9.2)]),
        GgmlType::Q8_0 => (34, vec![(0, a / 74.0)]),
        GgmlType::Q2_K => (84, vec![(80, a / 8.0), (82, 1.5 * a / 8.0)]),
        GgmlType::Q3_K => (110, vec![(108, a / 42.0)]),
        GgmlType::Q4_K => (144, vec![(0, a / 143.0), (2, 7.5 * a / 143.0)]),
        GgmlType::Q5_K => (176, vec![(0, a / 285.0), (2, 15.5 * a / 285.0)]),
        GgmlType::Q6_K => (210, vec![(208, a / 1369.0)]),
        other => panic!("no random block writer for {other:?}"),
    };
    for b in data.chunks_exact_mut(block) {
        for &(off, typical) in &fields {
            b[off..off + 2].copy_from_slice(&f16(typical * (0.5 + rng.unit())));
        }
    }
    data
}

/// Metadata of a SentencePiece-style vocabulary of `vocab` tokens: `<pad> <eos> <bos> <unk>`,
/// the 256 byte tokens, then generated pieces (`▁w0`, `▁w1`, ...), for kiln and llama.cpp alike.
pub fn tokenizer_meta(vocab: usize) -> Vec<(String, MetaValue)> {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].iter().map(|s| s.to_string()).collect();
    let mut types = vec![3, 3, 3, 2];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut i = 0;
    while tokens.len() < vocab {
        tokens.push(format!("\u{2581}w{i}"));
        types.push(1);
        i += 1;
    }
    tokens.truncate(vocab);
    types.truncate(vocab);
    let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
    vec![
        ("tokenizer.ggml.model".into(), MetaValue::String("llama".into())),
        ("tokenizer.ggml.tokens".into(), MetaValue::Array(MetaArray::String(tokens))),
        ("tokenizer.ggml.scores".into(), MetaValue::Array(MetaArray::F32(scores))),
        ("tokenizer.ggml.token_type".into(), MetaValue::Array(MetaArray::I32(types))),
        ("tokenizer.ggml.padding_token_id".into(), MetaValue::U32(0)),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(1)),
        ("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), MetaValue::U32(3)),
        ("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true)),
    ]
}

/// Which block format each matrix gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatMix {
    /// Like llama.cpp's Q4_K_M: Q4_K for most matrices, Q6_K for the embedding, `attn_v` and
    /// `ffn_down` of every other layer; Q5_0/Q8_0 where rows are not whole 256-element blocks.
    Q4KM,
    /// Every matrix in one format.
    All(GgmlType),
}

impl FormatMix {
    /// Formats a synthetic model can use for all its matrices: every format kiln dequantizes but
    /// Q8_K (an activation format that no GGUF file stores weights in).
    pub fn single_formats() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.iter().copied().filter(|t| t.can_dequantize() && *t != GgmlType::Q8_K)
    }

    /// llama.cpp's `general.file_type` for this mix (`llama_ftype`; a single K-quant is its small
    /// variant, as llama-quantize names an all-Q4_K file Q4_K_S), or `None` for a format with no
    /// file type of its own.
    pub fn file_type(self) -> Option<u32> {
        match self {
            FormatMix::Q4KM => kiln_quant::file_type_named("Q4_K - Medium"),
            FormatMix::All(t) => kiln_quant::file_type_of(t),
        }
    }

    /// Parses `q4_k_m` or the name of one of [`FormatMix::single_formats`] (any case).
    pub fn parse(name: &str) -> Option<FormatMix> {
        if name.eq_ignore_ascii_case("q4_k_m") {
            return Some(FormatMix::Q4KM);
        }
        FormatMix::single_formats().find(|t| t.name().eq_ignore_ascii_case(name)).map(FormatMix::All)
    }

    fn pick(self, want: GgmlType, k: usize) -> GgmlType {
        let ty = match self {
            FormatMix::Q4KM => want,
            FormatMix::All(t) => t,
        };
        let block = ty.block_size();
        if k.is_multiple_of(block) {
            ty
        } else if matches!(ty, GgmlType::Q6_K | GgmlType::Q5_K) {
            GgmlType::Q8_0
        } else {
            GgmlType::Q5_0
        }
    }
}

/// A random-weight Gemma 3 model of `shape`, with matrices in `mix`.
pub fn gemma3(shape: &Gemma3Shape, mix: FormatMix, seed: u64) -> SynthModel {
    let Gemma3Shape { hidden, layers, q_heads, kv_heads, head_dim, ffn, vocab, window, context } = *shape;
    let mut m = SynthModel::default();
    let u = |v: usize| MetaValue::U32(v as u32);
    let p = "gemma3";
    m.meta.push(("general.architecture".into(), MetaValue::String(p.into())));
    m.meta.push(("general.name".into(), MetaValue::String("kiln synthetic gemma3".into())));
    if let Some(ft) = mix.file_type() {
        m.meta.push(("general.file_type".into(), u(ft as usize)));
    }
    for (k, v) in [
        ("context_length", context),
        ("embedding_length", hidden),
        ("block_count", layers),
        ("feed_forward_length", ffn),
        ("attention.head_count", q_heads),
        ("attention.head_count_kv", kv_heads),
        ("attention.key_length", head_dim),
        ("attention.value_length", head_dim),
        ("attention.sliding_window", window),
    ] {
        m.meta.push((format!("{p}.{k}"), u(v)));
    }
    m.meta.push((format!("{p}.attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-6)));
    m.meta.push((format!("{p}.rope.freq_base"), MetaValue::F32(1e6)));
    m.meta.extend(tokenizer_meta(vocab));

    let mut rng = SynthRng(seed);
    let mat = |k: usize| 1.0 / (k as f32).sqrt();
    let mut add = |rng: &mut SynthRng, name: String, dims: &[usize], ty: GgmlType, a: f32| {
        let data = if dims.len() == 1 {
            // Norm weights: positive, around `a`.
            (0..dims[0]).flat_map(|_| (a * (0.5 + rng.unit())).to_le_bytes()).collect()
        } else {
            random_blocks(rng, ty, dims[0], dims[1..].iter().product(), a)
        };
        m.tensors.push(SynthTensor { name, dims: dims.iter().map(|&d| d as u64).collect(), ty, data });
    };
    let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
    add(&mut rng, "token_embd.weight".into(), &[hidden, vocab], mix.pick(GgmlType::Q6_K, hidden), 0.05);
    for l in 0..layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let v_ty = if l % 2 == 0 { GgmlType::Q6_K } else { GgmlType::Q4_K };
        add(&mut rng, n("attn_norm"), &[hidden], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_q"), &[hidden, qw], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("attn_k"), &[hidden, kw], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("attn_v"), &[hidden, kw], mix.pick(v_ty, hidden), mat(hidden));
        add(&mut rng, n("attn_q_norm"), &[head_dim], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_k_norm"), &[head_dim], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_output"), &[qw, hidden], mix.pick(GgmlType::Q4_K, qw), mat(qw));
        add(&mut rng, n("post_attention_norm"), &[hidden], GgmlType::F32, 1.0);
        add(&mut rng, n("ffn_norm"), &[hidden], GgmlType::F32, 1.0);
        add(&mut rng, n("ffn_gate"), &[hidden, ffn], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("ffn_up"), &[hidden, ffn], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("ffn_down"), &[ffn, hidden], mix.pick(v_ty, ffn), mat(ffn));
        add(&mut rng, n("post_ffw_norm"), &[hidden], GgmlType::F32, 1.0);
    }
    add(&mut rng, "output_norm.weight".into(), &[hidden], GgmlType::F32, 1.0);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_blocks_dequantize_to_finite_values_of_the_asked_magnitude() {
        let mut rng = SynthRng(7);
        for ty in GgmlType::ALL.iter().copied().filter(|t| t.can_dequantize()) {
            let (k, rows) = (512, 16);
            let data = random_blocks(&mut rng, ty, k, rows, 0.1);
            let mut v = vec![0f32; k * rows];
            kiln_quant::dequantize(ty, &data, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{ty:?}");
            let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
            assert!(rms > 0.02 && rms < 0.5, "{ty:?}: rms {rms}");
        }
    }

    #[test]
    fn presets_have_the_released_shapes() {
        let s = Gemma3Shape::preset("12b").unwrap();
        assert_eq!((s.hidden, s.layers, s.q_heads, s.kv_heads, s.head_dim, s.ffn), (3840, 48, 16, 8, 256, 15_360));
        assert!(Gemma3Shape::PRESETS.iter().all(|p| Gemma3Shape::preset(p).is_some()));
        assert!(Gemma3Shape::preset("3b").is_none());
    }

    #[test]
    fn small_model_loads_and_has_every_tensor() {
        let shape =
            Gemma3Shape { hidden: 256, layers: 2, q_heads: 2, kv_heads: 1, head_dim: 64, ffn: 512, vocab: 300, window: 8, context: 64 };
        let m = gemma3(&shape, FormatMix::Q4KM, 1);
        assert_eq!(m.tensors.len(), 1 + 2 * 13 + 1);
        let path = std::env::temp_dir().join(format!("kiln-synth-unit-{}.gguf", std::process::id()));
        m.write(&path).unwrap();
        let f = kiln_gguf::GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(f.tensors().len(), m.tensors.len());
        assert!(crate::config_from_gguf(&f).is_ok());
        // llama.cpp's Q4_K_M, so llama-bench names the file as it would a released one.
        assert_eq!(f.get_u32("general.file_type").ok(), Some(15));
    }
}
