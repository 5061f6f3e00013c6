//! Gemma 3: sliding/global attention layers, q/k norms, pre and post norms, GELU-tanh gated MLP.

use kiln_gguf::GgufFile;
use kiln_ir::{Bucket, DType, Graph, GraphBuilder, OutputMode};
use kiln_runtime::{KvLayout, LayerKv};

use crate::{Architecture, ModelError};

/// Gemma 3 hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    /// Decoder layers.
    pub layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// MLP inner width.
    pub ffn: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head size.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMS norm epsilon.
    pub eps: f32,
    /// RoPE base of global layers.
    pub rope_global: f32,
    /// RoPE base of sliding layers (not in the GGUF metadata; Gemma 3 uses 10000).
    pub rope_local: f32,
    /// Sliding window of local layers.
    pub window: usize,
    /// Every `global_every`-th layer is global (Gemma 3: 6).
    pub global_every: usize,
    /// Attention score scale (1/sqrt(query_pre_attn_scalar)).
    pub attn_scale: f32,
    /// Trained context length.
    pub context: usize,
    /// Name of the output projection (`output.weight`, or the tied embedding).
    pub output_weight: String,
}

fn meta_usize(f: &GgufFile, key: &str) -> Result<usize, ModelError> {
    let v = f.get_u32(key)? as usize;
    if v == 0 {
        return Err(ModelError::Metadata(format!("'{key}' is 0")));
    }
    Ok(v)
}

impl Gemma3Config {
    /// Reads the hyperparameters from `gemma3.*` metadata and the tensor table.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let p = "gemma3";
        let hidden = meta_usize(f, &format!("{p}.embedding_length"))?;
        let q_heads = meta_usize(f, &format!("{p}.attention.head_count"))?;
        let kv_heads = meta_usize(f, &format!("{p}.attention.head_count_kv"))?;
        let head_dim = match f.get(&format!("{p}.attention.key_length")) {
            Some(_) => meta_usize(f, &format!("{p}.attention.key_length"))?,
            None => hidden / q_heads,
        };
        if q_heads % kv_heads != 0 {
            return Err(ModelError::Metadata(format!("{q_heads} query heads are not a multiple of {kv_heads} KV heads")));
        }
        let embd = f
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::Metadata("the file has no tensor 'token_embd.weight'".into()))?;
        let vocab = embd.n_rows();
        let layers = meta_usize(f, &format!("{p}.block_count"))?;
        let swa_key = format!("{p}.rope.freq_base_swa");
        let rope_local = if f.get(&swa_key).is_some() { f.get_f32(&swa_key)? } else { 10_000.0 };
        let pattern_key = format!("{p}.attention.sliding_window_pattern");
        let global_every = if f.get(&pattern_key).is_some() { meta_usize(f, &pattern_key)? } else { 6 };
        // As llama.cpp: the 27B model scales by 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim).
        let query_pre_attn = if layers == 62 { hidden / q_heads } else { head_dim };
        let output_weight = if f.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
        Ok(Gemma3Config {
            layers,
            hidden,
            ffn: meta_usize(f, &format!("{p}.feed_forward_length"))?,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            eps: f.get_f32(&format!("{p}.attention.layer_norm_rms_epsilon"))?,
            rope_global: f.get_f32(&format!("{p}.rope.freq_base"))?,
            rope_local,
            window: meta_usize(f, &format!("{p}.attention.sliding_window"))?,
            global_every,
            attn_scale: 1.0 / (query_pre_attn as f32).sqrt(),
            context: meta_usize(f, &format!("{p}.context_length"))?,
            output_weight: output_weight.to_string(),
        })
    }

    /// Whether layer `l` attends globally (else through the sliding window).
    pub fn is_global(&self, l: usize) -> bool {
        (l + 1).is_multiple_of(self.global_every)
    }
}

impl Architecture for Gemma3Config {
    fn name(&self) -> &'static str {
        "gemma3"
    }

    fn build_graph(&self, bucket: Bucket, mode: OutputMode) -> Result<Graph, ModelError> {
        let c = self;
        let mut g = GraphBuilder::new(bucket);
        let rows = g.rows();
        let (qw, kw) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let tokens = g.input("tokens", DType::I32);
        let positions = g.input("positions", DType::I32);
        let embd = g.weight("token_embd.weight", &[c.vocab, c.hidden]);
        let mut h = g.embed(embd, tokens, (c.hidden as f32).sqrt());
        for l in 0..c.layers {
            let w = |name: &str| format!("blk.{l}.{name}.weight");
            let attn_norm = g.weight(&w("attn_norm"), &[c.hidden]);
            let x = g.rms_norm(h, attn_norm, c.eps);
            let (wq, wk, wv) =
                (g.weight(&w("attn_q"), &[qw, c.hidden]), g.weight(&w("attn_k"), &[kw, c.hidden]), g.weight(&w("attn_v"), &[kw, c.hidden]));
            let q = g.matmul(x, wq);
            let k = g.matmul(x, wk);
            let v = g.matmul(x, wv);
            let q = g.reshape(q, &[rows, c.q_heads, c.head_dim]);
            let k = g.reshape(k, &[rows, c.kv_heads, c.head_dim]);
            let v = g.reshape(v, &[rows, c.kv_heads, c.head_dim]);
            let (q_norm, k_norm) = (g.weight(&w("attn_q_norm"), &[c.head_dim]), g.weight(&w("attn_k_norm"), &[c.head_dim]));
            let q = g.rms_norm(q, q_norm, c.eps);
            let k = g.rms_norm(k, k_norm, c.eps);
            let (theta, window) = if c.is_global(l) { (c.rope_global, None) } else { (c.rope_local, Some(c.window)) };
            let q = g.rope(q, positions, theta);
            let k = g.rope(k, positions, theta);
            let a = g.attention(q, k, v, l, window, c.attn_scale);
            let wo = g.weight(&w("attn_output"), &[c.hidden, qw]);
            let o = g.matmul(a, wo);
            let post_attn = g.weight(&w("post_attention_norm"), &[c.hidden]);
            let o = g.rms_norm(o, post_attn, c.eps);
            h = g.add(h, o);
            let ffn_norm = g.weight(&w("ffn_norm"), &[c.hidden]);
            let x = g.rms_norm(h, ffn_norm, c.eps);
            let (wg, wu) = (g.weight(&w("ffn_gate"), &[c.ffn, c.hidden]), g.weight(&w("ffn_up"), &[c.ffn, c.hidden]));
            let gate = g.matmul(x, wg);
            let up = g.matmul(x, wu);
            let act = g.gelu(gate);
            let m = g.mul(act, up);
            let wd = g.weight(&w("ffn_down"), &[c.hidden, c.ffn]);
            let d = g.matmul(m, wd);
            let post_ffw = g.weight(&w("post_ffw_norm"), &[c.hidden]);
            let d = g.rms_norm(d, post_ffw, c.eps);
            h = g.add(h, d);
        }
        let out_norm = g.weight("output_norm.weight", &[c.hidden]);
        h = g.head_rows(h, mode);
        let hn = g.rms_norm(h, out_norm, c.eps);
        let out = match mode {
            OutputMode::Hidden => hn,
            OutputMode::Logits | OutputMode::AllLogits | OutputMode::NextToken => {
                let head = if c.output_weight == "token_embd.weight" { embd } else { g.weight(&c.output_weight, &[c.vocab, c.hidden]) };
                let logits = g.matmul(hn, head);
                if mode == OutputMode::NextToken { g.argmax(logits) } else { logits }
            }
        };
        g.output(mode.output_name(), out);
        Ok(g.finish()?)
    }

    fn kv_layout(&self, context: usize) -> KvLayout {
        let layers = (0..self.layers)
            .map(|l| LayerKv {
                kv_heads: self.kv_heads,
                head_dim_k: self.head_dim,
                head_dim_v: self.head_dim,
                window: if self.is_global(l) { None } else { Some(self.window) },
            })
            .collect();
        KvLayout { layers, context }
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn trained_context(&self) -> usize {
        self.context
    }
}
