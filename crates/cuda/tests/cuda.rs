//! The CUDA backend against the CPU backend and the Hugging Face reference (`../shared/refs`).
//! Every test needs an NVIDIA GPU: they are ignored by default and run on the device machine
//! with `--include-ignored`.

#[path = "../../models/tests/common/families.rs"]
mod families;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use families::{check_family, fixture_path, Bounds};
use kiln_cpu::CpuBackend;
use kiln_cuda::CudaBackend;
use kiln_gguf::GgufFile;
use kiln_models::synth::{gemma3, llama, FormatMix, Gemma3Shape, LlamaArch, LlamaShape, SynthModel};
use kiln_models::{Among, Model, OutputMode, Session, StepOutput};
use kiln_quant::GgmlType;
use kiln_runtime::draw::{self, Rng as DrawRng};
use kiln_runtime::{Backend, DrawSpec, EngineConfig, KvType};
use serde_json::Value;

fn cuda() -> Arc<CudaBackend> {
    static B: OnceLock<Arc<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| Arc::new(CudaBackend::new(0).expect("CUDA device 0"))).clone()
}

fn cuda_host_launches() -> Arc<CudaBackend> {
    static B: OnceLock<Arc<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| Arc::new(CudaBackend::without_graphs(0).expect("CUDA device 0"))).clone()
}

fn cpu() -> Arc<CpuBackend> {
    static B: OnceLock<Arc<CpuBackend>> = OnceLock::new();
    B.get_or_init(|| Arc::new(CpuBackend::new(0))).clone()
}

/// A small Gemma 3 shape: 7 layers (layer 5 global), a window of 8 (the ring wraps in decode).
fn small_shape() -> Gemma3Shape {
    Gemma3Shape { hidden: 512, layers: 7, q_heads: 4, kv_heads: 2, head_dim: 128, ffn: 1024, vocab: 1000, window: 8, context: 256 }
}

/// Writes `m` to a temporary file and loads it on `backend` with a context of 256 (the mapping
/// outlives the file).
fn load(m: &SynthModel, backend: Arc<dyn Backend>) -> Model {
    load_with_context(m, backend, 256)
}

/// `load` with a context of `context` positions.
fn load_with_context(m: &SynthModel, backend: Arc<dyn Backend>, context: usize) -> Model {
    load_with_config(m, backend, EngineConfig { threads: 0, context, ..Default::default() })
}

/// `load` with `config`.
fn load_with_config(m: &SynthModel, backend: Arc<dyn Backend>, config: EngineConfig) -> Model {
    static N: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!("kiln-cuda-test-{}-{}.gguf", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    m.write(&path).unwrap();
    let model = Model::load(&path, backend, config);
    std::fs::remove_file(&path).unwrap();
    model.unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let err: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    err / norm
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

fn logits(s: &mut Session<'_>, tokens: &[u32]) -> Vec<f32> {
    match s.forward(tokens, OutputMode::Logits).unwrap() {
        StepOutput::Logits(v) => v,
        other => panic!("expected logits, got {other:?}"),
    }
}

/// The token a drawing step drew.
fn drawn_token(out: StepOutput) -> u32 {
    match out {
        StepOutput::Token(t) => t,
        other => panic!("expected a drawn token, got {other:?}"),
    }
}

fn next_token(s: &mut Session<'_>, tokens: &[u32]) -> u32 {
    match s.forward(tokens, OutputMode::NextToken).unwrap() {
        StepOutput::Token(t) => t,
        other => panic!("expected a token, got {other:?}"),
    }
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| 4 + ((i * 7919 + 13) % (vocab - 4)) as u32).collect()
}

/// CPU and CUDA (graphs and host launches) agree on a model whose matrices are all `ty`: prefill
/// through the tensor-core `mmq` kernels where the format has them, else cuBLAS (150 rows: four
/// whole blocks of 32 activation rows and one of 22; 20 rows), and the matrix-vector kernels (5
/// rows), then decode steps past the window.
fn matches_cpu(ty: GgmlType) {
    let m = gemma3(&small_shape(), FormatMix::All(ty), 42);
    let (c, g, h) = (load(&m, cpu()), load(&m, cuda()), load(&m, cuda_host_launches()));
    for n in [150, 20, 5] {
        let p = prompt(n, 1000);
        let (mut sc, mut sg, mut sh) = (c.new_session().unwrap(), g.new_session().unwrap(), h.new_session().unwrap());
        let want = logits(&mut sc, &p);
        for (name, s) in [("graphs", &mut sg), ("host launches", &mut sh)] {
            let got = logits(s, &p);
            let e = rel_l2(&got, &want);
            assert!(e < 1e-3, "{ty:?} prefill {n} ({name}): relative L2 {e:.2e}");
        }
        let mut tok = argmax(&want);
        for step in 0..12 {
            let want = logits(&mut sc, &[tok]);
            for (name, s) in [("graphs", &mut sg), ("host launches", &mut sh)] {
                let got = logits(s, &[tok]);
                let e = rel_l2(&got, &want);
                assert!(e < 1e-3, "{ty:?} decode step {step} after {n} ({name}): relative L2 {e:.2e}");
            }
            tok = argmax(&want);
        }
        println!("{ty:?}: CUDA matches the CPU after a prefill of {n} and 12 decode steps");
    }
}

macro_rules! formats {
    ($($name:ident => $ty:expr),*) => {$(
        #[test]
        #[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
        fn $name() {
            matches_cpu($ty);
        }
    )*};
}

formats!(
    f32_matches_cpu => GgmlType::F32,
    f16_matches_cpu => GgmlType::F16,
    bf16_matches_cpu => GgmlType::BF16,
    q4_0_matches_cpu => GgmlType::Q4_0,
    q4_1_matches_cpu => GgmlType::Q4_1,
    q5_0_matches_cpu => GgmlType::Q5_0,
    q5_1_matches_cpu => GgmlType::Q5_1,
    q8_0_matches_cpu => GgmlType::Q8_0,
    q2_k_matches_cpu => GgmlType::Q2_K,
    q3_k_matches_cpu => GgmlType::Q3_K,
    q4_k_matches_cpu => GgmlType::Q4_K,
    q5_k_matches_cpu => GgmlType::Q5_K,
    q6_k_matches_cpu => GgmlType::Q6_K
);

/// CPU and CUDA agree at shapes where one-row launches stream their weights through shared memory
/// (`matvecr`): q/k/v, o, the gate/up pair of a 32,768- and a 15,360-wide MLP and the head of a
/// 65,536-token vocabulary over 2,048 columns, in every ring format (logits, and the greedy argmax
/// where the format has no head kernel of its own); the down projection's 32,768-wide rows go
/// through matvec4 (for Q5_0 its shared-memory stages, many turns per lane), its 15,360-wide rows
/// through 4-row tiles (`matvecr4`; Q8_0's through matvec4). The prompt's 20 rows take `mmq`, the
/// wide gate/up products in blocks of 64 and 128 weight rows.
fn streamed_launches_match_cpu(ty: GgmlType) {
    for ffn in [32768, 15360] {
        streamed_launches_match_cpu_at(ty, ffn);
    }
}

fn streamed_launches_match_cpu_at(ty: GgmlType, ffn: usize) {
    let shape = Gemma3Shape { hidden: 2048, layers: 1, q_heads: 8, kv_heads: 1, head_dim: 256, ffn, vocab: 65536, window: 8, context: 64 };
    let m = gemma3(&shape, FormatMix::All(ty), 11);
    let (c, g) = (load(&m, cpu()), load(&m, cuda()));
    let p = prompt(20, shape.vocab);
    let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
    let (want, got) = (logits(&mut sc, &p), logits(&mut sg, &p));
    let e = rel_l2(&got, &want);
    assert!(e < 1e-3, "{ty:?} (MLP {ffn}) prefill: relative L2 {e:.2e}");
    let mut tok = argmax(&want);
    for step in 0..4 {
        let (want, got) = (logits(&mut sc, &[tok]), logits(&mut sg, &[tok]));
        let e = rel_l2(&got, &want);
        assert!(e < 1e-3, "{ty:?} (MLP {ffn}) decode step {step}: relative L2 {e:.2e}");
        tok = argmax(&want);
    }
    let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
    let (mut tc, mut tg) = (next_token(&mut sc, &p), next_token(&mut sg, &p));
    for _ in 0..4 {
        assert_eq!(tc, tg, "{ty:?} (MLP {ffn})");
        tc = next_token(&mut sc, &[tc]);
        tg = next_token(&mut sg, &[tg]);
    }
}

macro_rules! streamed {
    ($($name:ident => $ty:expr),*) => {$(
        #[test]
        #[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
        fn $name() {
            streamed_launches_match_cpu($ty);
        }
    )*};
}

streamed!(
    q4_k_streamed_launches_match_cpu => GgmlType::Q4_K,
    q6_k_streamed_launches_match_cpu => GgmlType::Q6_K,
    q8_0_streamed_launches_match_cpu => GgmlType::Q8_0,
    q5_0_streamed_launches_match_cpu => GgmlType::Q5_0,
    q4_0_streamed_launches_match_cpu => GgmlType::Q4_0,
    q5_k_streamed_launches_match_cpu => GgmlType::Q5_K,
    q2_k_streamed_launches_match_cpu => GgmlType::Q2_K,
    q3_k_streamed_launches_match_cpu => GgmlType::Q3_K
);

/// A decode step over a long past splits each head's positions over several blocks (from 128
/// positions on, at least 64 positions each) whose partial results the last block merges: a
/// prompt of 100 and 180 decode steps go from one block per head to 2, 3, 4 and 5 shares in the
/// global layer; the sliding layers (a window of 8) keep one.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn decode_over_a_long_past_matches_cpu() {
    decode_over_a_long_past(&Gemma3Shape { context: 512, ..small_shape() }, 100, 180);
}

/// The same past 2,048 positions with heads of 256: up to the most shares a head has
/// (`ATT_SPLITS_MAX`, 16).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn decode_over_the_longest_splits_matches_cpu() {
    decode_over_a_long_past(&Gemma3Shape { q_heads: 2, kv_heads: 1, head_dim: 256, context: 2304, ..small_shape() }, 2000, 100);
}

/// Prefills `past` prompt tokens on the CPU and CUDA, then decodes `steps` greedy tokens: every
/// step's logits within relative L2 1e-3 of the CPU's.
fn decode_over_a_long_past(shape: &Gemma3Shape, past: usize, steps: usize) {
    let m = gemma3(shape, FormatMix::All(GgmlType::Q8_0), 11);
    let (c, g) = (load_with_context(&m, cpu(), shape.context), load_with_context(&m, cuda(), shape.context));
    let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
    let p = prompt(past, 1000);
    let want = logits(&mut sc, &p);
    assert!(rel_l2(&logits(&mut sg, &p), &want) < 1e-3);
    let mut tok = argmax(&want);
    for step in 0..steps {
        let want = logits(&mut sc, &[tok]);
        let e = rel_l2(&logits(&mut sg, &[tok]), &want);
        assert!(e < 1e-3, "decode step {step} after {past}: relative L2 {e:.2e}");
        tok = argmax(&want);
    }
}

/// Prompts through the tiled attention (`attention_tiled`: 4 query heads a key head): a batched
/// prefill of three sequences whose rows share tiles (segments ending inside a tile), then a
/// second chunk of one of them over its cached past (sliding rings of 8 wrapped, the global layer
/// over all of it); each against the same sequence alone on the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn prompt_attention_tiles_match_cpu() {
    let shape = Gemma3Shape { q_heads: 8, kv_heads: 2, context: 512, ..small_shape() };
    let m = gemma3(&shape, FormatMix::Q4KM, 21);
    let (c, g) = (load_with_context(&m, cpu(), 512), load_with_context(&m, cuda(), 512));
    let prompts: Vec<Vec<u32>> = [40, 70, 33].iter().enumerate().map(|(i, &n)| prompt(n, 1000 - 71 * i)).collect();
    let (mut cpu_seqs, mut gpu_seqs, _) = batched_prefill_matches(&c, &g, &prompts, "batched prefill");
    let more = prompt(90, 800);
    let e = rel_l2(&logits(&mut gpu_seqs[1], &more), &logits(&mut cpu_seqs[1], &more));
    assert!(e < 1e-3, "a second chunk over a past of 70: relative L2 {e:.2e}");
}

/// A batched prefill of `prompts` on `g`, each sequence's logits within relative L2 1e-3 of the
/// same prompt alone on `c`; returns both sides' sessions and `c`'s logits.
fn batched_prefill_matches<'m>(
    c: &'m Model,
    g: &'m Model,
    prompts: &[Vec<u32>],
    what: &str,
) -> (Vec<Session<'m>>, Vec<Session<'m>>, Vec<Vec<f32>>) {
    let mut cpu_seqs: Vec<Session<'_>> = prompts.iter().map(|_| c.new_session().unwrap()).collect();
    let mut gpu_seqs: Vec<Session<'_>> = prompts.iter().map(|_| g.new_session().unwrap()).collect();
    let want: Vec<Vec<f32>> = cpu_seqs.iter_mut().zip(prompts).map(|(s, p)| logits(s, p)).collect();
    let chunks: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let mut refs: Vec<&mut Session<'_>> = gpu_seqs.iter_mut().collect();
    for (i, (got, want)) in g.forward_batch(&mut refs, &chunks, OutputMode::Logits, &[]).unwrap().into_iter().zip(&want).enumerate() {
        let StepOutput::Logits(got) = got.unwrap() else { panic!("{what} gave no logits") };
        let e = rel_l2(&got, want);
        assert!(e < 1e-3, "{what}, sequence {i}: relative L2 {e:.2e}");
    }
    (cpu_seqs, gpu_seqs, want)
}

/// An f16 KV cache on CUDA holds what the CPU's f16 cache holds and attends alike (the step's
/// own rows rounded as cached ones): a batched prefill of four prompts (tiled attention, rings
/// of 8 wrapped; 503 rows, within a step's 512), one-row decode over a past of 300 (split attention, fused q/k norms, graphs),
/// batched decode steps of 4 sequences, each within relative L2 1e-3 of the CPU's f16 cache;
/// and it differs from the f32 cache's logits by rounding only (under 1e-2, not 0), in half the
/// bytes.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn f16_caches_match_the_cpus_f16_cache() {
    let shape = Gemma3Shape { q_heads: 8, kv_heads: 2, context: 1024, ..small_shape() };
    let m = gemma3(&shape, FormatMix::Q4KM, 23);
    let config = |kv_type| EngineConfig { threads: 0, context: 1024, kv_type, ..Default::default() };
    let (c, g) = (load_with_config(&m, cpu(), config(KvType::F16)), load_with_config(&m, cuda(), config(KvType::F16)));
    let g32 = load_with_config(&m, cuda(), config(KvType::F32));
    let prompts: Vec<Vec<u32>> = [300, 70, 33, 100].iter().enumerate().map(|(i, &n)| prompt(n, 1000 - 61 * i)).collect();
    let (mut cpu_seqs, mut gpu_seqs, want) = batched_prefill_matches(&c, &g, &prompts, "f16 cache, batched prefill");
    // The f32 cache, same prompt: rounding apart, the same function.
    let mut s32 = g32.new_session().unwrap();
    let e = rel_l2(&logits(&mut s32, &prompts[0]), &want[0]);
    assert!(e > 0.0 && e < 1e-2, "f16 against f32 cache: relative L2 {e:.2e}");
    assert_eq!(2 * gpu_seqs[0].kv_bytes(), s32.kv_bytes());
    let mut tok = argmax(&want[0]);
    for step in 0..40 {
        let want = logits(&mut cpu_seqs[0], &[tok]);
        let e = rel_l2(&logits(&mut gpu_seqs[0], &[tok]), &want);
        assert!(e < 1e-3, "f16 cache, decode step {step} after 300: relative L2 {e:.2e}");
        tok = argmax(&want);
    }
    let tokens: Vec<u32> = cpu_seqs.iter_mut().skip(1).map(|s| next_token(s, &[7])).collect();
    let gpu_tokens: Vec<u32> = gpu_seqs.iter_mut().skip(1).map(|s| next_token(s, &[7])).collect();
    assert_eq!(tokens, gpu_tokens, "f16 cache, greedy tokens");
    batched_decode_steps(&g, &mut cpu_seqs[..], &mut gpu_seqs[..], [tok].into_iter().chain(tokens).collect(), 12);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn q4_k_m_mix_greedy_tokens_match_cpu() {
    let m = gemma3(&small_shape(), FormatMix::Q4KM, 7);
    let (c, g) = (load(&m, cpu()), load(&m, cuda()));
    let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
    let p = prompt(9, 1000);
    let (mut tc, mut tg) = (next_token(&mut sc, &p), next_token(&mut sg, &p));
    for _ in 0..40 {
        assert_eq!(tc, tg);
        tc = next_token(&mut sc, &[tc]);
        tg = next_token(&mut sg, &[tg]);
    }
}

/// A vocabulary-sized logits head (40,000 rows: its one-row launch streams its weights, the final
/// norm in a launch of its own) and the top-k head over it match the CPU in decode steps, with
/// graphs and with host launches.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn vocabulary_sized_heads_match_cpu() {
    let m = gemma3(&Gemma3Shape { vocab: 40_000, ..small_shape() }, FormatMix::Q4KM, 31);
    let c = load(&m, cpu());
    for backend in [cuda(), cuda_host_launches()] {
        let g = load(&m, backend);
        let (mut sc, mut sg, mut sk) = (c.new_session().unwrap(), g.new_session().unwrap(), g.new_session().unwrap());
        let mut feed = prompt(11, 40_000);
        for step in 0..8 {
            let (want, got) = (logits(&mut sc, &feed), logits(&mut sg, &feed));
            let e = rel_l2(&got, &want);
            assert!(e < 1e-3, "step {step}: relative L2 {e:.2e}");
            let StepOutput::Candidates(k) = sk.forward(&feed, OutputMode::Candidates).unwrap() else { panic!("no candidates") };
            assert_eq!(k.len(), kiln_ir::CANDIDATES);
            assert_eq!(k[0].0, argmax(&got), "step {step}");
            feed = vec![argmax(&want)];
        }
    }
}

/// Several sequences in one step, each over its own cache at its own positions, give what each
/// gives alone on the CPU (with decode graphs and with host launches): a batched prefill of
/// prompts of different lengths, batched decode steps (logits, then greedy tokens), and a
/// step where three sequences decode while a new one prefills (as the server schedules them);
/// sliding layers wrap their rings on the way. Four sequences (the backend batches from 4) and
/// twelve take the tensor-core (`mmq`) products (this model's rows are short), captured too.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn batched_steps_match_each_sequence_alone() {
    let twelve: Vec<usize> = (0..12).map(|i| 2 + (7 * i) % 11).collect();
    for lengths in [&[5, 11, 2, 9][..], &twelve] {
        batched_steps_match(cuda(), lengths);
        batched_steps_match(cuda_host_launches(), lengths);
    }
}

/// Batched steps at widths over 2048 (as at 4B and 12B), where the few-row `mmq` launches of 4-8
/// rows split k into runs and the last block of each tile adds the runs' partial sums (here 4-9
/// runs a product): 7 sequences.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn batched_steps_of_wide_rows_match_each_sequence_alone() {
    let shape = Gemma3Shape { hidden: 2304, layers: 2, q_heads: 8, kv_heads: 4, head_dim: 256, ffn: 4608, ..small_shape() };
    batched_steps_match_shape(cuda(), &shape, &[5, 11, 2, 9, 4, 6, 3]);
}

/// Batched decode steps over long pasts split each (sequence, head)'s positions over blocks as one
/// sequence's steps do (here 4 sequences of 4 heads: up to 8 shares each), with graphs and with
/// host launches: every step's logits within relative L2 1e-3 of each sequence alone on the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn batched_decode_over_long_pasts_matches_each_sequence_alone() {
    let shape = Gemma3Shape { context: 1024, ..small_shape() };
    let m = gemma3(&shape, FormatMix::All(GgmlType::Q8_0), 17);
    let c = load_with_context(&m, cpu(), 1024);
    for backend in [cuda(), cuda_host_launches()] {
        let g = load_with_context(&m, backend, 1024);
        let prompts: Vec<Vec<u32>> = [150, 700, 420, 90].iter().enumerate().map(|(i, &n)| prompt(n, 1000 - 53 * i)).collect();
        let mut cpu_seqs: Vec<Session<'_>> = prompts.iter().map(|_| c.new_session().unwrap()).collect();
        let mut gpu_seqs: Vec<Session<'_>> = prompts.iter().map(|_| g.new_session().unwrap()).collect();
        let mut tokens = Vec::new();
        for ((sc, sg), p) in cpu_seqs.iter_mut().zip(gpu_seqs.iter_mut()).zip(&prompts) {
            let want = logits(sc, p);
            assert!(rel_l2(&logits(sg, p), &want) < 1e-3);
            tokens.push(argmax(&want));
        }
        batched_decode_steps(&g, &mut cpu_seqs, &mut gpu_seqs, tokens, 60);
    }
}

/// The top-k head's candidates (`OutputMode::Candidates`: the products' 64 largest, found on the
/// device) are the logits' 64 largest with their values, over an odd vocabulary of 3 slices (the
/// last shorter than 64) and a soft-capped one (the Gemma 2 fixture's 512 tokens): a prompt, decode steps with
/// graphs and with host launches, and batched steps of 5 sequences. (A one-row logits step
/// computes the final norm inside its head's launch, a top-k step before it: the values agree
/// within rounding, so a token may trade places only with one as large within that.)
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn candidates_are_the_likeliest_logits() {
    let check = |got: &[(u32, f32)], l: &[f32], what: &str| {
        let scale = l.iter().fold(0f32, |m, x| m.max(x.abs()));
        let tol = 1e-5 * scale;
        let mut sorted = l.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let k = kiln_ir::CANDIDATES.min(l.len());
        assert_eq!(got.len(), k, "{what}");
        assert!(got.windows(2).all(|w| w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0)), "{what}: not in order");
        for &(id, v) in got {
            assert!((v - l[id as usize]).abs() <= tol, "{what}: token {id} {v} against its logit {}", l[id as usize]);
            assert!(k == l.len() || l[id as usize] >= sorted[k] - 2.0 * tol, "{what}: token {id} is not among the likeliest");
        }
        let least = got[k - 1].1;
        let missing = (0..l.len()).filter(|&i| l[i] > least + 2.0 * tol && !got.iter().any(|c| c.0 as usize == i)).count();
        assert_eq!(missing, 0, "{what}: a likelier token is missing");
    };
    let candidates = |s: &mut Session<'_>, tokens: &[u32]| match s.forward(tokens, OutputMode::Candidates).unwrap() {
        StepOutput::Candidates(c) => c,
        other => panic!("expected candidates, got {other:?}"),
    };
    // (8,251 tokens: two slices of 4096 and one of 59, fewer than the 64 kept, and an odd count of
    // products before the partials. The Gemma 2 fixture soft-caps its logits: the kept values are
    // capped after the choice.)
    let shape = Gemma3Shape { vocab: 8_251, ..small_shape() };
    for (m, vocab) in [(gemma3(&shape, FormatMix::Q4KM, 29), 8_251), (family_model("gemma2"), 512)] {
        for backend in [cuda(), cuda_host_launches()] {
            let g = load(&m, backend);
            let (mut a, mut b) = (g.new_session().unwrap(), g.new_session().unwrap());
            let mut feed = prompt(21, vocab);
            for step in 0..12 {
                let (l, got) = (logits(&mut a, &feed), candidates(&mut b, &feed));
                check(&got, &l, &format!("vocabulary {vocab}, step {step}"));
                feed = vec![got[step % 5].0];
            }
            let mut seqs: Vec<(Session<'_>, Session<'_>)> = (0..5).map(|_| (g.new_session().unwrap(), g.new_session().unwrap())).collect();
            let mut tokens: Vec<u32> = (0..5).map(|i| 7 + 31 * i as u32).collect();
            for step in 0..4 {
                let (mut la, mut lb): (Vec<&mut Session<'_>>, Vec<&mut Session<'_>>) = seqs.iter_mut().map(|(x, y)| (x, y)).unzip();
                let want = g.decode_batch(&mut la, &tokens, OutputMode::Logits, &[]).unwrap();
                let got = g.decode_batch(&mut lb, &tokens, OutputMode::Candidates, &[]).unwrap();
                for (i, (w, c)) in want.into_iter().zip(got).enumerate() {
                    let (StepOutput::Logits(w), StepOutput::Candidates(c)) = (w.unwrap(), c.unwrap()) else { panic!("batched outputs") };
                    check(&c, &w, &format!("vocabulary {vocab}, batched step {step}, sequence {i}"));
                    tokens[i] = c[(step + i) % 3].0;
                }
            }
        }
    }
}

/// A step that draws its token on the device draws what the host draws from the same plan's
/// candidates or logits (`kiln_runtime::draw::draw_row`, bit for bit): one sequence at a time
/// (with graphs, each step launched ahead of the host's call) and batched, a greedy sequence
/// among them; the Gemma 2 fixture soft-caps its logits.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn drawn_tokens_are_the_host_draws() {
    let row_of = |out: StepOutput| match out {
        StepOutput::Candidates(c) => c.iter().map(|x| x.1).chain(c.iter().map(|x| x.0 as f32)).collect::<Vec<f32>>(),
        StepOutput::Logits(l) => l,
        other => panic!("expected candidates or logits, got {other:?}"),
    };
    let spec = |i: usize, seed: u64| DrawSpec {
        temperature: [0.8, 1.0, 1.7, 0.6, 0.0][i],
        top_k: [20, 40, 63, 5, 1][i],
        top_p: [0.95, 1.0, 0.9, 1.0, 1.0][i],
        min_p: [0.0, 0.05, 0.0, 0.0, 0.0][i],
        rng: DrawRng::new(seed),
    };
    let shape = Gemma3Shape { vocab: 8_251, ..small_shape() };
    let mut weights = Vec::new();
    for (m, vocab) in [(gemma3(&shape, FormatMix::Q4KM, 29), 8_251), (family_model("gemma2"), 512)] {
        for backend in [cuda(), cuda_host_launches()] {
            let g = load(&m, backend);
            for among in [Among::Candidates, Among::Vocabulary] {
                let plain = if among == Among::Candidates { OutputMode::Candidates } else { OutputMode::Logits };
                for i in 0..4 {
                    let (mut a, mut b) = (g.new_session().unwrap(), g.new_session().unwrap());
                    let mut d = spec(i, 40 + i as u64);
                    let mut feed = prompt(21, vocab);
                    for step in 0..16 {
                        let got = drawn_token(a.forward_with(&feed, OutputMode::Drawn(among), Some(&d)).unwrap());
                        let want = draw::draw_row(&row_of(b.forward(&feed, plain).unwrap()), among, &d, &mut weights);
                        assert_eq!(got as i32, want, "vocabulary {vocab}, {among:?}, draw {i}, step {step}");
                        d.rng.next_u64();
                        feed = vec![got];
                    }
                }
                let mut seqs: Vec<(Session<'_>, Session<'_>)> =
                    (0..5).map(|_| (g.new_session().unwrap(), g.new_session().unwrap())).collect();
                let mut tokens: Vec<u32> = (0..5).map(|i| 7 + 31 * i as u32).collect();
                let mut draws: Vec<DrawSpec> = (0..5).map(|i| spec(i, 90 + i as u64)).collect();
                for step in 0..6 {
                    let (mut la, mut lb): (Vec<&mut Session<'_>>, Vec<&mut Session<'_>>) = seqs.iter_mut().map(|(x, y)| (x, y)).unzip();
                    let got = g.decode_batch(&mut la, &tokens, OutputMode::Drawn(among), &draws).unwrap();
                    let rows = g.decode_batch(&mut lb, &tokens, plain, &[]).unwrap();
                    for (i, (got, row)) in got.into_iter().zip(rows).enumerate() {
                        let (got, row) = (drawn_token(got.unwrap()), row_of(row.unwrap()));
                        let want = draw::draw_row(&row, among, &draws[i], &mut weights);
                        assert_eq!(got as i32, want, "vocabulary {vocab}, {among:?}, batched step {step}, sequence {i}");
                        draws[i].rng.next_u64();
                        tokens[i] = got;
                    }
                }
            }
        }
    }
}

/// The draw among all logits over more runs than `draw_vocabulary` takes in one chunk (1,100,003
/// tokens: 1,075 runs of 1,024, the last short) draws what the host draws from the same plan's
/// logits, bit for bit: greedy and tempered, one sequence and batched. Some tempered draws fall past
/// the first chunk (the test fails if none does).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn draws_over_more_than_a_chunk_of_runs() {
    let vocab = 1_100_003;
    let shape = Gemma3Shape { hidden: 256, layers: 1, q_heads: 2, kv_heads: 1, ffn: 512, vocab, ..small_shape() };
    let g = load(&gemma3(&shape, FormatMix::Q4KM, 31), cuda());
    let spec =
        |i: usize, seed: u64| DrawSpec { temperature: [1.0, 0.0, 2.5][i % 3], top_k: 0, top_p: 1.0, min_p: 0.0, rng: DrawRng::new(seed) };
    let mut weights = Vec::new();
    let drawn = OutputMode::Drawn(Among::Vocabulary);
    let mut past_first_chunk = 0;
    for i in 0..3 {
        let (mut a, mut b) = (g.new_session().unwrap(), g.new_session().unwrap());
        let mut d = spec(i, 70 + i as u64);
        let mut feed = prompt(9, vocab);
        for step in 0..24 {
            let got = drawn_token(a.forward_with(&feed, drawn, Some(&d)).unwrap());
            let want = draw::draw_row(&logits(&mut b, &feed), Among::Vocabulary, &d, &mut weights);
            assert_eq!(got as i32, want, "draw {i}, step {step}");
            past_first_chunk += (got >= 1 << 20) as usize;
            d.rng.next_u64();
            feed = vec![got];
        }
    }
    let mut seqs: Vec<(Session<'_>, Session<'_>)> = (0..3).map(|_| (g.new_session().unwrap(), g.new_session().unwrap())).collect();
    let mut tokens: Vec<u32> = vec![5, 700_001, 1_100_002];
    let mut draws: Vec<DrawSpec> = (0..3).map(|i| spec(i, 80 + i as u64)).collect();
    for step in 0..12 {
        let (mut la, mut lb): (Vec<&mut Session<'_>>, Vec<&mut Session<'_>>) = seqs.iter_mut().map(|(x, y)| (x, y)).unzip();
        let got = g.decode_batch(&mut la, &tokens, drawn, &draws).unwrap();
        let rows = g.decode_batch(&mut lb, &tokens, OutputMode::Logits, &[]).unwrap();
        for (i, (got, row)) in got.into_iter().zip(rows).enumerate() {
            let StepOutput::Logits(row) = row.unwrap() else { panic!("batched step gave no logits") };
            let got = drawn_token(got.unwrap());
            let want = draw::draw_row(&row, Among::Vocabulary, &draws[i], &mut weights);
            assert_eq!(got as i32, want, "batched step {step}, sequence {i}");
            past_first_chunk += (got >= 1 << 20) as usize;
            draws[i].rng.next_u64();
            tokens[i] = got;
        }
    }
    assert!(past_first_chunk > 0, "no draw fell past the first chunk of runs: pick other seeds");
}

/// `steps` batched decode steps of `gpu_seqs` from `tokens`, each sequence's logits within relative
/// L2 1e-3 of its CPU twin decoding alone; greedy tokens fed back. Returns the last step's tokens.
fn batched_decode_steps(
    g: &Model,
    cpu_seqs: &mut [Session<'_>],
    gpu_seqs: &mut [Session<'_>],
    mut tokens: Vec<u32>,
    steps: usize,
) -> Vec<u32> {
    for step in 0..steps {
        let want: Vec<Vec<f32>> = cpu_seqs.iter_mut().zip(&tokens).map(|(s, &t)| logits(s, &[t])).collect();
        let mut refs: Vec<&mut Session<'_>> = gpu_seqs.iter_mut().collect();
        let got = g.decode_batch(&mut refs, &tokens, OutputMode::Logits, &[]).unwrap();
        for (i, (got, want)) in got.into_iter().zip(&want).enumerate() {
            let StepOutput::Logits(got) = got.unwrap() else { panic!("batched decode gave no logits") };
            let e = rel_l2(&got, want);
            assert!(e < 1e-3, "batched decode step {step}, sequence {i}: relative L2 {e:.2e}");
        }
        tokens = want.iter().map(|w| argmax(w)).collect();
    }
    tokens
}

fn batched_steps_match(backend: Arc<CudaBackend>, lengths: &[usize]) {
    batched_steps_match_shape(backend, &small_shape(), lengths)
}

fn batched_steps_match_shape(backend: Arc<CudaBackend>, shape: &Gemma3Shape, lengths: &[usize]) {
    batched_steps_match_model(backend, &gemma3(shape, FormatMix::Q4KM, 13), shape.vocab, lengths);
}

/// `batched_steps_match` for the model `m` of `vocab` tokens.
fn batched_steps_match_model(backend: Arc<CudaBackend>, m: &SynthModel, vocab: usize, lengths: &[usize]) {
    assert_eq!(backend.batches_from(), 4);
    let (c, g) = (load(m, cpu()), load(m, backend));
    let prompts: Vec<Vec<u32>> = lengths.iter().enumerate().map(|(i, &n)| prompt(n + 3 * i, vocab - 37 * i)).collect();
    let mut cpu_seqs: Vec<Session<'_>> = prompts.iter().map(|_| c.new_session().unwrap()).collect();
    let mut gpu_seqs: Vec<Session<'_>> = prompts.iter().map(|_| g.new_session().unwrap()).collect();
    let want: Vec<Vec<f32>> = cpu_seqs.iter_mut().zip(&prompts).map(|(s, p)| logits(s, p)).collect();
    let chunks: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let mut refs: Vec<&mut Session<'_>> = gpu_seqs.iter_mut().collect();
    let got = g.forward_batch(&mut refs, &chunks, OutputMode::Logits, &[]).unwrap();
    let mut tokens = Vec::new();
    for (i, (got, want)) in got.into_iter().zip(&want).enumerate() {
        let StepOutput::Logits(got) = got.unwrap() else { panic!("batched prefill gave no logits") };
        let e = rel_l2(&got, want);
        assert!(e < 1e-3, "batched prefill, sequence {i}: relative L2 {e:.2e}");
        tokens.push(argmax(want));
    }
    let tokens = batched_decode_steps(&g, &mut cpu_seqs, &mut gpu_seqs, tokens, 10);
    let want: Vec<u32> = cpu_seqs.iter_mut().zip(&tokens).map(|(s, &t)| next_token(s, &[t])).collect();
    let mut refs: Vec<&mut Session<'_>> = gpu_seqs.iter_mut().collect();
    let got: Vec<u32> = g
        .decode_batch(&mut refs, &tokens, OutputMode::NextToken, &[])
        .unwrap()
        .into_iter()
        .map(|t| match t.unwrap() {
            StepOutput::Token(t) => t,
            other => panic!("a greedy batched step gave {other:?}"),
        })
        .collect();
    assert_eq!(got, want, "greedy batched decode");
    // Sequences 0-2 decode while a new sequence prefills, in one step.
    let fresh = prompt(7, vocab - 100);
    let (mut cpu_new, mut gpu_new) = (c.new_session().unwrap(), g.new_session().unwrap());
    let mut want: Vec<Vec<f32>> = cpu_seqs.iter_mut().zip(&want).take(3).map(|(s, &t)| logits(s, &[t])).collect();
    want.push(logits(&mut cpu_new, &fresh));
    let mut refs: Vec<&mut Session<'_>> = gpu_seqs.iter_mut().take(3).collect();
    refs.push(&mut gpu_new);
    let chunks: Vec<&[u32]> = got.iter().take(3).map(std::slice::from_ref).chain([fresh.as_slice()]).collect();
    let got = g.forward_batch(&mut refs, &chunks, OutputMode::Logits, &[]).unwrap();
    for (i, (got, want)) in got.into_iter().zip(&want).enumerate() {
        let StepOutput::Logits(got) = got.unwrap() else { panic!("mixed step gave no logits") };
        let e = rel_l2(&got, want);
        assert!(e < 1e-3, "decode beside a prefill, sequence {i}: relative L2 {e:.2e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Every model family (the fixtures of crates/models/tests/fixtures/families)
// ---------------------------------------------------------------------------------------------

/// The CUDA fast path's bounds against the fixtures' references (activations quantized to about
/// 15 bits; a prompt's products through `mmq` or cuBLAS, a decode step's through the
/// matrix-vector kernels, so decoding a prompt token by token is close to its prefill, not
/// equal): the relative L2 bound and near-tie gap of the default model's CUDA tests.
const CUDA: Bounds = Bounds { logits: 1e-2, logprob: 2e-2, modes: 1e-3, decode: 2e-3, tie: 5e-2, trusted: 0 };

/// The family fixture `family` as a model file to edit.
fn family_model(family: &str) -> SynthModel {
    SynthModel::from_gguf(&GgufFile::open(&fixture_path(family, "gguf")).unwrap())
}

/// The family fixture `family` loaded on `backend` with its trained context (512).
fn load_family(m: &SynthModel, backend: Arc<dyn Backend>) -> Model {
    load_with_context(m, backend, 512)
}

macro_rules! family_fixtures {
    ($($name:ident => $family:expr),*) => {$(
        /// The family's fixture checks (`common/families.rs`) on CUDA, with decode graphs and with
        /// host launches.
        #[test]
        #[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
        fn $name() {
            let m = family_model($family);
            for backend in [cuda(), cuda_host_launches()] {
                check_family(&load_family(&m, backend), $family, &CUDA);
            }
        }
    )*};
}

family_fixtures!(
    llama_fixture_matches_the_reference => "llama",
    qwen2_fixture_matches_the_reference => "qwen2",
    qwen3_fixture_matches_the_reference => "qwen3",
    gemma_fixture_matches_the_reference => "gemma",
    gemma2_fixture_matches_the_reference => "gemma2",
    gemma3_fixture_matches_the_reference => "gemma3",
    gemma4_fixture_matches_the_reference => "gemma4"
);

/// CPU and CUDA agree on every family fixture with its matrices re-encoded in one format (the
/// fixtures mix formats so that nothing shares one: here the q/k/v and gate/up launches fuse, with
/// SiLU or GELU, and the norms around them run inside them): a prompt of 200 tokens (the tiled
/// attention, Gemma 2's soft-capped), one of 3 (the several-row matrix-vector kernels), each
/// followed by 24 decode steps past the sliding windows (graphs and host launches), and greedy
/// tokens.
fn family_in_one_format_matches_cpu(family: &str) {
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_0] {
        let mut m = family_model(family);
        m.requantize_matrices(ty).unwrap();
        let (c, g, h) = (load_family(&m, cpu()), load_family(&m, cuda()), load_family(&m, cuda_host_launches()));
        let vocab = c.architecture().vocab_size();
        for n in [200, 3] {
            let p = prompt(n, vocab);
            let (mut sc, mut sg, mut sh) = (c.new_session().unwrap(), g.new_session().unwrap(), h.new_session().unwrap());
            let want = logits(&mut sc, &p);
            for (name, s) in [("graphs", &mut sg), ("host launches", &mut sh)] {
                let e = rel_l2(&logits(s, &p), &want);
                assert!(e < 1e-3, "{family} {ty:?} prefill {n} ({name}): relative L2 {e:.2e}");
            }
            let mut tok = argmax(&want);
            for step in 0..24 {
                let want = logits(&mut sc, &[tok]);
                for (name, s) in [("graphs", &mut sg), ("host launches", &mut sh)] {
                    let e = rel_l2(&logits(s, &[tok]), &want);
                    assert!(e < 1e-3, "{family} {ty:?} decode step {step} after {n} ({name}): relative L2 {e:.2e}");
                }
                tok = argmax(&want);
            }
        }
        let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
        let p = prompt(9, vocab);
        let (mut tc, mut tg) = (next_token(&mut sc, &p), next_token(&mut sg, &p));
        for _ in 0..16 {
            assert_eq!(tc, tg, "{family} {ty:?}: greedy tokens");
            tc = next_token(&mut sc, &[tc]);
            tg = next_token(&mut sg, &[tg]);
        }
        println!("{family} {ty:?}: CUDA matches the CPU");
    }
}

macro_rules! families_in_one_format {
    ($($name:ident => $family:expr),*) => {$(
        #[test]
        #[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
        fn $name() {
            family_in_one_format_matches_cpu($family);
        }
    )*};
}

families_in_one_format!(
    llama_in_one_format_matches_cpu => "llama",
    qwen2_in_one_format_matches_cpu => "qwen2",
    qwen3_in_one_format_matches_cpu => "qwen3",
    gemma_in_one_format_matches_cpu => "gemma",
    gemma2_in_one_format_matches_cpu => "gemma2",
    gemma3_in_one_format_matches_cpu => "gemma3",
    gemma4_in_one_format_matches_cpu => "gemma4"
);

/// Batched steps of Llama and Qwen 2 (scaled RoPE of adjacent pairs; q/k/v biases) give what each
/// sequence gives alone on the CPU, with graphs and host launches: the fixtures as they are
/// (F16, F32 and Q4_0 products through the several-row matrix-vector kernels, the others through
/// `mmq`) and in Q4_K; 4 and 12 sequences (see `batched_steps_match`).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn batched_steps_of_llama_and_qwen2_match_each_sequence_alone() {
    let twelve: Vec<usize> = (0..12).map(|i| 2 + (7 * i) % 11).collect();
    for family in ["llama", "qwen2"] {
        let mut q4k = family_model(family);
        q4k.requantize_matrices(GgmlType::Q4_K).unwrap();
        for m in [family_model(family), q4k] {
            for lengths in [&[5, 11, 2, 9][..], &twelve] {
                batched_steps_match_model(cuda(), &m, 512, lengths);
                batched_steps_match_model(cuda_host_launches(), &m, 512, lengths);
            }
        }
    }
}

/// A one-layer Llama 3 (with its RoPE divisors) or Qwen 2 (with q/k/v biases) of `hidden` wide
/// rows, `heads` query heads of 128 (a quarter as many key heads) and an MLP of `ffn`, every matrix
/// in `ty`, over a vocabulary of 512.
fn wide_family(arch: LlamaArch, hidden: usize, heads: usize, ffn: usize, ty: GgmlType) -> SynthModel {
    let shape = LlamaShape {
        arch,
        hidden,
        layers: 1,
        q_heads: heads,
        kv_heads: heads / 4,
        head_dim: 128,
        ffn,
        vocab: 512,
        context: 512,
        rope_base: 500_000.0,
        rope_factor: if arch == LlamaArch::Llama { 8.0 } else { 1.0 },
        tied: false,
    };
    llama(&shape, FormatMix::All(ty), 5)
}

/// CPU and CUDA agree on a Llama, and a Qwen 2 with its q/k/v biases, whose one-row launches stream
/// their weights through shared memory (`matvecr`: rows of 2048 or 3072, wider than the norm
/// prologues take, 4 MB and more a launch): q/k/v (with the biases added by the launch), o, the gate/up pair
/// with its SiLU product (`matvecr*_silu_<fmt>`) and the down projection, in every ring format; a
/// prompt of 20 tokens (`mmq`), decode steps and greedy tokens.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn streamed_swiglu_launches_match_cpu() {
    let formats = [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q5_0];
    for (family, ty) in formats.iter().map(|&t| (LlamaArch::Llama, t)).chain(formats.iter().map(|&t| (LlamaArch::Qwen2, t))) {
        // (Qwen 2 at 3072: its q/k/v read 4 MB and more in every format, so they stream and add
        // their biases.)
        let (hidden, heads) = if family == LlamaArch::Qwen2 { (3072, 24) } else { (2048, 16) };
        let m = wide_family(family, hidden, heads, 8192, ty);
        let (c, g) = (load_family(&m, cpu()), load_family(&m, cuda()));
        let p = prompt(20, 512);
        let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
        let (want, got) = (logits(&mut sc, &p), logits(&mut sg, &p));
        let e = rel_l2(&got, &want);
        assert!(e < 1e-3, "{family:?} {ty:?} prefill: relative L2 {e:.2e}");
        let mut tok = argmax(&want);
        for step in 0..6 {
            let (want, got) = (logits(&mut sc, &[tok]), logits(&mut sg, &[tok]));
            let e = rel_l2(&got, &want);
            assert!(e < 1e-3, "{family:?} {ty:?} decode step {step}: relative L2 {e:.2e}");
            tok = argmax(&want);
        }
        let (mut sc, mut sg) = (c.new_session().unwrap(), g.new_session().unwrap());
        let (mut tc, mut tg) = (next_token(&mut sc, &p), next_token(&mut sg, &p));
        for _ in 0..4 {
            assert_eq!(tc, tg, "{family:?} {ty:?}");
            tc = next_token(&mut sc, &[tc]);
            tg = next_token(&mut sg, &[tg]);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn a_second_session_replays_correctly_and_reset_reuses_the_cache() {
    let m = gemma3(&small_shape(), FormatMix::Q4KM, 9);
    // (A backend of its own: the other tests capture graphs at the same time.)
    let backend = Arc::new(CudaBackend::new(0).expect("CUDA device 0"));
    let (c, g) = (load(&m, cpu()), load(&m, backend.clone()));
    let p = prompt(6, 1000);
    let mut sc = c.new_session().unwrap();
    let mut want = vec![next_token(&mut sc, &p)];
    for _ in 0..10 {
        let t = next_token(&mut sc, &[*want.last().unwrap()]);
        want.push(t);
    }
    // Two sessions interleaved (two KV caches through the same plans), then one reset and rerun.
    let (mut a, mut b) = (g.new_session().unwrap(), g.new_session().unwrap());
    let (mut ta, mut tb) = (vec![next_token(&mut a, &p)], vec![next_token(&mut b, &p)]);
    let captured = backend.decode_graphs_captured();
    for _ in 0..10 {
        let x = next_token(&mut a, &[*ta.last().unwrap()]);
        ta.push(x);
        let y = next_token(&mut b, &[*tb.last().unwrap()]);
        tb.push(y);
    }
    assert_eq!(ta, want);
    assert_eq!(tb, want);
    // The sessions share each bucket's graph (at most the two buckets these positions span), not
    // one capture per switch of cache (20).
    let captures = backend.decode_graphs_captured() - captured;
    assert!(captures <= 2, "{captures} decode graphs captured for 20 interleaved steps of two sessions");
    a.reset();
    let mut again = vec![next_token(&mut a, &p)];
    for _ in 0..10 {
        let x = next_token(&mut a, &[*again.last().unwrap()]);
        again.push(x);
    }
    assert_eq!(again, want);
}

/// Greedy decode steps launched one ahead (exec.rs `greedy_step`) give the same tokens and logits
/// as steps launched one at a time: a session run alone (its steps go ahead) against two sessions
/// that take turns (theirs never do), on one model: a long greedy run; a reset and the same prompt
/// again, whose run reaches the positions and tokens of the first run's step ahead (computed on a
/// cache since cleared: it must not be taken, though here it would give the same token); another
/// prompt; a logits step in the middle of each run (another executable runs on the cache, so the
/// step ahead is dropped); runs long enough to cross decode buckets (64 and 128 positions) and a
/// sliding layer's ring of 8 many times.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn greedy_steps_run_ahead_exactly() {
    let m = gemma3(&small_shape(), FormatMix::Q4KM, 13);
    let g = load(&m, cuda());
    // A run of `steps` greedy steps after `p` in `s` (each step of `other` too, in turn, if given):
    // its tokens, and the logits of the step at 40.
    let run = |s: &mut Session<'_>, mut other: Option<&mut Session<'_>>, p: &[u32]| {
        s.reset();
        let mut tokens = vec![next_token(s, p)];
        if let Some(o) = other.as_deref_mut() {
            o.reset();
            next_token(o, p);
        }
        let mut at40 = Vec::new();
        for step in 0..100 {
            let t = *tokens.last().unwrap();
            if step == 40 {
                at40 = logits(s, &[t]);
                tokens.push(argmax(&at40));
            } else {
                tokens.push(next_token(s, &[t]));
            }
            if let Some(o) = other.as_deref_mut() {
                next_token(o, &[t]);
            }
        }
        (tokens, at40)
    };
    let (mut alone, mut turns, mut other) = (g.new_session().unwrap(), g.new_session().unwrap(), g.new_session().unwrap());
    for (i, p) in [prompt(6, 1000), prompt(6, 1000), prompt(11, 977)].iter().enumerate() {
        let (want, want40) = run(&mut turns, Some(&mut other), p);
        let (got, got40) = run(&mut alone, None, p);
        assert_eq!(got, want, "run {i}: tokens");
        assert_eq!(got40, want40, "run {i}: the logits step");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn bad_input_is_a_clear_error() {
    let m = gemma3(&small_shape(), FormatMix::Q4KM, 3);
    let g = load(&m, cuda());
    let mut s = g.new_session().unwrap();
    let e = s.forward(&[5, 1000], OutputMode::Logits).unwrap_err().to_string();
    assert!(e.contains("1000") && e.contains("vocabulary"), "{e}");
    // A format the CUDA kernels cannot read is named when the plan is prepared.
    let bad = gemma3(&small_shape(), FormatMix::All(GgmlType::Q8_K), 3);
    let g = load(&bad, cuda());
    let e = g.new_session().unwrap().forward(&[5, 6], OutputMode::Logits).unwrap_err().to_string();
    assert!(e.contains("Q8_K"), "{e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn a_kv_cache_larger_than_the_device_is_a_clear_error() {
    // 2^28 positions of the global layer's keys and values: 512 GiB, more than any card holds.
    let context = 1 << 28;
    let m = gemma3(&Gemma3Shape { context, ..small_shape() }, FormatMix::Q4KM, 3);
    let g = load_with_context(&m, cuda(), context);
    let e = g.new_session().err().expect("a 512 GiB cache cannot be allocated").to_string();
    assert!(e.contains("KV cache of 268435456 positions") && e.contains("GiB") && e.contains("free"), "{e}");
    // A cache that fits is still allocated afterwards.
    let g = load(&m, cuda());
    assert_eq!(g.new_session().unwrap().position(), 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
fn read_bandwidth_is_measured() {
    let b = cuda().read_bandwidth(1 << 30, 5).unwrap();
    println!("device-memory read bandwidth: {:.0} GB/s", b / 1e9);
    assert!(b > 1e11, "{b}");
}

// ---------------------------------------------------------------------------------------------
// The default model against the reference
// ---------------------------------------------------------------------------------------------

fn refs() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs"))
}

fn default_models() -> &'static (Model, Model) {
    static M: OnceLock<(Model, Model)> = OnceLock::new();
    M.get_or_init(|| {
        let path = kiln_hub::ensure_default_model().expect("default model");
        let load = |b: Arc<dyn Backend>| Model::load(&path, b, EngineConfig::default()).expect("load model");
        (load(cuda()), load(cpu()))
    })
}

fn read_npy_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("npy file");
    assert_eq!(&bytes[..6], b"\x93NUMPY", "not an npy file");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
    };
    bytes[start + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn check_prompt(name: &str) {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(refs().join(format!("{name}.json"))).unwrap()).unwrap();
    let (g, c) = default_models();
    let p = ids(&r["input_ids"]);
    let got = logits(&mut g.new_session().unwrap(), &p);
    let cpu = logits(&mut c.new_session().unwrap(), &p);
    let want = read_npy_f32(&refs().join(format!("{name}_last_logits.npy")));
    let (e_cpu, e_ref) = (rel_l2(&got, &cpu), rel_l2(&got, &want));
    println!("{name}: {} tokens, CUDA vs CPU relative L2 {e_cpu:.2e}, vs reference {e_ref:.2e}", p.len());
    assert!(e_cpu < 1e-2 && e_ref < 1e-2, "{name}: relative L2 {e_cpu} (CPU), {e_ref} (reference)");
    assert_eq!(argmax(&got), argmax(&cpu), "{name}: top-1 vs CPU");
    assert_eq!(argmax(&got), argmax(&want), "{name}: top-1 vs reference");

    let greedy = &r["greedy"];
    let want_ids = ids(&greedy["ids"]);
    let steps = greedy["steps"].as_array().unwrap();
    let trusted = steps.iter().position(|st| st["gap_top1_top2"].as_f64().unwrap() < 5e-2).unwrap_or(steps.len());
    let mut s = g.new_session().unwrap();
    let mut out = vec![next_token(&mut s, &p)];
    while out.len() < trusted {
        let t = next_token(&mut s, &[*out.last().unwrap()]);
        out.push(t);
    }
    out.truncate(trusted);
    assert_eq!(out, want_ids[..trusted], "{name}: greedy continuation (first {trusted} steps)");
    println!("{name}: greedy continuation matches the reference for {trusted} steps");
}

macro_rules! prompts {
    ($($name:ident),*) => {$(
        #[test]
        #[ignore = "needs an NVIDIA GPU: run with --include-ignored on the device machine"]
        fn $name() {
            check_prompt(stringify!($name));
        }
    )*};
}

prompts!(p0, p1, p2, p3, p4, p5, p6, p7, p8, long);
