//! Numerics of the CPU paths against the Hugging Face float32 reference
//! (`../shared/refs`, see its README): token ids, last-position logits, per-token
//! log-likelihoods and greedy continuations, for every reference prompt; the exact kernels with
//! tight tolerances, the fast (8-bit activation) kernels with the looser ones of issue 3, and the
//! fast kernels over an f16 KV cache with those too.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kiln_cpu::CpuBackend;
use kiln_models::{Model, OutputMode, StepOutput};
use kiln_runtime::{EngineConfig, KernelPrecision, KvType};
use serde_json::Value;

fn refs() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs"))
}

/// What one kernel family must achieve against the reference.
struct Tolerances {
    kernels: KernelPrecision,
    /// The KV cache's element type.
    kv: KvType,
    /// Relative L2 error of the last-position logits.
    logits_rel_l2: f64,
    /// Per-token log-likelihood difference (nats): the worst one for exact, the mean for fast.
    loglik: f64,
    /// Whether `loglik` bounds the mean (else the worst) difference.
    loglik_mean: bool,
    /// Greedy steps are compared up to the first one whose reference top-1/top-2 gap is below this.
    greedy_gap: f64,
    /// Largest difference between the logits and all-logits output modes.
    mode_diff: f32,
}

const EXACT: Tolerances = Tolerances {
    kernels: KernelPrecision::Exact,
    kv: KvType::F32,
    logits_rel_l2: 1e-3,
    loglik: 1e-2,
    loglik_mean: false,
    greedy_gap: 1e-3,
    mode_diff: 1e-3,
};

const FAST: Tolerances = Tolerances {
    kernels: KernelPrecision::Fast,
    kv: KvType::F32,
    logits_rel_l2: 2e-2,
    loglik: 0.05,
    loglik_mean: true,
    greedy_gap: 5e-2,
    mode_diff: 1e-3,
};

const FAST_F16_KV: Tolerances = Tolerances { kv: KvType::F16, ..FAST };

fn model(kernels: KernelPrecision, kv: KvType) -> &'static Model {
    static EXACT_MODEL: OnceLock<Model> = OnceLock::new();
    static FAST_MODEL: OnceLock<Model> = OnceLock::new();
    static FAST_F16_KV_MODEL: OnceLock<Model> = OnceLock::new();
    let cell = match (kernels, kv) {
        (KernelPrecision::Exact, _) => &EXACT_MODEL,
        (KernelPrecision::Fast, KvType::F32) => &FAST_MODEL,
        (KernelPrecision::Fast, KvType::F16) => &FAST_F16_KV_MODEL,
    };
    cell.get_or_init(|| {
        let path = kiln_hub::ensure_default_model().expect("default model");
        let config = EngineConfig { kernels, kv_type: kv, ..EngineConfig::default() };
        Model::load(&path, Arc::new(CpuBackend::from_config(&config)), config).expect("load model")
    })
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(refs().join(format!("{name}.json"))).expect("reference json");
    serde_json::from_str(&text).expect("valid json")
}

/// Reads a little-endian float32 `.npy` vector.
fn read_npy_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("npy file");
    assert_eq!(&bytes[..6], b"\x93NUMPY", "not an npy file");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).expect("ascii header");
    assert!(header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"), "{header}");
    bytes[start + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

fn log_softmax_at(logits: &[f32], id: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits[id] as f64 - lse
}

fn check_prompt(name: &str, tol: &Tolerances) {
    let r = reference(name);
    let m = model(tol.kernels, tol.kv);
    let file = name;
    let name = &format!("{name} ({:?}, {} KV cache)", tol.kernels, tol.kv.name());
    let vocab = m.architecture().vocab_size();

    // Token ids.
    let prompt = r["prompt"].as_str().expect("prompt");
    let want_ids = ids(&r["input_ids"]);
    assert_eq!(m.tokenizer().encode(prompt), want_ids, "{name}: token ids");

    // Every position's logits: last-position logits and per-token log-likelihoods.
    let mut s = m.new_session().unwrap();
    let StepOutput::AllLogits { rows, data } = s.forward(&want_ids, OutputMode::AllLogits).unwrap() else { panic!() };
    assert_eq!(rows, want_ids.len());
    let last = &data[(rows - 1) * vocab..];
    let want = read_npy_f32(&refs().join(format!("{file}_last_logits.npy")));
    let err: f64 = last.iter().zip(&want).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
    println!("{name}: last logits relative L2 error {:.2e}", err / norm);
    assert!(err / norm < tol.logits_rel_l2, "{name}: relative L2 error {}", err / norm);
    assert_eq!(argmax(last), argmax(&want), "{name}: top-1");
    let (mut worst, mut sum, mut count) = (0f64, 0f64, 0usize);
    for t in r["per_token_nll"].as_array().unwrap() {
        let pos = t["pos"].as_u64().unwrap() as usize;
        let id = t["id"].as_u64().unwrap() as usize;
        let lp = log_softmax_at(&data[(pos - 1) * vocab..pos * vocab], id);
        let diff = (lp - t["logprob"].as_f64().unwrap()).abs();
        worst = worst.max(diff);
        sum += diff;
        count += 1;
    }
    let mean = sum / count.max(1) as f64;
    println!("{name}: per-token log-likelihood difference: worst {worst:.2e}, mean {mean:.2e} nats");
    let judged = if tol.loglik_mean { mean } else { worst };
    assert!(judged < tol.loglik, "{name}: log-likelihood off by {judged}");

    // The last-logits output mode agrees with the all-rows one.
    let mut s = m.new_session().unwrap();
    let StepOutput::Logits(l) = s.forward(&want_ids, OutputMode::Logits).unwrap() else { panic!() };
    let diff = l.iter().zip(last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(diff < tol.mode_diff, "{name}: logits mode differs from all-logits mode by {diff}");

    // Greedy continuation, up to the first near-tie.
    let g = &r["greedy"];
    let want_greedy = ids(&g["ids"]);
    let steps = g["steps"].as_array().unwrap();
    let trusted = steps.iter().position(|st| st["gap_top1_top2"].as_f64().unwrap() < tol.greedy_gap).unwrap_or(steps.len());
    let mut s = m.new_session().unwrap();
    let mut out = s.forward(&want_ids, OutputMode::NextToken).unwrap();
    let mut got = Vec::new();
    while got.len() < trusted {
        let StepOutput::Token(t) = out else { panic!() };
        got.push(t);
        out = s.forward(&[t], OutputMode::NextToken).unwrap();
    }
    assert_eq!(got, want_greedy[..trusted], "{name}: greedy continuation (first {trusted} steps)");
}

macro_rules! prompts {
    ($tol:ident: $($name:ident),*) => {$(
        #[test]
        fn $name() {
            check_prompt(stringify!($name), &super::$tol);
        }
    )*};
}

/// The exact (reference) kernels.
mod exact {
    use super::check_prompt;
    prompts!(EXACT: p0, p1, p2, p3, p4, p5, p6, p7, p8, long);
}

/// The fast kernels (the default).
mod fast {
    use super::check_prompt;
    prompts!(FAST: p0, p1, p2, p3, p4, p5, p6, p7, p8, long);
}

/// The fast kernels over an f16 KV cache (`--kv-type f16`): within the fast kernels' tolerances.
mod fast_f16_kv {
    use super::check_prompt;
    prompts!(FAST_F16_KV: p0, p1, p2, p3, p4, p5, p6, p7, p8, long);
}

/// The top-k head's candidates after each token of a reference prompt and of a continuation:
/// the logits' likeliest tokens with their values (the fast head finds them by its screening copy).
#[test]
fn candidates_are_the_likeliest_logits() {
    for kernels in [KernelPrecision::Exact, KernelPrecision::Fast] {
        let m = model(kernels, KvType::F32);
        let prompt = ids(&reference("p0")["input_ids"]);
        let (mut a, mut b) = (m.new_session().unwrap(), m.new_session().unwrap());
        let mut fed = prompt.clone();
        for step in 0..24 {
            let feed = if step == 0 { &fed[..] } else { &fed[fed.len() - 1..] };
            let StepOutput::Logits(l) = a.forward(feed, OutputMode::Logits).unwrap() else { panic!() };
            let StepOutput::Candidates(c) = b.forward(feed, OutputMode::Candidates).unwrap() else { panic!() };
            let mut want: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
            want.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
            want.truncate(kiln_ir::CANDIDATES);
            let missing: Vec<usize> = (0..want.len()).filter(|&r| !c.contains(&want[r])).collect();
            assert!(missing.is_empty(), "{kernels:?}, step {step}: ranks {missing:?} of the logits missing ({} candidates)", c.len());
            assert_eq!(c, want, "{kernels:?}, step {step}");
            fed.push(c[step % 7].0);
        }
    }
}
