//! Every model family kiln runs, against its fixture on the CPU (`common/families.rs`, shared with
//! the CUDA tests: token ids, last-position logits, per-token log-likelihoods, decode against
//! prefill, greedy continuations, and a prompt longer than the sliding window). Plus the config
//! each family reads from its metadata, and the errors for an unknown architecture and a missing key.

#[path = "common/families.rs"]
mod common;

use std::sync::Arc;

use common::{check_family, fixture_path, Bounds};
use kiln_cpu::CpuBackend;
use kiln_gguf::{GgufFile, GgufWriter, MetaValue};
use kiln_ir::RopeMode;
use kiln_models::{config_from_gguf, Activation, Model, ModelError};
use kiln_runtime::{EngineConfig, KvType};

fn load(family: &str) -> Model {
    let config = EngineConfig { threads: 2, ..Default::default() };
    Model::load(&fixture_path(family, "gguf"), Arc::new(CpuBackend::new(2)), config).expect("load fixture")
}

/// The CPU's bounds (its default, fast kernels): a row's products and attention give the same
/// bits whatever rows are computed with it, so decoding a prompt token by token gives its
/// prefill's logits exactly.
const CPU: Bounds = Bounds { logits: 1e-3, logprob: 2e-3, modes: 1e-4, decode: 0.0, tie: 1e-3, trusted: 4 };

macro_rules! families {
    ($($family:ident),*) => {$(
        #[test]
        fn $family() {
            check_family(&load(stringify!($family)), stringify!($family), &CPU);
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
