//! Config mapping per model family: GGUF metadata (llama.cpp key and tensor conventions) →
//! [`DecoderConfig`]. What a file does not say takes llama.cpp's default for the family.

use kiln_gguf::{GgufFile, MetaArray, MetaValue};
use kiln_ir::{RopeMode, RopeSpec};
use kiln_quant::GgmlType;

use crate::decoder::{Activation, DecoderConfig, LayerConfig};
use crate::ModelError;

/// Architectures kiln runs (`general.architecture` values).
pub const SUPPORTED: &[&str] = &["gemma", "gemma2", "gemma3", "gemma4", "llama", "qwen2", "qwen3"];

/// Metadata of one architecture: keys are read under its prefix (`llama.block_count`, ...).
struct Meta<'f> {
    f: &'f GgufFile,
    arch: &'static str,
}

impl Meta<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }

    fn has(&self, name: &str) -> bool {
        self.f.get(&self.key(name)).is_some()
    }

    /// A required positive integer.
    fn count(&self, name: &str) -> Result<usize, ModelError> {
        let key = self.key(name);
        let v = self.f.get_u32(&key)? as usize;
        if v == 0 {
            return Err(ModelError::Metadata(format!("'{key}' is 0")));
        }
        Ok(v)
    }

    /// An optional positive integer.
    fn count_or(&self, name: &str, default: usize) -> Result<usize, ModelError> {
        if self.has(name) {
            self.count(name)
        } else {
            Ok(default)
        }
    }

    /// A required float.
    fn float(&self, name: &str) -> Result<f32, ModelError> {
        Ok(self.f.get_f32(&self.key(name))?)
    }

    /// An optional float.
    fn float_opt(&self, name: &str) -> Result<Option<f32>, ModelError> {
        if self.has(name) {
            self.float(name).map(Some)
        } else {
            Ok(None)
        }
    }

    /// An optional integer that may be 0.
    fn u32_or(&self, name: &str, default: u32) -> Result<u32, ModelError> {
        if self.has(name) {
            Ok(self.f.get_u32(&self.key(name))?)
        } else {
            Ok(default)
        }
    }

    /// A positive integer per layer: one value for all layers, or an array of `layers` values.
    fn per_layer_counts(&self, name: &str, layers: usize, default: usize) -> Result<Vec<usize>, ModelError> {
        let key = self.key(name);
        let bad = |what: String| ModelError::Metadata(format!("'{key}' {what}"));
        let values: Vec<u64> = match self.f.get(&key) {
            None => vec![default as u64; layers],
            Some(MetaValue::Array(a)) => {
                let v: Vec<u64> = match a {
                    MetaArray::U32(v) => v.iter().map(|&x| x as u64).collect(),
                    MetaArray::I32(v) => v.iter().map(|&x| x.max(0) as u64).collect(),
                    other => return Err(bad(format!("is an array of {}, expected integers", other.type_name()))),
                };
                if v.len() != layers {
                    return Err(bad(format!("has {} values for {layers} layers", v.len())));
                }
                v
            }
            Some(_) => vec![self.count(name)? as u64; layers],
        };
        if values.contains(&0) {
            return Err(bad("holds 0".into()));
        }
        Ok(values.into_iter().map(|v| v as usize).collect())
    }

    /// A bool per layer (an array of `layers` bools).
    fn per_layer_flags(&self, name: &str, layers: usize) -> Result<Option<Vec<bool>>, ModelError> {
        let key = self.key(name);
        match self.f.get(&key) {
            None => Ok(None),
            Some(MetaValue::Array(MetaArray::Bool(v))) if v.len() == layers => Ok(Some(v.clone())),
            Some(_) => Err(ModelError::Metadata(format!("'{key}' must be an array of {layers} bools"))),
        }
    }

    /// An optional positive float (soft-caps, scaling factors): present and ≤ 0 is an error.
    fn positive_opt(&self, name: &str) -> Result<Option<f32>, ModelError> {
        match self.float_opt(name)? {
            Some(v) if !(v > 0.0 && v.is_finite()) => Err(ModelError::Metadata(format!("'{}' is {v}", self.key(name)))),
            v => Ok(v),
        }
    }
}

/// The hyperparameters every family shares.
struct Common {
    layers: usize,
    hidden: usize,
    ffn: usize,
    q_heads: usize,
    /// Per layer.
    kv_heads: Vec<usize>,
    head_dim: usize,
    vocab: usize,
    eps: f32,
    context: usize,
    rope_base: f32,
    output_weight: String,
}

fn common(m: &Meta<'_>, default_rope_base: f32) -> Result<Common, ModelError> {
    let hidden = m.count("embedding_length")?;
    let layers = m.count("block_count")?;
    let q_heads = m.count("attention.head_count")?;
    let kv_heads = m.per_layer_counts("attention.head_count_kv", layers, q_heads)?;
    if let Some(kv) = kv_heads.iter().find(|&&kv| !q_heads.is_multiple_of(kv)) {
        return Err(ModelError::Metadata(format!("{q_heads} query heads are not a multiple of {kv} KV heads")));
    }
    let head_dim = m.count_or("attention.key_length", hidden / q_heads)?;
    let value_dim = m.count_or("attention.value_length", head_dim)?;
    if value_dim != head_dim {
        return Err(ModelError::Metadata(format!(
            "'{}' ({value_dim}) differs from the key length ({head_dim}); kiln needs equal key and value head sizes",
            m.key("attention.value_length")
        )));
    }
    if !head_dim.is_multiple_of(2) {
        return Err(ModelError::Metadata(format!("head size {head_dim} is odd; RoPE needs an even head size")));
    }
    let rot = m.count_or("rope.dimension_count", head_dim)?;
    if rot != head_dim {
        return Err(ModelError::Metadata(format!(
            "'{}' is {rot} but the head size is {head_dim}; partial rotary embeddings are not supported",
            m.key("rope.dimension_count")
        )));
    }
    let embd = m.f.tensor("token_embd.weight").ok_or_else(|| ModelError::Metadata("the file has no tensor 'token_embd.weight'".into()))?;
    let output_weight = if m.f.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
    Ok(Common {
        layers,
        hidden,
        ffn: m.count("feed_forward_length")?,
        q_heads,
        kv_heads,
        head_dim,
        vocab: embd.n_rows(),
        eps: m.float("attention.layer_norm_rms_epsilon")?,
        context: m.count("context_length")?,
        rope_base: m.float_opt("rope.freq_base")?.unwrap_or(default_rope_base),
        output_weight: output_weight.to_string(),
    })
}

/// Linear RoPE scaling from `rope.scaling.type` / `rope.scaling.factor` (or the older
/// `rope.scale_linear`): the frequency scale `1 / factor`. Other scaling types are rejected.
fn linear_rope_scale(m: &Meta<'_>) -> Result<f32, ModelError> {
    let type_key = m.key("rope.scaling.type");
    let kind = if m.f.get(&type_key).is_some() { m.f.get_str(&type_key)? } else { "linear" };
    let factor = match kind {
        "none" => None,
        "linear" => match m.positive_opt("rope.scaling.factor")? {
            Some(f) => Some(f),
            None => m.positive_opt("rope.scale_linear")?,
        },
        other => return Err(ModelError::Metadata(format!("'{type_key}' is '{other}'; kiln supports none and linear RoPE scaling"))),
    };
    Ok(1.0 / factor.unwrap_or(1.0))
}

/// Per-frequency RoPE divisors from the `rope_freqs.weight` tensor (Llama 3 scaling), if present.
fn rope_freq_factors(f: &GgufFile, head_dim: usize) -> Result<Option<Vec<f32>>, ModelError> {
    let Some(t) = f.tensor("rope_freqs.weight") else { return Ok(None) };
    let half = head_dim / 2;
    if t.n_elements() != half as u64 || t.ty != GgmlType::F32 && t.ty != GgmlType::F16 {
        return Err(ModelError::Metadata(format!(
            "'rope_freqs.weight' must hold {half} F32 or F16 values, found {} of {}",
            t.n_elements(),
            t.ty
        )));
    }
    let mut v = vec![0f32; half];
    kiln_quant::dequantize(t.ty, f.tensor_data(t), &mut v).map_err(|e| ModelError::Metadata(format!("'rope_freqs.weight': {e}")))?;
    if v.iter().any(|x| x.is_nan() || *x <= 0.0) {
        return Err(ModelError::Metadata("'rope_freqs.weight' holds a value that is not positive".into()));
    }
    Ok(Some(v))
}

/// Uniform layers: every layer has the common KV shape, `rope`, and the window `window(l)`.
fn uniform_layers(c: &Common, rope: &RopeSpec, window: impl Fn(usize) -> Option<usize>) -> Vec<LayerConfig> {
    (0..c.layers)
        .map(|l| LayerConfig {
            kv_heads: c.kv_heads[l],
            head_dim: c.head_dim,
            rope: rope.clone(),
            window: window(l),
            v_from_k: false,
            output_scale: None,
        })
        .collect()
}

/// A config with every switch off, for families to adjust.
fn base(arch: &'static str, c: &Common, layers: Vec<LayerConfig>, activation: Activation) -> DecoderConfig {
    DecoderConfig {
        arch,
        hidden: c.hidden,
        ffn: c.ffn,
        q_heads: c.q_heads,
        vocab: c.vocab,
        eps: c.eps,
        context: c.context,
        layers,
        embed_scale: 1.0,
        activation,
        post_norms: false,
        qk_norm: false,
        v_norm: false,
        qkv_bias: false,
        attn_scale: 1.0 / (c.head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        output_weight: c.output_weight.clone(),
    }
}

/// Llama 2/3: SwiGLU, "normal" RoPE pairing (the converter permutes q/k rows for it), linear or
/// per-frequency (`rope_freqs`) RoPE scaling, GQA.
fn llama(f: &GgufFile) -> Result<DecoderConfig, ModelError> {
    let m = Meta { f, arch: "llama" };
    let c = common(&m, 10_000.0)?;
    let rope = RopeSpec {
        theta: c.rope_base,
        mode: RopeMode::Norm,
        freq_scale: linear_rope_scale(&m)?,
        freq_factors: rope_freq_factors(f, c.head_dim)?,
    };
    Ok(base("llama", &c, uniform_layers(&c, &rope, |_| None), Activation::Silu))
}

/// Qwen 2 (q/k/v biases) and Qwen 3 (per-head q/k norms): SwiGLU, NeoX RoPE.
fn qwen(f: &GgufFile, arch: &'static str) -> Result<DecoderConfig, ModelError> {
    let m = Meta { f, arch };
    let c = common(&m, 10_000.0)?;
    let rope = RopeSpec { freq_scale: linear_rope_scale(&m)?, ..RopeSpec::neox(c.rope_base) };
    let mut cfg = base(arch, &c, uniform_layers(&c, &rope, |_| None), Activation::Silu);
    cfg.qkv_bias = arch == "qwen2";
    cfg.qk_norm = arch == "qwen3";
    Ok(cfg)
}

/// Gemma 1: GELU MLP, embeddings scaled by sqrt(hidden), NeoX RoPE, no post norms.
fn gemma(f: &GgufFile) -> Result<DecoderConfig, ModelError> {
    let m = Meta { f, arch: "gemma" };
    let c = common(&m, 10_000.0)?;
    let mut cfg = base("gemma", &c, uniform_layers(&c, &RopeSpec::neox(c.rope_base), |_| None), Activation::GeluTanh);
    cfg.embed_scale = (c.hidden as f32).sqrt();
    Ok(cfg)
}

/// Gemma 2: Gemma 1 plus post norms, attention and final-logit soft-capping, and sliding-window
/// layers alternating with global ones (even layers slide).
fn gemma2(f: &GgufFile) -> Result<DecoderConfig, ModelError> {
    let m = Meta { f, arch: "gemma2" };
    let c = common(&m, 10_000.0)?;
    let window = m.count("attention.sliding_window")?;
    let layers = uniform_layers(&c, &RopeSpec::neox(c.rope_base), |l| if l % 2 == 0 { Some(window) } else { None });
    let mut cfg = base("gemma2", &c, layers, Activation::GeluTanh);
    cfg.embed_scale = (c.hidden as f32).sqrt();
    cfg.post_norms = true;
    // query_pre_attn_scalar is not in the metadata; as llama.cpp: the 27B model (46 layers)
    // uses hidden / heads, the others the head size.
    let query_pre_attn = if c.layers == 46 { c.hidden / c.q_heads } else { c.head_dim };
    cfg.attn_scale = 1.0 / (query_pre_attn as f32).sqrt();
    cfg.attn_softcap = Some(m.positive_opt("attn_logit_softcapping")?.unwrap_or(50.0));
    cfg.final_softcap = Some(m.positive_opt("final_logit_softcapping")?.unwrap_or(30.0));
    Ok(cfg)
}

/// Gemma 3: post norms, q/k norms, every `sliding_window_pattern`-th layer global (default 6)
/// with base `rope.freq_base` and linear scaling; sliding layers use `rope.freq_base_swa`
/// (default 10000) unscaled.
fn gemma3(f: &GgufFile) -> Result<DecoderConfig, ModelError> {
    let m = Meta { f, arch: "gemma3" };
    let c = common(&m, 1_000_000.0)?;
    let window = m.count("attention.sliding_window")?;
    let global_every = m.count_or("attention.sliding_window_pattern", 6)?;
    let local = RopeSpec::neox(m.float_opt("rope.freq_base_swa")?.unwrap_or(10_000.0));
    let global = RopeSpec { freq_scale: linear_rope_scale(&m)?, ..RopeSpec::neox(c.rope_base) };
    let layers = (0..c.layers)
        .map(|l| {
            let is_global = (l + 1).is_multiple_of(global_every);
            let (rope, window) = if is_global { (global.clone(), None) } else { (local.clone(), Some(window)) };
            LayerConfig { kv_heads: c.kv_heads[l], head_dim: c.head_dim, rope, window, v_from_k: false, output_scale: None }
        })
        .collect();
    let mut cfg = base("gemma3", &c, layers, Activation::GeluTanh);
    cfg.embed_scale = (c.hidden as f32).sqrt();
    cfg.post_norms = true;
    cfg.qk_norm = true;
    // As llama.cpp: the 27B model (62 layers) scales by 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim).
    let query_pre_attn = if c.layers == 62 { c.hidden / c.q_heads } else { c.head_dim };
    cfg.attn_scale = 1.0 / (query_pre_attn as f32).sqrt();
    Ok(cfg)
}

/// The single value of the 1-element tensor `name` (Gemma 4 `layer_output_scale`), if present.
fn scalar_tensor(f: &GgufFile, name: &str) -> Result<Option<f32>, ModelError> {
    let Some(t) = f.tensor(name) else { return Ok(None) };
    if t.n_elements() != 1 || t.ty != GgmlType::F32 && t.ty != GgmlType::F16 {
        return Err(ModelError::Metadata(format!("'{name}' must be one F32 or F16 value, found {} of {}", t.n_elements(), t.ty)));
    }
    let mut v = [0f32];
    kiln_quant::dequantize(t.ty, f.tensor_data(t), &mut v).map_err(|e| ModelError::Metadata(format!("'{name}': {e}")))?;
    Ok(Some(v[0]))
}

/// Gemma 4 (text): Gemma 3's block with per-layer KV widths — global layers use
/// `attention.key_length` and base `rope.freq_base` with the `rope_freqs` factors (proportional
/// RoPE), sliding layers `attention.key_length_swa` and `rope.freq_base_swa` — a weightless RMS
/// norm on values, keys as values where a layer has no `attn_v` (`attention_k_eq_v`), attention
/// scale 1, optional final soft-capping and a per-layer output scale. Per-layer embeddings, KV
/// sharing and MoE blocks are rejected with an error naming them.
fn gemma4(f: &GgufFile) -> Result<DecoderConfig, ModelError> {
    let m = Meta { f, arch: "gemma4" };
    let c = common(&m, 1_000_000.0)?;
    for (name, what) in [
        ("attention.shared_kv_layers", "KV sharing"),
        ("embedding_length_per_layer_input", "per-layer embeddings"),
        ("expert_count", "mixture-of-experts blocks"),
    ] {
        if m.u32_or(name, 0)? != 0 {
            return Err(ModelError::Metadata(format!("'{}' is not 0: kiln does not support Gemma 4 {what}", m.key(name))));
        }
    }
    let head_swa = m.count_or("attention.key_length_swa", c.head_dim)?;
    if m.count_or("attention.value_length_swa", head_swa)? != head_swa || !head_swa.is_multiple_of(2) {
        return Err(ModelError::Metadata(format!("'{}' must equal the (even) sliding key length", m.key("attention.value_length_swa"))));
    }
    if m.count_or("rope.dimension_count_swa", head_swa)? != head_swa {
        return Err(ModelError::Metadata(format!(
            "'{}' differs from the sliding head size {head_swa}; partial rotary embeddings are not supported",
            m.key("rope.dimension_count_swa")
        )));
    }
    let window = m.count("attention.sliding_window")?;
    let sliding = match m.per_layer_flags("attention.sliding_window_pattern", c.layers)? {
        Some(v) => v,
        None => (0..c.layers).map(|l| !(l + 1).is_multiple_of(6)).collect(),
    };
    let local = RopeSpec::neox(m.float_opt("rope.freq_base_swa")?.unwrap_or(10_000.0));
    let global = RopeSpec { freq_factors: rope_freq_factors(f, c.head_dim)?, ..RopeSpec::neox(c.rope_base) };
    let mut layers = Vec::with_capacity(c.layers);
    for (l, &swa) in sliding.iter().enumerate() {
        let (head_dim, rope, window) = if swa { (head_swa, local.clone(), Some(window)) } else { (c.head_dim, global.clone(), None) };
        let output_scale = scalar_tensor(f, &format!("blk.{l}.layer_output_scale.weight"))?.filter(|&s| s != 1.0);
        let v_from_k = f.tensor(&format!("blk.{l}.attn_v.weight")).is_none();
        layers.push(LayerConfig { kv_heads: c.kv_heads[l], head_dim, rope, window, v_from_k, output_scale });
    }
    let mut cfg = base("gemma4", &c, layers, Activation::GeluTanh);
    cfg.embed_scale = (c.hidden as f32).sqrt();
    cfg.post_norms = true;
    cfg.qk_norm = true;
    cfg.v_norm = true;
    cfg.attn_scale = 1.0;
    cfg.final_softcap = m.positive_opt("final_logit_softcapping")?;
    Ok(cfg)
}

/// Reads the family named by `general.architecture` and its hyperparameters.
pub fn config_from_gguf(f: &GgufFile) -> Result<DecoderConfig, ModelError> {
    match f.architecture()? {
        "llama" => llama(f),
        "qwen2" => qwen(f, "qwen2"),
        "qwen3" => qwen(f, "qwen3"),
        "gemma" => gemma(f),
        "gemma2" => gemma2(f),
        "gemma3" => gemma3(f),
        "gemma4" => gemma4(f),
        other => Err(ModelError::UnsupportedArchitecture(other.to_string())),
    }
}
