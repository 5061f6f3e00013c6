//! The one decoder-only transformer graph builder every family shares, driven by a
//! [`DecoderConfig`]: norms before (and, for Gemma 2/3/4, after) attention and MLP, q/k/v
//! projections with optional biases and per-head norms, RoPE with per-layer spec, causal
//! attention with per-layer window and KV width, a gated MLP, and a (soft-capped) output head.

use kiln_ir::{Among, Bucket, DType, Graph, GraphBuilder, NodeId, OutputMode, RopeSpec, CANDIDATES};
use kiln_runtime::{KvLayout, KvType, LayerKv};

use crate::{Architecture, ModelError};

/// Activation of the gated MLP: `act(x · gateᵀ) * (x · upᵀ)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (Gemma).
    GeluTanh,
    /// SiLU (Llama, Qwen: SwiGLU).
    Silu,
}

/// What differs from layer to layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head size of queries, keys and values.
    pub head_dim: usize,
    /// RoPE of this layer's queries and keys.
    pub rope: RopeSpec,
    /// Sliding window (a query sees the last `window` positions), or none for global attention.
    pub window: Option<usize>,
    /// The layer has no value projection: values are the (un-normed, un-rotated) key projection.
    pub v_from_k: bool,
    /// Factor applied to the residual stream after the layer (Gemma 4 `layer_output_scale`).
    pub output_scale: Option<f32>,
}

/// Hyperparameters and structural switches of one decoder-only model.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    /// The `general.architecture` name.
    pub arch: &'static str,
    /// Residual width.
    pub hidden: usize,
    /// MLP inner width.
    pub ffn: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// RMS norm epsilon.
    pub eps: f32,
    /// Trained context length.
    pub context: usize,
    /// Per-layer attention shape, RoPE and window (one entry per layer).
    pub layers: Vec<LayerConfig>,
    /// Scale of the gathered embeddings (Gemma: sqrt(hidden); others 1).
    pub embed_scale: f32,
    /// MLP activation.
    pub activation: Activation,
    /// RMS norms on the attention and MLP outputs before the residual adds (Gemma 2/3/4).
    pub post_norms: bool,
    /// Per-head RMS norms of queries and keys (Qwen 3, Gemma 3/4).
    pub qk_norm: bool,
    /// Weightless RMS norm of values per head (Gemma 4).
    pub v_norm: bool,
    /// Biases on the q/k/v projections (Qwen 2).
    pub qkv_bias: bool,
    /// Attention score scale (1/sqrt(head_dim) or 1/sqrt(query_pre_attn_scalar)).
    pub attn_scale: f32,
    /// Soft-capping of attention scores (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Soft-capping of the final logits (Gemma 2).
    pub final_softcap: Option<f32>,
    /// Name of the output projection (`output.weight`, or the tied embedding).
    pub output_weight: String,
}

impl DecoderConfig {
    /// Number of decoder layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
}

/// `blk.{l}.{name}.weight`.
fn layer_weight(l: usize, name: &str) -> String {
    format!("blk.{l}.{name}.weight")
}

impl DecoderConfig {
    /// `x · Wᵀ (+ bias)` for the projection `name` of layer `l` ([n, k]).
    fn projection(&self, g: &mut GraphBuilder, x: NodeId, l: usize, name: &str, [n, k]: [usize; 2], bias: bool) -> NodeId {
        let w = g.weight(&layer_weight(l, name), &[n, k]);
        let y = g.matmul(x, w);
        if bias {
            let b = g.weight(&format!("blk.{l}.{name}.bias"), &[n]);
            g.add_bias(y, b)
        } else {
            y
        }
    }

    /// One attention block: returns its output projection ([rows, hidden]).
    fn attention_block(&self, g: &mut GraphBuilder, x: NodeId, positions: NodeId, l: usize) -> NodeId {
        let lc = &self.layers[l];
        let (rows, d) = (g.rows(), lc.head_dim);
        let (qw, kw) = (self.q_heads * d, lc.kv_heads * d);
        let q = self.projection(g, x, l, "attn_q", [qw, self.hidden], self.qkv_bias);
        let k = self.projection(g, x, l, "attn_k", [kw, self.hidden], self.qkv_bias);
        let v = if lc.v_from_k { k } else { self.projection(g, x, l, "attn_v", [kw, self.hidden], self.qkv_bias) };
        let mut q = g.reshape(q, &[rows, self.q_heads, d]);
        let mut k = g.reshape(k, &[rows, lc.kv_heads, d]);
        let mut v = g.reshape(v, &[rows, lc.kv_heads, d]);
        if self.v_norm {
            v = g.normalize(v, self.eps);
        }
        if self.qk_norm {
            let (qn, kn) = (g.weight(&layer_weight(l, "attn_q_norm"), &[d]), g.weight(&layer_weight(l, "attn_k_norm"), &[d]));
            q = g.rms_norm(q, qn, self.eps);
            k = g.rms_norm(k, kn, self.eps);
        }
        let q = g.rope_with(q, positions, lc.rope.clone());
        let k = g.rope_with(k, positions, lc.rope.clone());
        let a = g.attention_capped(q, k, v, l, lc.window, self.attn_scale, self.attn_softcap);
        let wo = g.weight(&layer_weight(l, "attn_output"), &[self.hidden, qw]);
        g.matmul(a, wo)
    }

    /// The gated MLP: `down(act(gate(x)) * up(x))`.
    fn mlp(&self, g: &mut GraphBuilder, x: NodeId, l: usize) -> NodeId {
        let gate = self.projection(g, x, l, "ffn_gate", [self.ffn, self.hidden], false);
        let up = self.projection(g, x, l, "ffn_up", [self.ffn, self.hidden], false);
        let act = match self.activation {
            Activation::GeluTanh => g.gelu(gate),
            Activation::Silu => g.silu(gate),
        };
        let m = g.mul(act, up);
        self.projection(g, m, l, "ffn_down", [self.hidden, self.ffn], false)
    }

    /// `rms_norm(x, blk.{l}.{name})` when the family has post norms, else `x`.
    fn post_norm(&self, g: &mut GraphBuilder, x: NodeId, l: usize, name: &str) -> NodeId {
        if !self.post_norms {
            return x;
        }
        let w = g.weight(&layer_weight(l, name), &[self.hidden]);
        g.rms_norm(x, w, self.eps)
    }
}

impl Architecture for DecoderConfig {
    fn name(&self) -> &'static str {
        self.arch
    }

    fn build_graph(&self, bucket: Bucket, mode: OutputMode) -> Result<Graph, ModelError> {
        let c = self;
        let mut g = GraphBuilder::new(bucket);
        let tokens = g.input("tokens", DType::I32);
        let positions = g.input("positions", DType::I32);
        let embd = g.weight("token_embd.weight", &[c.vocab, c.hidden]);
        let mut h = g.embed(embd, tokens, c.embed_scale);
        for l in 0..c.n_layers() {
            let attn_norm = g.weight(&layer_weight(l, "attn_norm"), &[c.hidden]);
            let x = g.rms_norm(h, attn_norm, c.eps);
            let o = c.attention_block(&mut g, x, positions, l);
            let o = c.post_norm(&mut g, o, l, "post_attention_norm");
            h = g.add(h, o);
            let ffn_norm = g.weight(&layer_weight(l, "ffn_norm"), &[c.hidden]);
            let x = g.rms_norm(h, ffn_norm, c.eps);
            let d = c.mlp(&mut g, x, l);
            let d = c.post_norm(&mut g, d, l, "post_ffw_norm");
            h = g.add(h, d);
            if let Some(s) = c.layers[l].output_scale {
                h = g.scale(h, s);
            }
        }
        let out_norm = g.weight("output_norm.weight", &[c.hidden]);
        h = g.head_rows(h, mode);
        let hn = g.rms_norm(h, out_norm, c.eps);
        let out = match mode {
            OutputMode::Hidden => hn,
            OutputMode::Logits | OutputMode::AllLogits | OutputMode::NextToken | OutputMode::Candidates | OutputMode::Drawn(_) => {
                let head = if c.output_weight == "token_embd.weight" { embd } else { g.weight(&c.output_weight, &[c.vocab, c.hidden]) };
                let logits = g.matmul(hn, head);
                match (mode, c.final_softcap) {
                    // tanh is monotonic, so soft-capping never changes which logit is largest:
                    // the greedy head takes the argmax of the raw products (and stays one fused
                    // MatMulArgmax kernel that never writes the logits).
                    (OutputMode::NextToken, _) => g.argmax(logits),
                    // (Chosen on the raw products too, a fused MatMulTopK; the kept ones capped.)
                    (OutputMode::Candidates, cap) => g.top_k(logits, CANDIDATES.min(c.vocab), cap),
                    (OutputMode::Drawn(Among::Candidates), cap) => {
                        let top = g.top_k(logits, CANDIDATES, cap);
                        g.draw(top, Among::Candidates)
                    }
                    (OutputMode::Drawn(Among::Vocabulary), cap) => {
                        let logits = cap.map_or(logits, |cap| g.soft_cap(logits, cap));
                        g.draw(logits, Among::Vocabulary)
                    }
                    (_, Some(cap)) => g.soft_cap(logits, cap),
                    (_, None) => logits,
                }
            }
        };
        g.output(mode.output_name(), out);
        Ok(g.finish()?)
    }

    fn kv_layout(&self, context: usize, elem: KvType) -> KvLayout {
        let layers = self
            .layers
            .iter()
            .map(|lc| LayerKv { kv_heads: lc.kv_heads, head_dim_k: lc.head_dim, head_dim_v: lc.head_dim, window: lc.window })
            .collect();
        KvLayout { layers, context, elem }
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn trained_context(&self) -> usize {
        self.context
    }
}
