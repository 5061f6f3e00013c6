//! End-to-end tests on tiny random-weight Gemma 3 models written with `kiln_models::synth`: the decode,
//! chunked, padded and one-shot paths agree; output modes are consistent; the sliding window is
//! real; bad input is an error that names the problem; generation stops for the right reasons;
//! plans are compiled once per (mode, bucket) and share one copy of the weights.

use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kiln_cpu::CpuBackend;
use kiln_gguf::{MetaArray, MetaValue};
use kiln_ir::{Among, Bucket, BucketPolicy};
use kiln_models::synth::{SynthModel as Parts, SynthRng as Rng, SynthTensor as Tensor};
use kiln_models::{
    config_from_gguf, generate, FinishReason, GenerateParams, Generation, Generator, JsonObjectPrefix, Model, ModelError, OutputFormat,
    OutputMode, Sampler, SamplingParams, Session, StepOutput, TextControl,
};
use kiln_quant::GgmlType;
use kiln_runtime::draw::{self, Rng as DrawRng};
use kiln_runtime::{
    Backend, DeviceWeights, DrawSpec, EngineConfig, Executable, HostTensor, KvCache, KvLayout, Plan, RuntimeError, StepInputs, WeightStore,
};

// ---------------------------------------------------------------------------------------------
// The synthetic model
// ---------------------------------------------------------------------------------------------

const HIDDEN: usize = 256;
const FFN: usize = 512;
const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 32;
const WINDOW: usize = 4;
const TRAINED_CONTEXT: usize = 256;
/// Control/unknown tokens (pad, eos, bos, unk), then 256 byte tokens, then `PIECES`.
const N_SPECIAL: usize = 4;
const EOS: u32 = 1;
const BOS: u32 = 2;
/// SentencePiece pieces and scores (every multi-character piece is reachable by merging two pieces).
const PIECES: &[(&str, f32)] = &[
    ("he", -1.0),
    ("ll", -2.0),
    ("or", -3.0),
    ("ld", -4.0),
    ("\u{2581}w", -5.0),
    ("\u{2581}he", -6.0),
    ("\u{2581}hell", -7.0),
    ("\u{2581}hello", -8.0),
    ("\u{2581}wor", -9.0),
    ("\u{2581}world", -10.0),
    ("\u{2581}t", -11.0),
    ("\u{2581}the", -12.0),
    ("in", -13.0),
    ("ing", -14.0),
    ("er", -15.0),
    ("nd", -16.0),
    ("\u{2581}a", -17.0),
    ("\u{2581}and", -18.0),
    ("\u{2581}", -100.0),
    ("a", -100.0),
    ("d", -100.0),
    ("e", -100.0),
    ("g", -100.0),
    ("h", -100.0),
    ("i", -100.0),
    ("l", -100.0),
    ("n", -100.0),
    ("o", -100.0),
    ("r", -100.0),
    ("t", -100.0),
    ("w", -100.0),
];
const VOCAB: usize = N_SPECIAL + 256 + PIECES.len();

/// Block formats for matrices whose rows are a multiple of 256 (K-quants included) ...
const WIDE: [GgmlType; 5] = [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::F16];
/// ... and for rows of 128 (`attn_output`: q_heads × head_dim).
const NARROW: [GgmlType; 3] = [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::F16];

/// Test conveniences over the library's editable model (panicking on a missing key or tensor).
trait PartsExt {
    fn remove_meta(&mut self, key: &str);
    fn remove_tensor(&mut self, name: &str);
    fn tensor(&self, name: &str) -> &Tensor;
    fn tensor_mut(&mut self, name: &str) -> &mut Tensor;
    /// A tensor dequantized to f32.
    fn dequantized(&self, name: &str) -> Vec<f32>;
}

impl PartsExt for Parts {
    fn remove_meta(&mut self, key: &str) {
        let before = self.meta.len();
        self.meta.retain(|(k, _)| k != key);
        assert_eq!(self.meta.len() + 1, before, "no metadata key {key}");
    }

    fn remove_tensor(&mut self, name: &str) {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_eq!(self.tensors.len() + 1, before, "no tensor {name}");
    }

    fn tensor(&self, name: &str) -> &Tensor {
        self.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors.iter_mut().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn dequantized(&self, name: &str) -> Vec<f32> {
        let t = self.tensor(name);
        let mut out = vec![0f32; t.dims.iter().product::<u64>() as usize];
        kiln_quant::dequantize(t.ty, &t.data, &mut out).unwrap();
        out
    }
}

fn tokenizer_meta(meta: &mut Vec<(String, MetaValue)>) {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].iter().map(|s| s.to_string()).collect();
    let mut types = vec![3, 3, 3, 2];
    let mut scores = vec![0f32; N_SPECIAL];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for &(p, score) in PIECES {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(score);
    }
    assert_eq!(tokens.len(), VOCAB);
    let s = |v: &str| MetaValue::String(v.to_string());
    meta.push(("tokenizer.ggml.model".into(), s("llama")));
    meta.push(("tokenizer.ggml.tokens".into(), MetaValue::Array(MetaArray::String(tokens))));
    meta.push(("tokenizer.ggml.scores".into(), MetaValue::Array(MetaArray::F32(scores))));
    meta.push(("tokenizer.ggml.token_type".into(), MetaValue::Array(MetaArray::I32(types))));
    meta.push(("tokenizer.ggml.padding_token_id".into(), MetaValue::U32(0)));
    meta.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(EOS)));
    meta.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(BOS)));
    meta.push(("tokenizer.ggml.unknown_token_id".into(), MetaValue::U32(3)));
}

/// A Gemma 3 model of `layers` layers with random weights in a mix of block formats.
fn build_parts(layers: usize) -> Parts {
    let mut meta = Vec::new();
    let u32v = |v: usize| MetaValue::U32(v as u32);
    meta.push(("general.architecture".to_string(), MetaValue::String("gemma3".into())));
    meta.push(("gemma3.embedding_length".into(), u32v(HIDDEN)));
    meta.push(("gemma3.block_count".into(), u32v(layers)));
    meta.push(("gemma3.feed_forward_length".into(), u32v(FFN)));
    meta.push(("gemma3.attention.head_count".into(), u32v(Q_HEADS)));
    meta.push(("gemma3.attention.head_count_kv".into(), u32v(KV_HEADS)));
    meta.push(("gemma3.attention.key_length".into(), u32v(HEAD_DIM)));
    meta.push(("gemma3.attention.value_length".into(), u32v(HEAD_DIM)));
    meta.push(("gemma3.attention.layer_norm_rms_epsilon".into(), MetaValue::F32(1e-6)));
    meta.push(("gemma3.rope.freq_base".into(), MetaValue::F32(1e6)));
    meta.push(("gemma3.attention.sliding_window".into(), u32v(WINDOW)));
    meta.push(("gemma3.context_length".into(), u32v(TRAINED_CONTEXT)));
    tokenizer_meta(&mut meta);

    let mut rng = Rng(0x6b69_6c6e ^ layers as u64);
    let mut tensors = Vec::new();
    // Embedding (also the tied output head). Special tokens get small rows so that their logits
    // stay near 0 and generation is not cut short by <eos>.
    let mut embd: Vec<f32> = (0..VOCAB * HIDDEN).map(|_| rng.weight(0.1)).collect();
    embd[..N_SPECIAL * HIDDEN].iter_mut().for_each(|v| *v *= 0.1);
    let data = kiln_quant::quantize(GgmlType::Q6_K, &embd).unwrap();
    tensors.push(Tensor { name: "token_embd.weight".into(), dims: vec![HIDDEN as u64, VOCAB as u64], ty: GgmlType::Q6_K, data });

    // `scale`: magnitude of matrix entries; for vectors (norm weights), their mean.
    let mut add = |rng: &mut Rng, name: String, dims: &[usize], ty: GgmlType, scale: f32| {
        let n: usize = dims.iter().product();
        let values: Vec<f32> = if dims.len() == 1 {
            // Norm weights: positive, spread ±50% around `scale`.
            (0..n).map(|_| scale * (0.5 + rng.unit())).collect()
        } else {
            (0..n).map(|_| rng.weight(scale)).collect()
        };
        let data = kiln_quant::quantize(ty, &values).unwrap_or_else(|e| panic!("{name}: {e}"));
        tensors.push(Tensor { name, dims: dims.iter().map(|&d| d as u64).collect(), ty, data });
    };

    let (qw, kw) = (Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mat = |k: usize| 1.7 / (k as f32).sqrt();
    for l in 0..layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let wide = |i: usize| WIDE[(l + i) % WIDE.len()];
        add(&mut rng, n("attn_norm"), &[HIDDEN], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_q"), &[HIDDEN, qw], wide(0), mat(HIDDEN));
        add(&mut rng, n("attn_k"), &[HIDDEN, kw], wide(1), mat(HIDDEN));
        add(&mut rng, n("attn_v"), &[HIDDEN, kw], wide(2), mat(HIDDEN));
        add(&mut rng, n("attn_q_norm"), &[HEAD_DIM], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_k_norm"), &[HEAD_DIM], GgmlType::F32, 1.0);
        add(&mut rng, n("attn_output"), &[qw, HIDDEN], NARROW[l % NARROW.len()], mat(qw));
        add(&mut rng, n("post_attention_norm"), &[HIDDEN], GgmlType::F32, 2.0);
        add(&mut rng, n("ffn_norm"), &[HIDDEN], GgmlType::F32, 1.0);
        add(&mut rng, n("ffn_gate"), &[HIDDEN, FFN], wide(3), mat(HIDDEN));
        add(&mut rng, n("ffn_up"), &[HIDDEN, FFN], wide(4), mat(HIDDEN));
        add(&mut rng, n("ffn_down"), &[FFN, HIDDEN], wide(2), mat(FFN));
        add(&mut rng, n("post_ffw_norm"), &[HIDDEN], GgmlType::F32, 2.0);
    }
    add(&mut rng, "output_norm.weight".into(), &[HIDDEN], GgmlType::F32, 1.0);
    Parts { meta, tensors }
}

/// The model parts for `layers` layers (built once per layer count).
fn parts(layers: usize) -> Parts {
    static CACHE: OnceLock<Mutex<Vec<(usize, Parts)>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap();
    if let Some((_, p)) = cache.iter().find(|(l, _)| *l == layers) {
        return p.clone();
    }
    let p = build_parts(layers);
    cache.push((layers, p.clone()));
    p
}

/// Writes `parts` to a unique temporary file, loads it and removes the file (the mapping stays).
fn load_parts(parts: &Parts, backend: Arc<dyn Backend>, config: EngineConfig) -> Result<Model, ModelError> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let path: PathBuf =
        std::env::temp_dir().join(format!("kiln-synthetic-{}-{}.gguf", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    parts.write(&path).unwrap();
    let model = Model::load(&path, backend, config);
    std::fs::remove_file(&path).unwrap();
    model
}

fn config() -> EngineConfig {
    EngineConfig { threads: 2, ..Default::default() }
}

fn load_with(layers: usize, config: EngineConfig) -> Model {
    load_parts(&parts(layers), Arc::new(CpuBackend::new(2)), config).unwrap()
}

/// Seven layers: layer 5 is global, the others slide over a window of 4.
fn load(config: EngineConfig) -> Model {
    load_with(7, config)
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// `n` ordinary (non-special) token ids, varied.
fn prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng(seed);
    (0..n).map(|_| N_SPECIAL as u32 + (rng.next_u64() % (VOCAB - N_SPECIAL) as u64) as u32).collect()
}

fn logits(s: &mut Session<'_>, tokens: &[u32]) -> Vec<f32> {
    match s.forward(tokens, OutputMode::Logits).unwrap() {
        StepOutput::Logits(v) => {
            assert_eq!(v.len(), VOCAB);
            v
        }
        other => panic!("expected logits, got {other:?}"),
    }
}

fn all_logits(s: &mut Session<'_>, tokens: &[u32]) -> Vec<f32> {
    match s.forward(tokens, OutputMode::AllLogits).unwrap() {
        StepOutput::AllLogits { rows, data } => {
            assert_eq!(rows, tokens.len());
            assert_eq!(data.len(), rows * VOCAB);
            data
        }
        other => panic!("expected all logits, got {other:?}"),
    }
}

fn next_token(s: &mut Session<'_>, tokens: &[u32]) -> u32 {
    match s.forward(tokens, OutputMode::NextToken).unwrap() {
        StepOutput::Token(t) => t,
        other => panic!("expected a token, got {other:?}"),
    }
}

/// One session per prompt, each prefilled with its prompt.
fn prefilled<'m>(model: &'m Model, prompts: &[Vec<u32>]) -> Vec<Session<'m>> {
    prompts
        .iter()
        .map(|p| {
            let mut s = model.new_session().unwrap();
            logits(&mut s, p);
            s
        })
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// `a` equals `b` within `tol` relative to `b`'s largest magnitude (which must be substantial).
fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    let scale = max_abs(b);
    assert!(scale > 0.5, "{what}: degenerate reference (max |x| = {scale})");
    assert!(a.iter().all(|x| x.is_finite()), "{what}: non-finite values");
    let err = max_diff(a, b);
    assert!(err <= tol * scale, "{what}: max difference {err} exceeds {tol} × {scale}");
}

/// `a` differs from `b` by well more than rounding.
fn assert_differs(a: &[f32], b: &[f32], what: &str) {
    let (err, scale) = (max_diff(a, b), max_abs(b));
    assert!(err > 1e-3 * scale, "{what}: expected different logits, max difference {err} (scale {scale})");
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams { max_tokens, sampling: SamplingParams::default(), stop: vec![], format: Default::default() }
}

fn sampled(max_tokens: usize, seed: u64) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling: SamplingParams { temperature: 1.0, seed, ..Default::default() },
        stop: vec![],
        format: Default::default(),
    }
}

/// Runs `generate` in a fresh session, returning the result and the text streamed to the callback.
fn run_generate(model: &Model, prompt: &[u32], params: &GenerateParams) -> (Generation, String) {
    let mut s = model.new_session().unwrap();
    let mut streamed = String::new();
    let g = generate(&mut s, prompt, params, &mut |t| {
        streamed.push_str(t);
        TextControl::Continue
    })
    .unwrap();
    if g.finish == FinishReason::Length {
        // The last token is returned but never fed back.
        assert_eq!(s.position(), prompt.len() + g.tokens.len() - 1, "session position after generation");
    }
    (g, streamed)
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn config_and_tokenizer_come_from_the_metadata() {
    let model = load(config());
    let c = config_from_gguf(model.file()).unwrap();
    assert_eq!((c.arch, c.n_layers(), c.hidden, c.ffn, c.q_heads), ("gemma3", 7, HIDDEN, FFN, Q_HEADS));
    assert!(c.layers.iter().all(|l| (l.kv_heads, l.head_dim) == (KV_HEADS, HEAD_DIM)));
    assert_eq!((c.vocab, c.context), (VOCAB, TRAINED_CONTEXT));
    assert_eq!(c.output_weight, "token_embd.weight");
    assert!((c.attn_scale - 1.0 / (HEAD_DIM as f32).sqrt()).abs() < 1e-7);
    assert!((c.embed_scale - (HIDDEN as f32).sqrt()).abs() < 1e-4);
    assert!(c.post_norms && c.qk_norm && !c.qkv_bias && c.attn_softcap.is_none() && c.final_softcap.is_none());
    // Every 6th layer is global with base 1e6; the others slide over the window with base 1e4.
    let windows: Vec<Option<usize>> = c.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows, [Some(WINDOW), Some(WINDOW), Some(WINDOW), Some(WINDOW), Some(WINDOW), None, Some(WINDOW)]);
    let bases: Vec<f32> = c.layers.iter().map(|l| l.rope.theta).collect();
    assert_eq!(bases, [1e4, 1e4, 1e4, 1e4, 1e4, 1e6, 1e4]);
    assert!(c.layers.iter().all(|l| l.rope.is_plain_neox()));
    assert_eq!(model.architecture().vocab_size(), VOCAB);
    // The default context (8192) is capped at the trained one; 0 means the trained one.
    assert_eq!(model.context(), TRAINED_CONTEXT);
    assert_eq!(load(EngineConfig { context: 0, ..config() }).context(), TRAINED_CONTEXT);
    assert_eq!(load(EngineConfig { context: 100, ..config() }).context(), 100);
    let tok = model.tokenizer();
    assert_eq!(tok.vocab_size(), VOCAB);
    let ids = tok.encode("hello world");
    assert_eq!(ids[0], BOS);
    assert_eq!(&ids[1..], &[tok.token_id("\u{2581}hello").unwrap(), tok.token_id("\u{2581}world").unwrap()]);
    assert_eq!(tok.decode(&ids, true), "hello world");
    assert!(tok.is_end_of_generation(EOS));
}

#[test]
fn decode_equals_prefill() {
    let model = load(config());
    let tokens = prompt(20, 1);
    assert!(tokens.len() > 4 * WINDOW);
    let mut one_shot = model.new_session().unwrap();
    let all = all_logits(&mut one_shot, &tokens);
    let mut last_shot = model.new_session().unwrap();
    let last = logits(&mut last_shot, &tokens);
    assert_eq!(last_shot.position(), tokens.len());
    let mut dec = model.new_session().unwrap();
    for (p, &t) in tokens.iter().enumerate() {
        let l = logits(&mut dec, &[t]);
        assert_eq!(dec.position(), p + 1);
        assert_close(&l, &all[p * VOCAB..(p + 1) * VOCAB], 1e-4, &format!("decode vs prefill at position {p}"));
        if p == tokens.len() - 1 {
            assert_close(&l, &last, 1e-4, "decode vs prefill, last position");
        }
    }
    // The model is not degenerate: positions get different logits.
    assert_differs(&all[..VOCAB], &all[(tokens.len() - 1) * VOCAB..], "first vs last position");
    // Decoding continues identically after a prefill.
    let next = prompt(3, 2);
    for &t in &next {
        let a = logits(&mut last_shot, &[t]);
        let b = logits(&mut dec, &[t]);
        assert_close(&a, &b, 1e-4, "decode after prefill vs decode after decode");
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    let model = load(config());
    let chunked = load(EngineConfig { max_prefill_rows: 3, max_logit_rows: 2, ..config() });
    // 20 = 6 × 3 + 2; 19 = 6 × 3 + 1 (the last chunk runs through the decode bucket).
    for n in [20, 19, 3, 4] {
        let tokens = prompt(n, 3);
        let mut s = model.new_session().unwrap();
        let want = logits(&mut s, &tokens);
        let mut c = chunked.new_session().unwrap();
        assert_close(&logits(&mut c, &tokens), &want, 1e-4, &format!("{n} tokens in chunks of 3"));
        assert_eq!(c.position(), n);
        // Next-token output through chunks too.
        let mut c = chunked.new_session().unwrap();
        assert_eq!(next_token(&mut c, &tokens), argmax(&want), "{n} tokens: chunked next token");

        let mut s = model.new_session().unwrap();
        let one = all_logits(&mut s, &tokens);
        let mut c = chunked.new_session().unwrap();
        let parts = all_logits(&mut c, &tokens);
        assert_eq!(c.position(), n);
        for p in 0..n {
            let row = |v: &[f32]| v[p * VOCAB..(p + 1) * VOCAB].to_vec();
            assert_close(&row(&parts), &row(&one), 1e-4, &format!("{n} tokens: all-logits row {p} in chunks of 2"));
        }
        assert_close(&one[(n - 1) * VOCAB..], &want, 1e-5, &format!("{n} tokens: last all-logits row vs logits"));
    }
    // Chunks also work after earlier tokens (start > 0).
    let (a, b) = (prompt(5, 4), prompt(11, 5));
    let mut s = model.new_session().unwrap();
    s.forward(&a, OutputMode::Hidden).unwrap();
    let want = logits(&mut s, &b);
    let mut c = chunked.new_session().unwrap();
    c.forward(&a, OutputMode::Hidden).unwrap();
    assert_close(&logits(&mut c, &b), &want, 1e-4, "chunked continuation");
}

#[test]
fn padded_buckets_equal_exact_steps() {
    let model = load(config());
    let policy = BucketPolicy::new(model.context());
    assert_eq!(policy.prefill(7), Bucket::Prefill { rows: 8, seqs: 1 }, "7 rows run in a padded bucket");
    assert_eq!(policy.prefill(6), Bucket::Prefill { rows: 6, seqs: 1 }, "6 rows run exactly");
    let tokens = prompt(7, 6);
    let mut padded = model.new_session().unwrap();
    let want = logits(&mut padded, &tokens);
    let mut split = model.new_session().unwrap();
    split.forward(&tokens[..6], OutputMode::Hidden).unwrap();
    assert_close(&logits(&mut split, &tokens[6..]), &want, 1e-4, "7 tokens (bucket 8) vs 6 + 1");
    assert_eq!((padded.position(), split.position()), (7, 7));
    // Padded rows leave nothing behind: the next steps agree too.
    let more = prompt(15, 7);
    let a = logits(&mut padded, &more);
    let b = logits(&mut split, &more);
    assert_eq!(policy.prefill(15), Bucket::Prefill { rows: 16, seqs: 1 });
    assert_close(&a, &b, 1e-4, "15 tokens (bucket 16) after a padded step");
    // And one at a time from the same point.
    let mut dec = model.new_session().unwrap();
    let mut last = Vec::new();
    for &t in tokens.iter().chain(&more) {
        last = logits(&mut dec, &[t]);
    }
    assert_close(&last, &a, 1e-4, "22 single steps vs padded 7 + padded 15");
}

#[test]
fn next_token_is_argmax_and_hidden_is_the_final_norm_state() {
    let parts = parts(7);
    let model = load_parts(&parts, Arc::new(CpuBackend::new(2)), config()).unwrap();
    let embd = parts.dequantized("token_embd.weight");
    let tokens = prompt(24, 8);
    // Prefill of several lengths (exact and padded buckets, inside and beyond the window).
    let mut seen = BTreeSet::new();
    for n in [1, 2, 5, 7, 12, 24] {
        let mut a = model.new_session().unwrap();
        let l = logits(&mut a, &tokens[..n]);
        let mut b = model.new_session().unwrap();
        assert_eq!(next_token(&mut b, &tokens[..n]), argmax(&l), "prefill of {n}: next token");
        seen.insert(argmax(&l));
        let mut c = model.new_session().unwrap();
        let h = match c.forward(&tokens[..n], OutputMode::Hidden).unwrap() {
            StepOutput::Hidden(h) => h,
            other => panic!("expected hidden, got {other:?}"),
        };
        assert_eq!(h.len(), HIDDEN);
        // The logits are the hidden state times the (tied) embedding.
        let from_hidden: Vec<f32> =
            (0..VOCAB).map(|v| embd[v * HIDDEN..(v + 1) * HIDDEN].iter().zip(&h).map(|(e, x)| e * x).sum()).collect();
        assert_close(&from_hidden, &l, 1e-4, &format!("prefill of {n}: hidden · embeddingᵀ vs logits"));
    }
    assert!(seen.len() > 1, "different prompts should predict different tokens: {seen:?}");
    // Decode steps.
    let (mut a, mut b) = (model.new_session().unwrap(), model.new_session().unwrap());
    for (p, &t) in tokens.iter().enumerate() {
        let l = logits(&mut a, &[t]);
        assert_eq!(next_token(&mut b, &[t]), argmax(&l), "decode at position {p}: next token");
    }
}

#[test]
fn sliding_window_limits_what_sliding_layers_see() {
    let n = 24;
    let base = prompt(n, 9);
    let mut changed = base.clone();
    changed[0] = if base[0] == 100 { 101 } else { 100 };

    // With a global layer (layer 5 of 7) the first token reaches every position.
    let model = load(config());
    let (mut a, mut b) = (model.new_session().unwrap(), model.new_session().unwrap());
    let (la, lb) = (all_logits(&mut a, &base), all_logits(&mut b, &changed));
    for p in 0..n {
        let row = |v: &[f32]| v[p * VOCAB..(p + 1) * VOCAB].to_vec();
        assert_differs(&row(&la), &row(&lb), &format!("global model, position {p}"));
    }

    // All sliding (5 layers, window 4): position p sees positions >= p - 5 × 3 through the stack.
    let layers = 5;
    let sliding = load_with(layers, config());
    let c = config_from_gguf(sliding.file()).unwrap();
    assert!(c.layers.iter().all(|l| l.window == Some(WINDOW)));
    let reach = layers * (WINDOW - 1);
    let (mut a, mut b) = (sliding.new_session().unwrap(), sliding.new_session().unwrap());
    let (la, lb) = (all_logits(&mut a, &base), all_logits(&mut b, &changed));
    for p in 0..n {
        let row = |v: &[f32]| v[p * VOCAB..(p + 1) * VOCAB].to_vec();
        if p <= reach {
            assert_differs(&row(&la), &row(&lb), &format!("sliding model, position {p} <= {reach}"));
        } else {
            assert_eq!(row(&la), row(&lb), "sliding model, position {p} > {reach} must not see token 0");
        }
    }
    // The decode path (ring-buffer KV cache) agrees: far positions are unaffected, near ones are.
    let (mut a, mut b) = (sliding.new_session().unwrap(), sliding.new_session().unwrap());
    for p in 0..n {
        let (x, y) = (logits(&mut a, &[base[p]]), logits(&mut b, &[changed[p]]));
        if p <= reach {
            assert_differs(&x, &y, &format!("sliding model, decode position {p}"));
        } else {
            assert_eq!(x, y, "sliding model, decode position {p} > {reach} must not see token 0");
        }
    }
}

/// The error of loading `parts` and, if that works, running a short prompt.
fn first_error(parts: &Parts) -> ModelError {
    let model = match load_parts(parts, Arc::new(CpuBackend::new(2)), config()) {
        Ok(m) => m,
        Err(e) => return e,
    };
    let mut s = model.new_session().unwrap();
    s.forward(&prompt(3, 10), OutputMode::Logits).expect_err("the broken model ran")
}

#[test]
fn errors_name_the_problem() {
    let mut p = parts(7);
    p.set_meta("general.architecture", MetaValue::String("llama9".into()));
    let e = first_error(&p);
    assert!(matches!(&e, ModelError::UnsupportedArchitecture(a) if a == "llama9"), "{e:?}");
    assert!(e.to_string().contains("llama9") && e.to_string().contains("gemma3"), "{e}");

    let mut p = parts(7);
    p.remove_meta("gemma3.embedding_length");
    let e = first_error(&p).to_string();
    assert!(e.contains("gemma3.embedding_length"), "{e}");

    let mut p = parts(7);
    p.remove_tensor("blk.0.ffn_up.weight");
    let e = first_error(&p).to_string();
    assert!(e.contains("blk.0.ffn_up.weight"), "{e}");

    let mut p = parts(7);
    p.remove_tensor("token_embd.weight");
    let e = first_error(&p).to_string();
    assert!(e.contains("token_embd.weight"), "{e}");

    // An embedding with fewer rows than the tokenizer has tokens.
    let mut p = parts(7);
    let t = p.tensor_mut("token_embd.weight");
    t.data.truncate(t.ty.row_bytes(HIDDEN).unwrap() * (VOCAB - 1));
    t.dims[1] -= 1;
    let e = first_error(&p);
    assert!(matches!(e, ModelError::Metadata(_)), "{e:?}");
    assert!(e.to_string().contains(&format!("{VOCAB} tokens")) && e.to_string().contains(&format!("{} rows", VOCAB - 1)), "{e}");

    // Same bytes, transposed shape: [hidden rows of ffn] instead of [ffn rows of hidden].
    let mut p = parts(7);
    p.tensor_mut("blk.3.ffn_down.weight").dims = vec![HIDDEN as u64, FFN as u64];
    let e = first_error(&p);
    assert!(matches!(&e, ModelError::Runtime(RuntimeError::WeightShape { name, .. }) if name == "blk.3.ffn_down.weight"), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("blk.3.ffn_down.weight") && e.contains(&format!("{:?}", [HIDDEN, FFN])), "{e}");
}

#[test]
fn too_long_prompts_and_bad_tokens_are_errors_and_the_session_survives() {
    let model = load(EngineConfig { context: 16, ..config() });
    assert_eq!(model.context(), 16);
    let tokens = prompt(20, 11);
    let mut s = model.new_session().unwrap();
    match s.forward(&tokens, OutputMode::Logits) {
        Err(ModelError::ContextOverflow { needed: 20, context: 16 }) => {}
        other => panic!("expected a context overflow, got {other:?}"),
    }
    assert_eq!(s.position(), 0);
    let l = logits(&mut s, &tokens[..10]);
    let mut fresh = model.new_session().unwrap();
    assert_eq!(l, logits(&mut fresh, &tokens[..10]), "a session that saw an error computes as a fresh one");
    match s.forward(&tokens[10..17], OutputMode::Logits) {
        Err(ModelError::ContextOverflow { needed: 17, context: 16 }) => {}
        other => panic!("expected a context overflow, got {other:?}"),
    }
    assert_eq!(s.position(), 10);
    let a = logits(&mut s, &tokens[10..16]);
    assert_eq!(a, logits(&mut fresh, &tokens[10..16]));
    assert_eq!(s.position(), 16);
    assert!(matches!(s.forward(&tokens[16..17], OutputMode::NextToken), Err(ModelError::ContextOverflow { needed: 17, .. })));
    // Full, then reset: usable again.
    s.reset();
    assert_eq!(s.position(), 0);
    assert_eq!(logits(&mut s, &tokens[..10]), l);

    // Token ids outside the vocabulary, alone or inside a prompt, in every mode.
    let mut s = model.new_session().unwrap();
    for (bad, mode) in [
        (vec![VOCAB as u32], OutputMode::Logits),
        (vec![5, 6, VOCAB as u32 + 7, 8], OutputMode::NextToken),
        (vec![u32::MAX], OutputMode::Hidden),
        (vec![9, u32::MAX], OutputMode::AllLogits),
    ] {
        let e = s.forward(&bad, mode).expect_err("out-of-range token accepted");
        let id = *bad.iter().find(|&&t| t as usize >= VOCAB).unwrap();
        assert!(matches!(e, ModelError::Runtime(RuntimeError::TokenOutOfRange { id: i, vocab: VOCAB }) if i == id), "{e:?}");
        assert!(e.to_string().contains(&id.to_string()), "{e}");
        assert_eq!(s.position(), 0);
    }
    assert!(matches!(s.forward(&[], OutputMode::Logits), Err(ModelError::InvalidParameter(_))));
    assert_eq!(logits(&mut s, &tokens[..10]), l);
}

#[test]
fn greedy_generation_is_deterministic_and_matches_next_token_steps() {
    let model = load(config());
    let p = prompt(9, 12);
    let (g1, streamed) = run_generate(&model, &p, &greedy(12));
    let (g2, _) = run_generate(&model, &p, &greedy(12));
    assert_eq!(g1, Generation { prefill_secs: g1.prefill_secs, decode_secs: g1.decode_secs, ..g2.clone() });
    assert_eq!(g1.finish, FinishReason::Length);
    assert_eq!(g1.tokens.len(), 12);
    assert_eq!(g1.prompt_tokens, 9);
    assert_eq!(g1.text, model.tokenizer().decode(&g1.tokens, true));
    assert_eq!(streamed, g1.text);
    // Repeated NextToken steps.
    let mut s = model.new_session().unwrap();
    let mut want = vec![next_token(&mut s, &p)];
    while want.len() < 12 {
        let t = *want.last().unwrap();
        want.push(next_token(&mut s, &[t]));
    }
    assert_eq!(g1.tokens, want);
    // Temperature 0 with a negligible penalty takes the Logits + sampler path; it must agree with
    // the in-graph argmax.
    let via_sampler = GenerateParams { sampling: SamplingParams { presence_penalty: 1e-30, ..Default::default() }, ..greedy(12) };
    assert!(!via_sampler.sampling.is_greedy());
    assert_eq!(run_generate(&model, &p, &via_sampler).0.tokens, want);
    // max_tokens of 1.
    let (g, _) = run_generate(&model, &p, &greedy(1));
    assert_eq!((g.tokens.as_slice(), g.finish), (&want[..1], FinishReason::Length));
}

#[test]
fn sampled_generation_is_seeded() {
    let model = load(config());
    let p = prompt(9, 13);
    let params = sampled(24, 5);
    let (a, streamed) = run_generate(&model, &p, &params);
    let (b, _) = run_generate(&model, &p, &params);
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.text, b.text);
    assert_eq!(streamed, a.text);
    assert_eq!((a.finish, a.tokens.len()), (FinishReason::Length, 24));
    let (c, _) = run_generate(&model, &p, &sampled(24, 6));
    assert_ne!(a.tokens, c.tokens, "another seed should sample differently");
    // Sampling is not greedy here: the sampled sequence differs from the greedy one.
    assert_ne!(a.tokens, run_generate(&model, &p, &greedy(24)).0.tokens);
    // The same as sampling by hand from Logits steps.
    let mut sampler = Sampler::new(params.sampling.clone()).unwrap();
    p.iter().for_each(|&t| sampler.observe(t));
    let mut s = model.new_session().unwrap();
    let mut want = vec![sampler.sample(&mut logits(&mut s, &p))];
    while want.len() < 24 {
        let t = *want.last().unwrap();
        sampler.observe(t);
        want.push(sampler.sample(&mut logits(&mut s, &[t])));
    }
    // (Drawn in the graph among all logits, as the sampler draws from them.)
    assert_eq!(a.tokens, want);
    assert_eq!(Generator::new(params.clone(), &p, None).unwrap().mode(), OutputMode::Drawn(Among::Vocabulary));
    // With a top-k below 64 the steps draw among the top-k head's likeliest tokens
    // (`OutputMode::Drawn(Candidates)`) what the sampler draws from all the logits.
    let top_k = GenerateParams { sampling: SamplingParams { top_k: 20, top_p: 0.9, ..params.sampling.clone() }, ..params.clone() };
    assert_eq!(Generator::new(top_k.clone(), &p, None).unwrap().mode(), OutputMode::Drawn(Among::Candidates));
    assert_eq!(Generator::new(top_k.clone(), &p, Some(2)).unwrap().mode(), OutputMode::Logits);
    let top_p = GenerateParams { sampling: SamplingParams { top_p: 0.9, ..params.sampling.clone() }, ..params.clone() };
    assert_eq!(Generator::new(top_p, &p, None).unwrap().mode(), OutputMode::Logits);
    let mut sampler = Sampler::new(top_k.sampling.clone()).unwrap();
    let mut s = model.new_session().unwrap();
    let mut want = vec![sampler.sample(&mut logits(&mut s, &p))];
    while want.len() < 24 {
        let t = *want.last().unwrap();
        want.push(sampler.sample(&mut logits(&mut s, &[t])));
    }
    let (k, _) = run_generate(&model, &p, &top_k);
    assert_eq!(k.tokens, want);
    assert_ne!(k.tokens, a.tokens);
    // Candidates handed to a generation that needs every logit are refused, naming why.
    let mut g = Generator::new(params.clone(), &p, None).unwrap();
    let err = g.advance(model.tokenizer(), StepOutput::Candidates(vec![(5, 1.0)]), p.len(), model.context()).unwrap_err();
    assert!(err.to_string().contains("needs the logits"), "{err}");
}

#[test]
fn stop_strings_cut_the_text() {
    let model = load(config());
    let p = prompt(9, 14);
    let (full, _) = run_generate(&model, &p, &sampled(40, 5));
    assert_eq!(full.finish, FinishReason::Length);
    // A stop string of two characters from the middle of the text whose first occurrence is not
    // at the start.
    let chars: Vec<usize> = full.text.char_indices().map(|(i, _)| i).chain([full.text.len()]).collect();
    assert!(chars.len() >= 8, "too little text to test stop strings: {:?}", full.text);
    let (stop, at) = (chars.len() / 2..chars.len() - 2)
        .map(|i| full.text[chars[i]..chars[i + 2]].to_string())
        .find_map(|s| full.text.find(&s).filter(|&at| at > 0).map(|at| (s, at)))
        .unwrap_or_else(|| panic!("no usable stop string in {:?}", full.text));
    let params = GenerateParams { stop: vec!["never-generated".into(), stop.clone()], ..sampled(40, 5) };
    let (g, streamed) = run_generate(&model, &p, &params);
    assert_eq!(g.finish, FinishReason::Stop);
    assert_eq!(g.text, full.text[..at], "stop string {stop:?}");
    assert_eq!(streamed, g.text, "the stop string is never streamed");
    assert!(g.tokens.len() < full.tokens.len());
    assert_eq!(g.tokens[..], full.tokens[..g.tokens.len()]);
    assert!(model.tokenizer().decode(&g.tokens, true).contains(&stop));
}

#[test]
fn json_object_format_keeps_a_random_model_to_json() {
    // Random weights rarely put a token that continues JSON first: the constraint's full check
    // of the vocabulary does most of the choosing.
    let model = load(config());
    let p = prompt(9, 17);
    for seed in [3, 4] {
        let params = GenerateParams { format: OutputFormat::JsonObject, ..sampled(48, seed) };
        let (g, streamed) = run_generate(&model, &p, &params);
        assert_eq!(streamed, g.text);
        let mut json = JsonObjectPrefix::new();
        assert!(g.text.starts_with('{') && json.feed_all(g.text.as_bytes()), "{:?} is no JSON prefix", g.text);
        match g.finish {
            FinishReason::Stop => assert!(json.is_complete() && serde_json::from_str::<serde_json::Value>(&g.text).unwrap().is_object()),
            other => assert_eq!((other, json.is_complete()), (FinishReason::Length, false), "{:?}", g.text),
        }
        // Unconstrained, the same sampling is no JSON.
        let (free, _) = run_generate(&model, &p, &sampled(48, seed));
        assert!(!JsonObjectPrefix::new().feed_all(free.text.as_bytes()), "{:?}", free.text);
    }
}

/// Generates (sampled, seed 7) with a model whose `<eos>` is `eos`; returns the result and the
/// text streamed to the callback, and checks the session position.
fn generate_with_eos(p: &[u32], eos: u32, stop: Vec<String>) -> (Generation, String) {
    let mut parts = parts(7);
    parts.set_meta("tokenizer.ggml.eos_token_id", MetaValue::U32(eos));
    let model = load_parts(&parts, Arc::new(CpuBackend::new(2)), config()).unwrap();
    assert!(model.tokenizer().is_end_of_generation(eos));
    let mut s = model.new_session().unwrap();
    let mut streamed = String::new();
    let params = GenerateParams { stop, ..sampled(30, 7) };
    let g = generate(&mut s, p, &params, &mut |t| {
        streamed.push_str(t);
        TextControl::Continue
    })
    .unwrap();
    if g.finish == FinishReason::Stop && params.stop.is_empty() {
        assert_eq!(s.position(), p.len() + g.tokens.len(), "every returned token was fed back");
        assert_eq!(g.text, model.tokenizer().decode(&g.tokens, true));
    }
    (g, streamed)
}

#[test]
fn an_end_of_generation_token_stops_and_releases_held_back_text() {
    let model = load(config());
    let p = prompt(9, 17);
    let (full, _) = run_generate(&model, &p, &sampled(30, 7));
    // A token sampled at index k but never before it, made the end-of-generation token, ends the
    // same generation after k tokens.
    let fresh = |i: usize| !full.tokens[..i].contains(&full.tokens[i]);
    let k = (3..full.tokens.len()).find(|&i| fresh(i)).unwrap_or_else(|| panic!("no fresh token in {:?}", full.tokens));
    let (g, streamed) = generate_with_eos(&p, full.tokens[k], vec![]);
    assert_eq!(g.finish, FinishReason::Stop);
    assert_eq!(g.tokens[..], full.tokens[..k], "generation stops before <eos>");
    assert_eq!(streamed, g.text);

    // A stop string that starts with the text's last character holds that character back; the
    // end-of-generation token must release it (it never became a stop string).
    let last = g.text.chars().last().expect("some text before <eos>");
    let (h, streamed) = generate_with_eos(&p, full.tokens[k], vec![format!("{last}\u{2581}never")]);
    assert_eq!((h.finish, &h.tokens), (FinishReason::Stop, &g.tokens));
    assert_eq!(h.text, g.text);
    assert_eq!(streamed, h.text, "held-back text is streamed when <eos> ends generation");

    // The decoder's incomplete character (a UTF-8 lead byte just before <eos>) is released too.
    let lead_byte = |id: u32| (N_SPECIAL as u32 + 0xC2..=N_SPECIAL as u32 + 0xF4).contains(&id);
    let k = (1..full.tokens.len())
        .find(|&i| fresh(i) && lead_byte(full.tokens[i - 1]))
        .unwrap_or_else(|| panic!("no fresh token after a lead byte in {:?}", full.tokens));
    let (g, streamed) = generate_with_eos(&p, full.tokens[k], vec![]);
    assert_eq!((g.finish, &g.tokens[..]), (FinishReason::Stop, &full.tokens[..k]));
    assert!(g.text.ends_with(char::REPLACEMENT_CHARACTER), "{:?}", g.text);
    assert_eq!(streamed, g.text);
}

#[test]
fn the_callback_cancels_and_a_full_context_ends_generation() {
    let model = load(config());
    let p = prompt(9, 15);
    let (full, _) = run_generate(&model, &p, &greedy(20));
    let mut s = model.new_session().unwrap();
    let mut calls = 0;
    let mut streamed = String::new();
    let g = generate(&mut s, &p, &greedy(20), &mut |t| {
        calls += 1;
        streamed.push_str(t);
        if calls == 3 {
            TextControl::Stop
        } else {
            TextControl::Continue
        }
    })
    .unwrap();
    assert_eq!(g.finish, FinishReason::Cancelled);
    assert_eq!(calls, 3, "no callback after cancelling");
    assert!(g.tokens.len() >= 3 && g.tokens.len() < full.tokens.len());
    assert_eq!(g.tokens[..], full.tokens[..g.tokens.len()]);
    assert_eq!(streamed, g.text);

    // Context of 16: a 9-token prompt leaves room for 8 generated tokens (the last is not fed back).
    let small = load(EngineConfig { context: 16, ..config() });
    let mut s = small.new_session().unwrap();
    let g = generate(&mut s, &p, &greedy(100), &mut |_| TextControl::Continue).unwrap();
    assert_eq!(g.finish, FinishReason::ContextFull);
    assert_eq!(s.position(), 16);
    assert_eq!(g.tokens.len(), 8);
    assert_eq!(g.tokens[..], full.tokens[..8], "a smaller context does not change the tokens");
    // A prompt that fills the context exactly yields one token; one more is an error.
    let long = prompt(17, 16);
    let mut s = small.new_session().unwrap();
    let g = generate(&mut s, &long[..16], &greedy(100), &mut |_| TextControl::Continue).unwrap();
    assert_eq!((g.finish, g.tokens.len()), (FinishReason::ContextFull, 1));
    let mut s = small.new_session().unwrap();
    let e = generate(&mut s, &long, &greedy(100), &mut |_| TextControl::Continue).unwrap_err();
    assert!(matches!(e, ModelError::ContextOverflow { needed: 17, context: 16 }), "{e:?}");
    assert_eq!(s.position(), 0);
    let e = generate(&mut s, &[], &greedy(1), &mut |_| TextControl::Continue).unwrap_err();
    assert!(matches!(e, ModelError::InvalidParameter(_)), "{e:?}");
}

/// A CPU backend that records every weight upload and which weights each plan is prepared with.
struct Recording {
    inner: CpuBackend,
    loaded: Mutex<Vec<Arc<dyn DeviceWeights>>>,
    prepared: Mutex<Vec<(usize, Arc<dyn DeviceWeights>)>>,
}

impl Backend for Recording {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn load_weights(&self, store: &Arc<WeightStore>) -> Result<Arc<dyn DeviceWeights>, RuntimeError> {
        let w = self.inner.load_weights(store)?;
        self.loaded.lock().unwrap().push(w.clone());
        Ok(w)
    }

    fn prepare(&self, plan: Arc<Plan>, weights: &Arc<dyn DeviceWeights>) -> Result<Box<dyn Executable>, RuntimeError> {
        self.prepared.lock().unwrap().push((plan.rows(), weights.clone()));
        self.inner.prepare(plan, weights)
    }

    fn new_kv_cache(&self, layout: &KvLayout) -> Result<Box<dyn KvCache>, RuntimeError> {
        self.inner.new_kv_cache(layout)
    }
}

/// The (mode, bucket) keys `Session::forward` uses for `n` tokens after `start`, per the policy.
fn keys_for(policy: &BucketPolicy, config: &EngineConfig, start: usize, n: usize, mode: OutputMode) -> Vec<(OutputMode, Bucket)> {
    let chunk = if mode == OutputMode::AllLogits { config.max_logit_rows } else { config.max_prefill_rows };
    let mut keys = Vec::new();
    let mut pos = start;
    while pos < start + n {
        let len = chunk.min(start + n - pos);
        let last = pos + len == start + n;
        let m = if last || mode == OutputMode::AllLogits { mode } else { OutputMode::Hidden };
        keys.push((m, if len == 1 { policy.decode(pos) } else { policy.prefill(len) }));
        pos += len;
    }
    keys
}

#[test]
fn plans_are_cached_per_bucket_and_share_the_weights() {
    let cfg = EngineConfig { max_prefill_rows: 8, max_logit_rows: 4, ..config() };
    let backend = Arc::new(Recording { inner: CpuBackend::new(2), loaded: Default::default(), prepared: Default::default() });
    let model = load_parts(&parts(7), backend.clone(), cfg.clone()).unwrap();
    assert_eq!(model.plans_compiled(), 0, "nothing is compiled at load");
    let policy = BucketPolicy::new(model.context());
    // (prompt length, mode, decode steps after it)
    let requests: &[(usize, OutputMode, usize)] = &[
        (20, OutputMode::Logits, 3),   // chunks 8 + 8 + 4: Hidden/8, Logits/4; Decode/64
        (7, OutputMode::NextToken, 2), // one padded chunk: NextToken/8; Decode/64
        (6, OutputMode::AllLogits, 0), // chunks 4 + 2: AllLogits/4, AllLogits/2
        (70, OutputMode::Logits, 2),   // 8 × 8 + 6: Hidden/8, Logits/6; Decode/128
        (1, OutputMode::Hidden, 1),    // Hidden/Decode 64 twice
        (16, OutputMode::Logits, 0),   // 8 + 8: Hidden/8, Logits/8
    ];
    let run_all = |expected: &mut HashSet<(OutputMode, Bucket)>| {
        for (i, &(n, mode, steps)) in requests.iter().enumerate() {
            let tokens = prompt(n + steps, 20 + i as u64);
            let mut s = model.new_session().unwrap();
            s.forward(&tokens[..n], mode).unwrap();
            expected.extend(keys_for(&policy, &cfg, 0, n, mode));
            for j in 0..steps {
                s.forward(&tokens[n + j..n + j + 1], mode).unwrap();
                expected.extend(keys_for(&policy, &cfg, n + j, 1, mode));
            }
            assert_eq!(s.position(), n + steps);
        }
    };
    let mut expected = HashSet::new();
    run_all(&mut expected);
    // Sanity of the expected keys against the policy's documented behaviour.
    use OutputMode::*;
    for k in [
        (Hidden, Bucket::Prefill { rows: 8, seqs: 1 }),
        (Logits, Bucket::Prefill { rows: 4, seqs: 1 }),
        (NextToken, Bucket::Prefill { rows: 8, seqs: 1 }),
        (AllLogits, Bucket::Prefill { rows: 2, seqs: 1 }),
        (Logits, Bucket::Decode { past: 64, seqs: 1 }),
        (Logits, Bucket::Decode { past: 128, seqs: 1 }),
        (Hidden, Bucket::Decode { past: 64, seqs: 1 }),
    ] {
        assert!(expected.contains(&k), "{k:?} not in {expected:?}");
    }
    assert_eq!(expected.len(), 11, "{expected:?}");
    assert!(expected.len() <= cfg.plan_cache_capacity, "the test must not evict");
    assert_eq!(model.plans_compiled(), expected.len() as u64, "{expected:?}");

    // Repeating every request compiles nothing new.
    let mut again = HashSet::new();
    run_all(&mut again);
    assert_eq!(again, expected);
    assert_eq!(model.plans_compiled(), expected.len() as u64, "repeated requests recompiled");

    // One upload of the weights; every plan was prepared against that same copy.
    let loaded = backend.loaded.lock().unwrap();
    assert_eq!(loaded.len(), 1, "weights uploaded more than once");
    let prepared = backend.prepared.lock().unwrap();
    assert_eq!(prepared.len(), expected.len());
    assert!(prepared.iter().all(|(_, w)| Arc::ptr_eq(w, &loaded[0])), "a plan got its own weights");
    let mut rows: Vec<usize> = prepared.iter().map(|(r, _)| *r).collect();
    rows.sort_unstable();
    let mut want_rows: Vec<usize> = expected.iter().map(|(_, b)| b.rows()).collect();
    want_rows.sort_unstable();
    assert_eq!(rows, want_rows, "plans were compiled for the expected bucket sizes");
}

#[test]
fn batched_decode_equals_each_sequence_alone() {
    let model = load(config());
    // Five sequences at different positions (past the sliding window for some), one batched step
    // each time: every row sees only its own cache and position.
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(2 + 3 * i, 100 + i as u64)).collect();
    let mut alone = prefilled(&model, &prompts);
    let mut batched = prefilled(&model, &prompts);
    for step in 0..6 {
        let tokens = prompt(batched.len(), 200 + step);
        let mut refs: Vec<&mut Session<'_>> = batched.iter_mut().collect();
        let outs = model.decode_batch(&mut refs, &tokens, OutputMode::Logits, &[]).unwrap();
        let greedy = model.decode_batch(&mut [], &[], OutputMode::NextToken, &[]);
        assert!(greedy.is_err(), "an empty batch is an error");
        for (i, out) in outs.into_iter().enumerate() {
            let StepOutput::Logits(b) = out.unwrap() else { panic!("expected logits") };
            let a = logits(&mut alone[i], &[tokens[i]]);
            assert_eq!(a, b, "sequence {i}, step {step}: batched logits differ from decoding alone");
            assert_eq!(batched[i].position(), alone[i].position());
        }
    }
    // The greedy head per row equals each row's argmax, and batches of 1..5 agree.
    for n in 1..=batched.len() {
        let tokens = prompt(n, 300 + n as u64);
        let mut refs: Vec<&mut Session<'_>> = batched.iter_mut().take(n).collect();
        let outs = model.decode_batch(&mut refs, &tokens, OutputMode::NextToken, &[]).unwrap();
        for (i, out) in outs.into_iter().enumerate() {
            let expect = argmax(&logits(&mut alone[i], &[tokens[i]]));
            assert_eq!(out.unwrap(), StepOutput::Token(expect), "batch of {n}, sequence {i}");
        }
    }
    // Batches of 3 and 5 run in plans of 4 and 8 rows.
    let keys = model.plans_compiled();
    assert!(keys >= 3, "{keys} plans");
    // A bad token or a full context is an error that names the problem.
    let mut refs: Vec<&mut Session<'_>> = batched.iter_mut().take(2).collect();
    let err = model.decode_batch(&mut refs, &[5, VOCAB as u32], OutputMode::Logits, &[]).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let err = model.decode_batch(&mut refs, &[5], OutputMode::Logits, &[]).unwrap_err();
    assert!(err.to_string().contains("1 token chunks (lengths [1]) for 2 sequences"), "{err}");
}

#[test]
fn batched_prefill_and_decode_rows_equal_each_sequence_alone() {
    let model = load(config());
    // Sequences at different positions (one empty), each adding a chunk of its own length in one
    // step: prompt chunks and single decode tokens together, as the server's scheduler mixes them.
    let start = |p: &Vec<u32>| {
        let mut s = model.new_session().unwrap();
        if !p.is_empty() {
            logits(&mut s, p);
        }
        s
    };
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(3 * i, 700 + i as u64)).collect();
    let mut alone: Vec<Session<'_>> = prompts.iter().map(start).collect();
    let mut batched: Vec<Session<'_>> = prompts.iter().map(start).collect();
    let steps = [
        ([5, 1, 7, 2], OutputMode::Logits),
        ([1, 1, 1, 1], OutputMode::NextToken),
        ([1, 6, 1, 3], OutputMode::Logits),
        ([1, 1, 4, 1], OutputMode::Candidates),
        ([1, 1, 1, 1], OutputMode::Candidates),
        ([1, 1, 1, 1], OutputMode::Drawn(Among::Candidates)),
        ([2, 1, 3, 1], OutputMode::Drawn(Among::Candidates)),
        ([1, 1, 1, 1], OutputMode::Drawn(Among::Vocabulary)),
        ([1, 4, 1, 2], OutputMode::Drawn(Among::Vocabulary)),
    ];
    for (step, (lens, mode)) in steps.into_iter().enumerate() {
        let chunks: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| prompt(n, 800 + (10 * step + i) as u64)).collect();
        let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
        let mut sessions: Vec<&mut Session<'_>> = batched.iter_mut().collect();
        // (Each sequence its own temperature, cut and generator; the last greedy.)
        let draws: Vec<DrawSpec> = (0..4)
            .map(|i| DrawSpec {
                temperature: [0.7, 1.0, 1.6, 0.0][i],
                top_k: [40, 5, 63, 1][i],
                top_p: [1.0, 0.9, 0.95, 1.0][i],
                min_p: [0.0, 0.0, 0.05, 0.0][i],
                rng: DrawRng::new(step as u64 * 10 + i as u64),
            })
            .collect();
        let outs = model.forward_batch(&mut sessions, &refs, mode, &draws).unwrap();
        for (i, out) in outs.into_iter().enumerate() {
            let a = logits(&mut alone[i], &chunks[i]);
            let mut likeliest: Vec<(u32, f32)> = a.iter().enumerate().map(|(j, &v)| (j as u32, v)).collect();
            likeliest.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
            likeliest.truncate(kiln_ir::CANDIDATES);
            match out.unwrap() {
                StepOutput::Logits(b) => assert_eq!(a, b, "step {step}, sequence {i}: batched logits differ from running alone"),
                StepOutput::Token(t) => {
                    let spec = (&draws[i], DrawSpec { top_k: 0, top_p: 1.0, min_p: 0.0, ..draws[i] });
                    let want = match mode {
                        OutputMode::Drawn(Among::Candidates) => draw::draw_among(&likeliest, spec.0),
                        OutputMode::Drawn(Among::Vocabulary) => draw::draw_vocabulary(&a, &spec.1, &mut Vec::new()),
                        _ => argmax(&a),
                    };
                    assert_eq!(t, want, "step {step}, sequence {i}: {mode:?}");
                }
                StepOutput::Candidates(c) => {
                    assert_eq!(c, likeliest, "step {step}, sequence {i}: batched candidates are not the logits' likeliest");
                }
                other => panic!("unexpected output {other:?}"),
            }
            assert_eq!(batched[i].position(), alone[i].position());
        }
    }
    // A batch over the engine's step rows, an empty chunk or an output that is not per sequence
    // is an error naming it.
    let small = load(EngineConfig { max_prefill_rows: 8, ..config() });
    let (mut s1, mut s2) = (small.new_session().unwrap(), small.new_session().unwrap());
    let err = small.forward_batch(&mut [&mut s1, &mut s2], &[&prompt(8, 900), &[N_SPECIAL as u32]], OutputMode::Logits, &[]).unwrap_err();
    assert!(err.to_string().contains("9 prompt tokens in one batched step; at most 8 fit"), "{err}");
    let mut sessions: Vec<&mut Session<'_>> = batched.iter_mut().take(2).collect();
    let err = model.forward_batch(&mut sessions, &[&[1], &[]], OutputMode::Logits, &[]).unwrap_err();
    assert!(err.to_string().contains("lengths [1, 0]"), "{err}");
    let err = model.forward_batch(&mut sessions, &[&[1], &[2]], OutputMode::Hidden, &[]).unwrap_err();
    assert!(err.to_string().contains("logits, candidates or tokens"), "{err}");
    let err = model.forward_batch(&mut sessions, &[&[1], &[2]], OutputMode::Drawn(Among::Vocabulary), &[DrawSpec::greedy()]).unwrap_err();
    assert!(err.to_string().contains("1 draws for 2 sequences"), "{err}");
}

/// The CPU backend with plans that cannot decode several sequences in one step (the trait's
/// default `run_batch`), as a backend without batched decode.
struct NoBatch(CpuBackend);

/// A CPU plan without `run_batch`.
struct OneAtATime(Box<dyn Executable>);

impl Executable for OneAtATime {
    fn plan(&self) -> &Plan {
        self.0.plan()
    }

    fn run(&mut self, inputs: StepInputs<'_>, kv: &mut dyn KvCache) -> Result<Vec<HostTensor>, RuntimeError> {
        self.0.run(inputs, kv)
    }
}

impl Backend for NoBatch {
    fn name(&self) -> String {
        self.0.name()
    }

    fn load_weights(&self, store: &Arc<WeightStore>) -> Result<Arc<dyn DeviceWeights>, RuntimeError> {
        self.0.load_weights(store)
    }

    fn prepare(&self, plan: Arc<Plan>, weights: &Arc<dyn DeviceWeights>) -> Result<Box<dyn Executable>, RuntimeError> {
        Ok(Box::new(OneAtATime(self.0.prepare(plan, weights)?)))
    }

    fn new_kv_cache(&self, layout: &KvLayout) -> Result<Box<dyn KvCache>, RuntimeError> {
        self.0.new_kv_cache(layout)
    }
}

#[test]
fn batched_decode_on_a_backend_without_it_decodes_one_by_one() {
    let batching = load(config());
    let single = load_parts(&parts(7), Arc::new(NoBatch(CpuBackend::new(2))), config()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(3 + 2 * i, 500 + i as u64)).collect();
    let (mut a, mut b) = (prefilled(&batching, &prompts), prefilled(&single, &prompts));
    for (step, mode) in [OutputMode::Logits, OutputMode::NextToken, OutputMode::Logits].into_iter().enumerate() {
        let tokens = prompt(3, 600 + step as u64);
        let want = batching.decode_batch(&mut a.iter_mut().collect::<Vec<_>>(), &tokens, mode, &[]).unwrap();
        let got = single.decode_batch(&mut b.iter_mut().collect::<Vec<_>>(), &tokens, mode, &[]).unwrap();
        for (i, (w, g)) in want.into_iter().zip(got).enumerate() {
            assert_eq!(w.unwrap(), g.unwrap(), "step {step}, sequence {i}");
            assert_eq!(a[i].position(), b[i].position());
        }
    }
    // Prompt chunks of several sequences run one by one there too.
    let chunks = [prompt(4, 650), prompt(1, 651), prompt(2, 652)];
    let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
    let want = batching.forward_batch(&mut a.iter_mut().collect::<Vec<_>>(), &refs, OutputMode::Logits, &[]).unwrap();
    let got = single.forward_batch(&mut b.iter_mut().collect::<Vec<_>>(), &refs, OutputMode::Logits, &[]).unwrap();
    for (i, (w, g)) in want.into_iter().zip(got).enumerate() {
        assert_eq!(w.unwrap(), g.unwrap(), "prompt chunks, sequence {i}");
    }
    // No plan for several sequences was compiled there: as many plans as running every step one
    // sequence at a time by hand.
    let by_hand = load(config());
    let mut c = prefilled(&by_hand, &prompts);
    for (step, mode) in [OutputMode::Logits, OutputMode::NextToken, OutputMode::Logits].into_iter().enumerate() {
        let tokens = prompt(3, 600 + step as u64);
        for (s, t) in c.iter_mut().zip(&tokens) {
            s.forward(std::slice::from_ref(t), mode).unwrap();
        }
    }
    for (s, chunk) in c.iter_mut().zip(&chunks) {
        s.forward(chunk, OutputMode::Logits).unwrap();
    }
    assert_eq!(single.plans_compiled(), by_hand.plans_compiled());
    // A backend without a top-k head runs the logits plan for the candidates; the host takes the
    // likeliest from them, as the head would.
    let tokens = prompt(3, 660);
    let want = batching.decode_batch(&mut a.iter_mut().collect::<Vec<_>>(), &tokens, OutputMode::Candidates, &[]).unwrap();
    let got = single.decode_batch(&mut b.iter_mut().collect::<Vec<_>>(), &tokens, OutputMode::Candidates, &[]).unwrap();
    for (i, (w, g)) in want.into_iter().zip(got).enumerate() {
        let (w, g) = (w.unwrap(), g.unwrap());
        assert!(matches!(&w, StepOutput::Candidates(c) if c.len() == kiln_ir::CANDIDATES), "{w:?}");
        assert_eq!(w, g, "candidates, sequence {i}");
    }
    // A backend that does not draw hands back what the host draws from (the candidates or the
    // logits); generation then draws there what the graph draws: the same text.
    for sampling in [
        SamplingParams { temperature: 0.9, top_k: 12, seed: 3, ..Default::default() },
        SamplingParams { temperature: 1.3, seed: 4, ..Default::default() },
    ] {
        let params = GenerateParams { sampling, ..sampled(12, 0) };
        let p = prompt(5, 670);
        let mode = Generator::new(params.clone(), &p, None).unwrap().mode();
        let mut s = single.new_session().unwrap();
        let draw = Generator::new(params.clone(), &p, None).unwrap().draw();
        let out = s.forward_with(&p, mode, draw.as_ref()).unwrap();
        assert!(matches!(out, StepOutput::Candidates(_) | StepOutput::Logits(_)), "{mode:?}: {out:?}");
        let (want, got) = (run_generate(&batching, &p, &params).0, run_generate(&single, &p, &params).0);
        assert_eq!(want.tokens, got.tokens, "{mode:?}");
    }
}
