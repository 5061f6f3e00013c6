//! Batch-1 decode against the memory bandwidth (what `kiln bench` does not report): prompt
//! processing (pp) and token generation (tg, from an empty cache) of a GGUF model on CUDA device 0,
//! the device's measured read bandwidth, the fraction of it that decode reaches (weight bytes per
//! token / time per token), and a fingerprint of the greedy tokens to compare builds.
//!
//! Usage: `decode_timing MODEL.gguf [PP_TOKENS] [TG_TOKENS] [REPS]`

use std::sync::Arc;
use std::time::Instant;

use kiln_cuda::CudaBackend;
use kiln_models::{Model, OutputMode, StepOutput};
use kiln_runtime::EngineConfig;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: decode_timing MODEL.gguf [PP_TOKENS] [TG_TOKENS] [REPS]")?;
    let pp: usize = args.get(2).map_or(Ok(512), |s| s.parse())?;
    let tg: usize = args.get(3).map_or(Ok(128), |s| s.parse())?;
    let reps: usize = args.get(4).map_or(Ok(5), |s| s.parse())?;
    if pp == 0 || tg == 0 || reps == 0 {
        return Err(format!("PP_TOKENS, TG_TOKENS and REPS must be at least 1 (got {pp}, {tg}, {reps})").into());
    }
    let backend = Arc::new(CudaBackend::new(0)?);
    let t = Instant::now();
    let model =
        Model::load(std::path::Path::new(path), backend.clone(), EngineConfig { max_prefill_rows: pp.max(1), ..Default::default() })?;
    println!("model {path}: loaded in {:.2} s on {}", t.elapsed().as_secs_f64(), backend.device_name());
    // Bytes a decode step reads: every matrix once (the tied embedding as the output head).
    let weight_bytes: usize = model.file().tensors().iter().map(|t| model.file().tensor_data(t).len()).sum();
    let vocab = model.architecture().vocab_size() as u32;
    let prompt: Vec<u32> = (0..pp).map(|i| 4 + (i as u32 * 7919) % (vocab - 4)).collect();
    let mut s = model.new_session()?;
    let (mut pp_times, mut tg_times) = (Vec::new(), Vec::new());
    let mut generated = Vec::with_capacity(tg);
    for rep in 0..=reps {
        s.reset();
        let t = Instant::now();
        s.forward(&prompt, OutputMode::NextToken)?;
        let pp_s = t.elapsed().as_secs_f64();
        s.reset();
        let StepOutput::Token(mut tok) = s.forward(&[2], OutputMode::NextToken)? else { return Err("no token".into()) };
        generated.clear();
        let t = Instant::now();
        for _ in 0..tg {
            let StepOutput::Token(next) = s.forward(&[tok], OutputMode::NextToken)? else { return Err("no token".into()) };
            generated.push(next);
            tok = next;
        }
        let tg_s = t.elapsed().as_secs_f64();
        if rep > 0 {
            // The first repetition compiles plans and captures graphs.
            pp_times.push(pp_s);
            tg_times.push(tg_s);
        }
    }
    let (pp_s, tg_s) = (median(pp_times), median(tg_times));
    let bandwidth = backend.read_bandwidth(4 << 30, 9)?;
    let per_token = tg_s / tg as f64;
    // The greedy tokens, to compare builds (a fingerprint of the whole decode path).
    let fingerprint = generated.iter().fold(0u64, |h, &t| h.wrapping_mul(1_000_003).wrapping_add(t as u64));
    println!("tg tokens: {:?}... fingerprint {fingerprint:016x}", &generated[..generated.len().min(8)]);
    println!("device read bandwidth: {:.0} GB/s", bandwidth / 1e9);
    println!("decode step: {} kernels in its CUDA graph", backend.decode_graph_kernels());
    println!("pp{pp}: {:.0} tokens/s ({:.2} ms)", pp as f64 / pp_s, pp_s * 1e3);
    println!("tg{tg}: {:.0} tokens/s ({:.1} us/token)", tg as f64 / tg_s, per_token * 1e6);
    println!(
        "decode reads {:.1} MB of weights per token: {:.0} GB/s = {:.0}% of the measured bandwidth",
        weight_bytes as f64 / 1e6,
        weight_bytes as f64 / per_token / 1e9,
        100.0 * weight_bytes as f64 / per_token / bandwidth
    );
    Ok(())
}
