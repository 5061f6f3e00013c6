//! `kiln bench`: llama-bench style throughput of prompt processing (`pp N`: N tokens in one forward
//! call) and token generation (`tg N`: N greedy decode steps; with S parallel sequences, N batched
//! steps of S sequences, as llama-batched-bench), from an empty cache or after D tokens of context
//! (`@ dD`, llama-bench's `-d`), mean and standard deviation over repetitions after a warm-up; a
//! markdown table or JSON records with llama-bench's field names.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use kiln_models::{Model, OutputMode, StepOutput};
use kiln_runtime::KvType;
use serde_json::{json, Value};

use crate::cli::{BenchArgs, BenchOutput};

/// One test: `n_prompt` tokens processed at once, or `n_gen` tokens generated one by one in each
/// of `seqs` sequences decoded together, after `depth` tokens of context (untimed).
#[derive(Clone, Copy, Debug)]
struct Test {
    n_prompt: usize,
    n_gen: usize,
    seqs: usize,
    depth: usize,
}

impl Test {
    fn name(&self) -> String {
        let name = match (self.n_prompt, self.seqs) {
            (0, 1) => format!("tg{}", self.n_gen),
            (0, s) => format!("tg{} x{s}", self.n_gen),
            (p, _) => format!("pp{p}"),
        };
        if self.depth > 0 {
            format!("{name} @ d{}", self.depth)
        } else {
            name
        }
    }

    /// Tokens one sequence holds at the end.
    fn context_needed(&self) -> usize {
        self.depth + self.n_prompt + self.n_gen
    }

    /// Tokens processed or generated in all.
    fn tokens(&self) -> usize {
        self.n_prompt + self.n_gen * self.seqs
    }
}

/// Deterministic prompt tokens spread over the vocabulary, avoiding the first (special) ids.
fn prompt_tokens(n: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(1000).max(1);
    (0..n).map(|i| (1000 + (i * 7919 + 13) % span).min(vocab - 1) as u32).collect()
}

/// Runs `test` once and returns its duration in nanoseconds. Each sequence first processes the
/// test's depth in prompt tokens (untimed). Generation decodes its sequences together, one batched
/// greedy step per token (one sequence: a plain decode step); the first starts from `<bos>`, the
/// others from their own tokens.
fn run_once(model: &Model, test: Test) -> Result<u128> {
    let vocab = model.architecture().vocab_size();
    let context = prompt_tokens(test.depth + test.n_prompt, vocab);
    let new_session = || -> Result<_> {
        let mut session = model.new_session()?;
        if test.depth > 0 {
            session.forward(&context[..test.depth], OutputMode::NextToken)?;
        }
        Ok(session)
    };
    if test.n_prompt > 0 {
        let mut session = new_session()?;
        let t0 = Instant::now();
        session.forward(&context[test.depth..], OutputMode::NextToken)?;
        return Ok(t0.elapsed().as_nanos());
    }
    let mut sessions = (0..test.seqs).map(|_| new_session()).collect::<Result<Vec<_>>>()?;
    let bos = model.tokenizer().bos_id().unwrap_or(2);
    let mut tokens: Vec<u32> = std::iter::once(bos).chain(prompt_tokens(test.seqs - 1, vocab)).collect();
    let t0 = Instant::now();
    for _ in 0..test.n_gen {
        let mut refs: Vec<_> = sessions.iter_mut().collect();
        let outs = model.decode_batch(&mut refs, &tokens, OutputMode::NextToken, &[])?;
        for (t, out) in tokens.iter_mut().zip(outs) {
            match out? {
                StepOutput::Token(next) => *t = next,
                other => bail!("a greedy step returned {other:?} instead of a token"),
            }
        }
    }
    Ok(t0.elapsed().as_nanos())
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// UTC time as ISO 8601 (`2026-01-31T12:34:56Z`), as llama-bench's `test_time`.
fn iso8601_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// Runs `kiln bench`.
pub fn bench(a: BenchArgs) -> Result<()> {
    if a.repetitions == 0 {
        bail!("-r/--repetitions must be at least 1");
    }
    if a.seqs.contains(&0) {
        bail!("-s/--seqs must be at least 1");
    }
    let mut tests = Vec::new();
    for &depth in &a.n_depth {
        tests.extend(a.n_prompt.iter().filter(|&&n| n > 0).map(|&n| Test { n_prompt: n, n_gen: 0, seqs: 1, depth }));
        for &n in a.n_gen.iter().filter(|&&n| n > 0) {
            tests.extend(a.seqs.iter().map(|&seqs| Test { n_prompt: 0, n_gen: n, seqs, depth }));
        }
    }
    if tests.is_empty() {
        bail!("nothing to measure: give a positive -p or -n");
    }
    let model = crate::commands::load(&a.model)?;
    if let Some(t) = tests.iter().find(|t| t.context_needed() > model.context()) {
        bail!("{} needs {} tokens but the context holds {} (raise -c)", t.name(), t.context_needed(), model.context());
    }
    let file = model.file();
    let model_size: u64 = file.tensors().iter().map(|t| file.tensor_data(t).len() as u64).sum();
    let n_params: u64 = file.tensors().iter().map(|t| t.n_elements()).sum();
    let arch = file.architecture().unwrap_or("unknown").to_string();
    let size_label = file.get_str("general.size_label").map(|s| format!(" {s}")).unwrap_or_default();
    let ftype = file
        .get_u32("general.file_type")
        .map(|f| kiln_quant::file_type_name(f).map_or_else(|| format!(" file type {f}"), |n| format!(" {n}")))
        .unwrap_or_default();
    let model_type = format!("{arch}{size_label}{ftype}");
    let model_filename = a
        .model
        .model
        .as_ref()
        .map_or_else(|| kiln_hub::ensure_default_model().map(|p| p.display().to_string()).unwrap_or_default(), |p| p.display().to_string());
    // (A KV cache other than the default f32 is named beside the backend, as llama-bench adds a
    // type_k column.)
    let kv_type = a.model.kv_type;
    let backend = match kv_type {
        KvType::F32 => model.backend_name(),
        other => format!("{} (kv {})", model.backend_name(), other.name()),
    };
    let threads = if a.model.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { a.model.threads };

    let mut records = Vec::new();
    if a.output == BenchOutput::Md {
        println!("| model | size | params | backend | threads | test | t/s |");
        println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
    }
    for test in tests {
        run_once(&model, test)?; // warm-up: compiles the plans and faults in the weights
        let mut samples_ns = Vec::with_capacity(a.repetitions);
        for _ in 0..a.repetitions {
            samples_ns.push(run_once(&model, test)?);
        }
        let ns: Vec<f64> = samples_ns.iter().map(|&n| n as f64).collect();
        let ts: Vec<f64> = ns.iter().map(|&n| test.tokens() as f64 * 1e9 / n).collect();
        let ((avg_ns, stddev_ns), (avg_ts, stddev_ts)) = (mean_std(&ns), mean_std(&ts));
        match a.output {
            BenchOutput::Md => println!(
                "| {model_type} | {:.2} MiB | {:.2} M | {backend} | {threads} | {} | {avg_ts:.2} ± {stddev_ts:.2} |",
                model_size as f64 / (1u64 << 20) as f64,
                n_params as f64 / 1e6,
                test.name()
            ),
            BenchOutput::Json => records.push(json!({
                "build_commit": Value::Null,
                "build_number": Value::Null,
                "cpu_info": std::env::consts::ARCH,
                "backends": if backend.starts_with("cuda") { "CUDA" } else { "CPU" },
                "model_filename": model_filename,
                "model_type": model_type,
                "model_size": model_size,
                "model_n_params": n_params,
                "n_batch": a.model.batch_size,
                "n_ubatch": a.model.batch_size,
                "n_threads": threads,
                "kernels": if a.model.exact { "exact" } else { "fast" },
                "type_k": kv_type.name(),
                "type_v": kv_type.name(),
                "n_prompt": test.n_prompt,
                "n_gen": test.n_gen,
                "n_depth": test.depth,
                "n_seqs": test.seqs,
                "test_time": iso8601_now(),
                "avg_ns": avg_ns as u64,
                "stddev_ns": stddev_ns as u64,
                "avg_ts": avg_ts,
                "stddev_ts": stddev_ts,
                "samples_ns": samples_ns,
                "samples_ts": ts,
            })),
        }
    }
    if a.output == BenchOutput::Json {
        println!("{}", serde_json::to_string_pretty(&records)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_use_the_sample_deviation() {
        let (m, s) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        assert!((s - 2.138_089_935).abs() < 1e-6);
        assert_eq!(mean_std(&[3.0]), (3.0, 0.0));
    }

    #[test]
    fn test_names_follow_llama_bench() {
        assert_eq!(Test { n_prompt: 512, n_gen: 0, seqs: 1, depth: 0 }.name(), "pp512");
        assert_eq!(Test { n_prompt: 0, n_gen: 128, seqs: 1, depth: 0 }.name(), "tg128");
        assert_eq!(Test { n_prompt: 0, n_gen: 64, seqs: 8, depth: 0 }.name(), "tg64 x8");
        assert_eq!(Test { n_prompt: 0, n_gen: 32, seqs: 1, depth: 512 }.name(), "tg32 @ d512");
        assert_eq!(Test { n_prompt: 512, n_gen: 0, seqs: 1, depth: 4096 }.context_needed(), 4608);
        assert_eq!(Test { n_prompt: 0, n_gen: 64, seqs: 8, depth: 0 }.tokens(), 512);
    }

    #[test]
    fn prompt_tokens_stay_in_the_vocabulary() {
        for vocab in [50, 1001, 262_144] {
            let t = prompt_tokens(700, vocab);
            assert_eq!(t.len(), 700);
            assert!(t.iter().all(|&id| (id as usize) < vocab));
        }
    }

    #[test]
    fn timestamps_are_iso8601_utc() {
        let t = iso8601_now();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T", "{t}");
    }
}
