//! Every model family kiln runs, against its fixture (`tests/fixtures/families/F.gguf`: a tiny
//! random-weight model written with llama.cpp's converter conventions, and `F.json`: the outputs of
//! the family's Hugging Face `transformers` class on the dequantized weights; made by
//! `tools/fixtures/make_fixtures.py`): token ids, last-position logits, per-token log-likelihoods,
//! greedy continuations, and a prompt longer than the sliding window. Plus the config each family
//! reads from its metadata, and the errors for an unknown architecture and a missing key.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_cpu::CpuBackend;
use kiln_gguf::{GgufFile, GgufWriter, MetaValue};
use kiln_ir::RopeMode;
use kiln_models::{config_from_gguf, Activation, Model, ModelError, OutputMode, StepOutput};
use kiln_runtime::{EngineConfig, KvType};
use serde_json::Value;

fn fixture_path(family: &str, ext: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/families")).join(format!("{family}.{ext}"))
}

fn reference(family: &str) -> Value {
    let text = std::fs::read_to_string(fixture_path(family, "json")).expect("fixture json");
    serde_json::from_str(&text).expect("valid json")
}

fn load(family: &str) -> Model {
    let config = EngineConfig { threads: 2, ..Default::default() };
    Model::load(&fixture_path(family, "gguf"), Arc::new(CpuBackend::new(2)), config).expect("load fixture")
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect()
}

fn log_softmax_at(logits: &[f32], id: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits[id] as f64 - lse
}

/// Checks every case of `family`'s fixture on the exact CPU path.
fn check_family(family: &str) {
    let r = reference(family);
    let model = load(family);
    assert_eq!(model.architecture().name(), r["architecture"].as_str().unwrap(), "{family}: architecture");
    let vocab = model.architecture().vocab_size();
    let window = r["hf_config"]["sliding_window"].as_u64().map(|w| w as usize);
    for case in r["cases"].as_array().unwrap() {
        let name = format!("{family}/{}", case["name"].as_str().unwrap());
        let ids = u32s(&case["ids"]);
        if let Some(text) = case["text"].as_str() {
            assert_eq!(model.tokenizer().encode(text), ids, "{name}: token ids");
        }
        if case["name"] == "long" {
            if let Some(w) = window {
                assert!(ids.len() > w, "{name}: {} tokens do not exceed the window of {w}", ids.len());
            }
        }

        // Every position's logits: the last row, and the log-likelihood of every next token.
        let mut s = model.new_session().unwrap();
        let StepOutput::AllLogits { rows, data } = s.forward(&ids, OutputMode::AllLogits).unwrap() else { panic!() };
        assert_eq!((rows, data.len()), (ids.len(), ids.len() * vocab));
        let last = &data[(rows - 1) * vocab..];
        let want = f64s(&case["last_logits"]);
        assert_eq!(want.len(), vocab, "{name}: reference logits width");
        let err = last.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt();
        let norm = want.iter().map(|b| b * b).sum::<f64>().sqrt();
        println!("{name}: last logits relative L2 error {:.2e}", err / norm);
        assert!(err / norm < 1e-3, "{name}: relative L2 error {}", err / norm);
        let want_lp = f64s(&case["token_logprobs"]);
        assert_eq!(want_lp.len(), ids.len() - 1);
        let worst = (1..ids.len())
            .map(|i| (log_softmax_at(&data[(i - 1) * vocab..i * vocab], ids[i] as usize) - want_lp[i - 1]).abs())
            .fold(0f64, f64::max);
        println!("{name}: worst per-token log-likelihood difference {worst:.2e} nats");
        assert!(worst < 2e-3, "{name}: log-likelihood off by {worst}");

        // The last-logits mode agrees with the all-rows one.
        let mut s = model.new_session().unwrap();
        let StepOutput::Logits(l) = s.forward(&ids, OutputMode::Logits).unwrap() else { panic!() };
        let diff = l.iter().zip(last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-4, "{name}: logits mode differs from all-logits mode by {diff}");

        // Greedy continuation (in-graph argmax, one decode step per token), up to the first near-tie.
        let want_greedy = u32s(&case["greedy_ids"]);
        let gaps = f64s(&case["greedy_gaps"]);
        let trusted = gaps.iter().position(|&g| g < 1e-3).unwrap_or(gaps.len());
        assert!(trusted >= 4, "{name}: the reference has a near-tie at step {trusted}; the fixture is not informative");
        let mut s = model.new_session().unwrap();
        let mut out = s.forward(&ids, OutputMode::NextToken).unwrap();
        let mut got = Vec::new();
        while got.len() < trusted {
            let StepOutput::Token(t) = out else { panic!() };
            got.push(t);
            out = s.forward(&[t], OutputMode::NextToken).unwrap();
        }
        assert_eq!(got, want_greedy[..trusted], "{name}: greedy continuation (first {trusted} steps)");
    }
}

macro_rules! families {
    ($($family:ident),*) => {$(
        #[test]
        fn $family() {
            check_family(stringify!($family));
        }
    )*};
}

families!(llama, qwen2, qwen3, gemma, gemma2, gemma3, gemma4);

fn config_of(family: &str) -> kiln_models::DecoderConfig {
    config_from_gguf(&GgufFile::open(&fixture_path(family, "gguf")).unwrap()).unwrap()
}

#[test]
fn each_family_reads_its_switches_from_the_metadata() {
    let c = config_of("llama");
    assert_eq!(
        (c.arch, c.activation, c.embed_scale, c.post_norms, c.qk_norm, c.qkv_bias),
        ("llama", Activation::Silu, 1.0, false, false, false)
    );
    assert_eq!(c.output_weight, "output.weight");
    let rope = &c.layers[0].rope;
    assert_eq!(rope.mode, RopeMode::Norm);
    let factors = rope.freq_factors.as_ref().expect("llama 3 frequency factors from rope_freqs.weight");
    assert_eq!(factors.len(), c.layers[0].head_dim / 2);
    assert!(factors.iter().any(|&f| f > 1.0), "{factors:?}");

    let c = config_of("qwen2");
    assert!(c.qkv_bias && !c.qk_norm && c.activation == Activation::Silu);
    assert_eq!((c.layers[0].rope.mode, c.layers[0].rope.theta), (RopeMode::Neox, 1e6));
    assert_eq!(c.output_weight, "token_embd.weight");

    let c = config_of("qwen3");
    assert!(!c.qkv_bias && c.qk_norm);
    assert_eq!(c.layers[0].head_dim, 128, "key_length, not hidden / heads");

    let c = config_of("gemma");
    assert_eq!((c.activation, c.post_norms, c.qk_norm), (Activation::GeluTanh, false, false));
    assert!((c.embed_scale - (c.hidden as f32).sqrt()).abs() < 1e-4);
    assert!(c.layers.iter().all(|l| l.window.is_none() && l.rope.is_plain_neox()));

    let c = config_of("gemma2");
    assert!(c.post_norms && !c.qk_norm);
    assert_eq!((c.attn_softcap, c.final_softcap), (Some(10.0), Some(15.0)));
    let windows: Vec<Option<usize>> = c.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows, [Some(8), None, Some(8), None]);
    assert!((c.attn_scale - 1.0 / 8.0).abs() < 1e-7, "query_pre_attn_scalar 64");

    let c = config_of("gemma3");
    assert!(c.post_norms && c.qk_norm && !c.v_norm && c.final_softcap.is_none());
    let bases: Vec<f32> = c.layers.iter().map(|l| l.rope.theta).collect();
    assert_eq!(bases, [1e4, 1e4, 1e4, 1e4, 1e4, 1e6]);

    // Gemma 4: sliding layers of head size 64 with base 1e4, full layers of 128 with base 1e6 and
    // proportional RoPE (a quarter of the frequencies rotate), value norms, scale 1, output scales.
    let c = config_of("gemma4");
    assert!(c.post_norms && c.qk_norm && c.v_norm && c.attn_scale == 1.0 && c.final_softcap == Some(15.0));
    let shapes: Vec<(usize, Option<usize>, f32)> = c.layers.iter().map(|l| (l.head_dim, l.window, l.rope.theta)).collect();
    assert_eq!(shapes, [(64, Some(8), 1e4), (64, Some(8), 1e4), (128, None, 1e6), (64, Some(8), 1e4), (128, None, 1e6)]);
    let full = c.layers[2].rope.freq_factors.as_ref().expect("proportional RoPE factors");
    assert_eq!((full.len(), full.iter().filter(|&&f| f == 1.0).count()), (64, 16));
    assert!(c.layers[0].rope.freq_factors.is_none() && c.layers.iter().all(|l| !l.v_from_k));
    assert!(c.layers.iter().any(|l| l.output_scale.is_some()));
    let kv = model_kv(&c);
    assert_eq!(kv, [128, 128, 256, 128, 256], "per-layer KV widths");
}

/// K widths of every layer of the KV cache layout.
fn model_kv(c: &kiln_models::DecoderConfig) -> Vec<usize> {
    use kiln_models::Architecture;
    c.kv_layout(64, KvType::F32).layers.iter().map(|l| l.kv_heads * l.head_dim_k).collect()
}

/// The fixture of `family` with its metadata edited by `edit`, as an in-memory file.
fn edited(family: &str, edit: impl FnOnce(&mut Vec<(String, MetaValue)>)) -> GgufFile {
    let f = GgufFile::open(&fixture_path(family, "gguf")).unwrap();
    let mut meta = f.metadata().to_vec();
    edit(&mut meta);
    let mut w = GgufWriter::new(3).unwrap();
    for (k, v) in meta {
        w.add_metadata(k, v).unwrap();
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, f.tensor_data(t).to_vec()).unwrap();
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

#[test]
fn an_unknown_architecture_and_a_missing_key_are_named() {
    let f = edited("qwen2", |m| {
        m.iter_mut().find(|(k, _)| k == "general.architecture").unwrap().1 = MetaValue::String("mamba7".into());
    });
    let e = config_from_gguf(&f).unwrap_err();
    assert!(matches!(&e, ModelError::UnsupportedArchitecture(a) if a == "mamba7"), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("mamba7") && msg.contains("llama") && msg.contains("qwen3") && msg.contains("gemma2"), "{msg}");

    for (family, key) in [
        ("llama", "llama.block_count"),
        ("qwen2", "qwen2.attention.head_count"),
        ("qwen3", "qwen3.attention.layer_norm_rms_epsilon"),
        ("gemma", "gemma.feed_forward_length"),
        ("gemma2", "gemma2.attention.sliding_window"),
        ("gemma3", "gemma3.context_length"),
        ("gemma4", "gemma4.attention.sliding_window"),
    ] {
        let f = edited(family, |m| m.retain(|(k, _)| k != key));
        let e = config_from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains(key), "{family}: {e}");
    }

    // Gemma 4 features kiln does not run are named, not silently ignored.
    let f = edited("gemma4", |m| m.iter_mut().find(|(k, _)| k == "gemma4.attention.shared_kv_layers").unwrap().1 = MetaValue::U32(2));
    let e = config_from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("gemma4.attention.shared_kv_layers") && e.contains("KV sharing"), "{e}");

    // A present but unsupported RoPE scaling type is named too.
    let f = edited("llama", |m| m.push(("llama.rope.scaling.type".into(), MetaValue::String("yarn".into()))));
    let e = config_from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("llama.rope.scaling.type") && e.contains("yarn"), "{e}");
}
