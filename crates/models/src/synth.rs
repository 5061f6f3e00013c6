//! Synthetic models: random-weight GGUF files of any Gemma 3, Llama, Qwen 2 or Qwen 3 shape (the
//! released models' shapes as [`Preset`]s), in a Q4_K_M-like mix of block formats, so speed can be
//! measured where no real weights exist, in kiln and llama.cpp alike. Quantized blocks are written
//! directly as random bytes with sane random scales (never zero); no float quantizer runs over
//! billions of values.

use std::path::Path;

use kiln_gguf::{GgufError, GgufFile, GgufWriter, MetaArray, MetaValue};
use kiln_quant::{GgmlType, QuantError};

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

    /// The metadata and tensors of `file`, to edit and write again.
    pub fn from_gguf(file: &GgufFile) -> SynthModel {
        let tensors = file
            .tensors()
            .iter()
            .map(|t| SynthTensor { name: t.name.clone(), dims: t.dims.clone(), ty: t.ty, data: file.tensor_data(t).to_vec() })
            .collect();
        SynthModel { meta: file.metadata().to_vec(), tensors }
    }

    /// Re-encodes every matrix (tensors of two or more dimensions) in format `ty` through f32
    /// (round to nearest; their rows must be whole blocks of `ty`); vectors stay as they are.
    pub fn requantize_matrices(&mut self, ty: GgmlType) -> Result<(), QuantError> {
        for t in self.tensors.iter_mut().filter(|t| t.dims.len() >= 2) {
            let mut v = vec![0f32; t.dims.iter().product::<u64>() as usize];
            kiln_quant::dequantize(t.ty, &t.data, &mut v)?;
            t.data = kiln_quant::quantize(ty, &v)?;
            t.ty = ty;
        }
        Ok(())
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

/// The metadata every synthetic decoder of architecture `arch` has: its name and file type, the
/// integer hyperparameters `counts` under the architecture's prefix, epsilon, RoPE base and the
/// tokenizer of `vocab` tokens.
fn decoder_meta(arch: &str, mix: FormatMix, counts: &[(&str, usize)], rope_base: f32, vocab: usize) -> Vec<(String, MetaValue)> {
    let u = |v: usize| MetaValue::U32(v as u32);
    let mut meta = vec![
        ("general.architecture".to_string(), MetaValue::String(arch.into())),
        ("general.name".to_string(), MetaValue::String(format!("kiln synthetic {arch}"))),
    ];
    if let Some(ft) = mix.file_type() {
        meta.push(("general.file_type".into(), u(ft as usize)));
    }
    meta.extend(counts.iter().map(|&(k, v)| (format!("{arch}.{k}"), u(v))));
    meta.push((format!("{arch}.attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-6)));
    meta.push((format!("{arch}.rope.freq_base"), MetaValue::F32(rope_base)));
    meta.extend(tokenizer_meta(vocab));
    meta
}

impl SynthModel {
    /// Adds tensor `name` of `dims` (ggml order) with random contents: a vector of positive values
    /// around `a` (norm weights, biases), or a matrix of random `ty` blocks whose values are about `a`.
    fn add_random(&mut self, rng: &mut SynthRng, name: String, dims: &[usize], ty: GgmlType, a: f32) {
        let data = if dims.len() == 1 {
            (0..dims[0]).flat_map(|_| (a * (0.5 + rng.unit())).to_le_bytes()).collect()
        } else {
            random_blocks(rng, ty, dims[0], dims[1..].iter().product(), a)
        };
        self.tensors.push(SynthTensor { name, dims: dims.iter().map(|&d| d as u64).collect(), ty, data });
    }
}

/// A random-weight Gemma 3 model of `shape`, with matrices in `mix`.
pub fn gemma3(shape: &Gemma3Shape, mix: FormatMix, seed: u64) -> SynthModel {
    let Gemma3Shape { hidden, layers, q_heads, kv_heads, head_dim, ffn, vocab, window, context } = *shape;
    let counts = [
        ("context_length", context),
        ("embedding_length", hidden),
        ("block_count", layers),
        ("feed_forward_length", ffn),
        ("attention.head_count", q_heads),
        ("attention.head_count_kv", kv_heads),
        ("attention.key_length", head_dim),
        ("attention.value_length", head_dim),
        ("attention.sliding_window", window),
    ];
    let mut m = SynthModel { meta: decoder_meta("gemma3", mix, &counts, 1e6, vocab), tensors: Vec::new() };
    let mut rng = SynthRng(seed);
    let mat = |k: usize| 1.0 / (k as f32).sqrt();
    let mut add = |rng: &mut SynthRng, name: String, dims: &[usize], ty: GgmlType, a: f32| m.add_random(rng, name, dims, ty, a);
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

/// A Llama-style family: pre-norm blocks, SwiGLU MLP, no post norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaArch {
    /// Llama 3: "normal" RoPE pairing with Llama 3 frequency factors (`rope_freqs.weight`).
    Llama,
    /// Qwen 2: q/k/v biases, NeoX RoPE.
    Qwen2,
    /// Qwen 3: per-head q/k RMS norms, NeoX RoPE.
    Qwen3,
}

impl LlamaArch {
    /// The `general.architecture` value.
    pub fn name(self) -> &'static str {
        match self {
            LlamaArch::Llama => "llama",
            LlamaArch::Qwen2 => "qwen2",
            LlamaArch::Qwen3 => "qwen3",
        }
    }
}

/// A Llama, Qwen 2 or Qwen 3 shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaShape {
    /// The family.
    pub arch: LlamaArch,
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
    /// Trained context length.
    pub context: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Llama 3 RoPE scaling factor (`rope_freqs.weight` is written where it is not 1).
    pub rope_factor: f32,
    /// Whether the output matrix is the embedding table (no `output.weight`).
    pub tied: bool,
}

/// A `kiln synth` preset: the shape of a released model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Preset {
    /// A Gemma 3 shape.
    Gemma3(Gemma3Shape),
    /// A Llama, Qwen 2 or Qwen 3 shape.
    Llama(LlamaShape),
}

impl Preset {
    /// The presets' names: the Gemma 3 sizes (`270m` ... `27b`), then Llama 3.x, Qwen 2.5 and
    /// Qwen 3 models.
    pub const NAMES: [&'static str; 13] = [
        "270m",
        "1b",
        "4b",
        "12b",
        "27b",
        "llama3.2-1b",
        "llama3.2-3b",
        "llama3.1-8b",
        "llama3.1-70b",
        "qwen2.5-0.5b",
        "qwen2.5-7b",
        "qwen3-0.6b",
        "qwen3-8b",
    ];

    /// The preset called `name` (one of [`Preset::NAMES`]).
    pub fn named(name: &str) -> Option<Preset> {
        if let Some(s) = Gemma3Shape::preset(name) {
            return Some(Preset::Gemma3(s));
        }
        use LlamaArch::*;
        #[allow(clippy::too_many_arguments)]
        let s = |arch, hidden, layers, q_heads, kv_heads, head_dim, ffn, vocab, context, rope_base, rope_factor, tied| LlamaShape {
            arch,
            hidden,
            layers,
            q_heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            context,
            rope_base,
            rope_factor,
            tied,
        };
        Some(Preset::Llama(match name {
            "llama3.2-1b" => s(Llama, 2048, 16, 32, 8, 64, 8192, 128_256, 131_072, 500_000.0, 32.0, true),
            "llama3.2-3b" => s(Llama, 3072, 28, 24, 8, 128, 8192, 128_256, 131_072, 500_000.0, 32.0, true),
            "llama3.1-8b" => s(Llama, 4096, 32, 32, 8, 128, 14_336, 128_256, 131_072, 500_000.0, 8.0, false),
            "llama3.1-70b" => s(Llama, 8192, 80, 64, 8, 128, 28_672, 128_256, 131_072, 500_000.0, 8.0, false),
            "qwen2.5-0.5b" => s(Qwen2, 896, 24, 14, 2, 64, 4864, 151_936, 32_768, 1_000_000.0, 1.0, true),
            "qwen2.5-7b" => s(Qwen2, 3584, 28, 28, 4, 128, 18_944, 152_064, 32_768, 1_000_000.0, 1.0, false),
            "qwen3-0.6b" => s(Qwen3, 1024, 28, 16, 8, 128, 3072, 151_936, 40_960, 1_000_000.0, 1.0, true),
            "qwen3-8b" => s(Qwen3, 4096, 36, 32, 8, 128, 12_288, 151_936, 40_960, 1_000_000.0, 1.0, false),
            _ => return None,
        }))
    }

    /// The `general.architecture` of the preset's files.
    pub fn arch(&self) -> &'static str {
        match self {
            Preset::Gemma3(_) => "gemma3",
            Preset::Llama(s) => s.arch.name(),
        }
    }

    /// A random-weight model of this shape with matrices in `mix`.
    pub fn model(&self, mix: FormatMix, seed: u64) -> SynthModel {
        match self {
            Preset::Gemma3(s) => gemma3(s, mix, seed),
            Preset::Llama(s) => llama(s, mix, seed),
        }
    }
}

/// Llama 3's per-frequency RoPE divisors for `factor` (low/high frequency factors 1 and 4, an
/// original context of 8192), as its converter writes them to `rope_freqs.weight`.
pub fn llama3_rope_factors(head_dim: usize, base: f32, factor: f32) -> Vec<f32> {
    let (low, high, old) = (1.0f64, 4.0f64, 8192.0f64);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (base as f64).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor as f64
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor as f64 + smooth)
            };
            f as f32
        })
        .collect()
}

/// A random-weight Llama, Qwen 2 or Qwen 3 model of `shape`, with matrices in `mix` (Q4_K_M: the
/// embedding Q6_K where it is also the output, else Q4_K and the output Q6_K).
pub fn llama(shape: &LlamaShape, mix: FormatMix, seed: u64) -> SynthModel {
    let LlamaShape { arch, hidden, layers, q_heads, kv_heads, head_dim, ffn, vocab, context, rope_base, rope_factor, tied } = *shape;
    let counts = [
        ("context_length", context),
        ("embedding_length", hidden),
        ("block_count", layers),
        ("feed_forward_length", ffn),
        ("attention.head_count", q_heads),
        ("attention.head_count_kv", kv_heads),
        ("attention.key_length", head_dim),
        ("attention.value_length", head_dim),
        ("rope.dimension_count", head_dim),
    ];
    let mut m = SynthModel { meta: decoder_meta(arch.name(), mix, &counts, rope_base, vocab), tensors: Vec::new() };
    if arch == LlamaArch::Llama && rope_factor != 1.0 {
        let factors = llama3_rope_factors(head_dim, rope_base, rope_factor);
        let data = factors.iter().flat_map(|f| f.to_le_bytes()).collect();
        m.tensors.push(SynthTensor { name: "rope_freqs.weight".into(), dims: vec![(head_dim / 2) as u64], ty: GgmlType::F32, data });
    }
    let mut rng = SynthRng(seed);
    let mat = |k: usize| 1.0 / (k as f32).sqrt();
    let mut add = |rng: &mut SynthRng, name: String, dims: &[usize], ty: GgmlType, a: f32| m.add_random(rng, name, dims, ty, a);
    let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
    let embd_ty = if tied { GgmlType::Q6_K } else { GgmlType::Q4_K };
    add(&mut rng, "token_embd.weight".into(), &[hidden, vocab], mix.pick(embd_ty, hidden), 0.05);
    for l in 0..layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let v_ty = if l % 2 == 0 { GgmlType::Q6_K } else { GgmlType::Q4_K };
        add(&mut rng, n("attn_norm"), &[hidden], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_q"), &[hidden, qw], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("attn_k"), &[hidden, kw], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("attn_v"), &[hidden, kw], mix.pick(v_ty, hidden), mat(hidden));
        if arch == LlamaArch::Qwen2 {
            for (t, w) in [("attn_q", qw), ("attn_k", kw), ("attn_v", kw)] {
                add(&mut rng, format!("blk.{l}.{t}.bias"), &[w], GgmlType::F32, 0.1);
            }
        }
        if arch == LlamaArch::Qwen3 {
            add(&mut rng, n("attn_q_norm"), &[head_dim], GgmlType::F32, 1.0);
            add(&mut rng, n("attn_k_norm"), &[head_dim], GgmlType::F32, 1.0);
        }
        add(&mut rng, n("attn_output"), &[qw, hidden], mix.pick(GgmlType::Q4_K, qw), mat(qw));
        add(&mut rng, n("ffn_norm"), &[hidden], GgmlType::F32, 1.0);
        add(&mut rng, n("ffn_gate"), &[hidden, ffn], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("ffn_up"), &[hidden, ffn], mix.pick(GgmlType::Q4_K, hidden), mat(hidden));
        add(&mut rng, n("ffn_down"), &[ffn, hidden], mix.pick(v_ty, ffn), mat(ffn));
    }
    add(&mut rng, "output_norm.weight".into(), &[hidden], GgmlType::F32, 1.0);
    if !tied {
        add(&mut rng, "output.weight".into(), &[hidden, vocab], mix.pick(GgmlType::Q6_K, hidden), mat(hidden));
    }
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
    fn a_model_file_is_requantized_matrix_by_matrix() {
        let shape =
            Gemma3Shape { hidden: 256, layers: 1, q_heads: 2, kv_heads: 1, head_dim: 64, ffn: 512, vocab: 300, window: 8, context: 64 };
        let path = std::env::temp_dir().join(format!("kiln-synth-requant-{}.gguf", std::process::id()));
        gemma3(&shape, FormatMix::Q4KM, 1).write(&path).unwrap();
        let f = GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut m = SynthModel::from_gguf(&f);
        assert_eq!((m.meta.len(), m.tensors.len()), (f.metadata().len(), f.tensors().len()));
        m.requantize_matrices(GgmlType::Q8_0).unwrap();
        for (t, orig) in m.tensors.iter().zip(f.tensors()) {
            if t.dims.len() == 1 {
                assert_eq!((t.ty, t.data.as_slice()), (orig.ty, f.tensor_data(orig)), "{}", t.name);
                continue;
            }
            assert_eq!(t.ty, GgmlType::Q8_0, "{}", t.name);
            let n = t.dims.iter().product::<u64>() as usize;
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            kiln_quant::dequantize(t.ty, &t.data, &mut a).unwrap();
            kiln_quant::dequantize(orig.ty, f.tensor_data(orig), &mut b).unwrap();
            let err = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum::<f32>().sqrt();
            let norm = b.iter().map(|y| y * y).sum::<f32>().sqrt();
            assert!(err < 1e-2 * norm, "{}: relative error {}", t.name, err / norm);
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
    fn every_preset_name_is_a_preset() {
        for name in Preset::NAMES {
            assert!(Preset::named(name).is_some(), "{name}");
        }
        assert!(Preset::named("llama3.1-9b").is_none());
        let Some(Preset::Llama(s)) = Preset::named("llama3.1-8b") else { panic!("llama3.1-8b is a Llama preset") };
        assert_eq!((s.hidden, s.layers, s.q_heads, s.kv_heads, s.head_dim, s.ffn, s.vocab), (4096, 32, 32, 8, 128, 14_336, 128_256));
        assert_eq!(Preset::named("qwen3-8b").unwrap().arch(), "qwen3");
        assert_eq!(Preset::named("12b").unwrap().arch(), "gemma3");
    }

    #[test]
    fn llama3_rope_factors_keep_high_frequencies_and_divide_low_ones() {
        let f = llama3_rope_factors(128, 500_000.0, 8.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
    }

    #[test]
    fn small_llama_family_models_load_with_their_family_config() {
        for (arch, tied) in [(LlamaArch::Llama, false), (LlamaArch::Qwen2, true), (LlamaArch::Qwen3, false)] {
            let shape = LlamaShape {
                arch,
                hidden: 256,
                layers: 2,
                q_heads: 4,
                kv_heads: 2,
                head_dim: 64,
                ffn: 512,
                vocab: 300,
                context: 64,
                rope_base: 500_000.0,
                rope_factor: 8.0,
                tied,
            };
            let m = llama(&shape, FormatMix::Q4KM, 1);
            let path = std::env::temp_dir().join(format!("kiln-synth-unit-{}-{}.gguf", std::process::id(), arch.name()));
            m.write(&path).unwrap();
            let f = kiln_gguf::GgufFile::open(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            let c = crate::config_from_gguf(&f).unwrap();
            assert_eq!((c.arch, c.hidden, c.layers.len(), c.ffn), (arch.name(), 256, 2, 512));
            assert_eq!(c.qkv_bias, arch == LlamaArch::Qwen2, "{arch:?}");
            assert_eq!(c.qk_norm, arch == LlamaArch::Qwen3, "{arch:?}");
            assert_eq!(c.output_weight, if tied { "token_embd.weight" } else { "output.weight" });
            assert_eq!(c.layers[0].rope.freq_factors.is_some(), arch == LlamaArch::Llama, "{arch:?}");
        }
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
