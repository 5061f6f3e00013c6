//! What each subcommand does.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use kiln_cpu::CpuBackend;
use kiln_gguf::GgufFile;
use kiln_models::{
    generate, GenerateParams, Generation, Model, OutputFormat, OutputMode, SamplingParams, Session, StepOutput, TextControl,
};
use kiln_runtime::Backend;
use kiln_tokenizer::{ChatMessage, ChatTemplate, Conversation, Tokenizer, TurnPrompt};
use serde_json::json;

use crate::cli::{
    ChatArgs, Command, DeviceChoice, InfoArgs, ModelArgs, PerplexityArgs, RunArgs, SamplingArgs, ServeArgs, SynthArgs, TokenizeArgs,
};

/// Runs one subcommand.
pub fn dispatch(cmd: Command) -> Result<()> {
    match cmd {
        Command::Run(a) => run(a),
        Command::Chat(a) => chat(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Perplexity(a) => perplexity(a),
        Command::Info(a) => info(a),
        Command::Bench(a) => crate::bench::bench(a),
        Command::Synth(a) => synth(a),
        Command::Serve(a) => serve(a),
        Command::Pull => {
            println!("{}", default_model()?.display());
            Ok(())
        }
    }
}

fn default_model() -> Result<PathBuf> {
    kiln_hub::ensure_default_model().context("fetching the default model (pass --model FILE to use a local one)")
}

fn model_path(p: &Option<PathBuf>) -> Result<PathBuf> {
    match p {
        Some(p) => Ok(p.clone()),
        None => default_model(),
    }
}

/// Loads the model the flags name on the backend they describe.
pub fn load(args: &ModelArgs) -> Result<Model> {
    load_with(args, args.config())
}

/// Loads the model with `config` (the one place a backend is built).
fn load_with(args: &ModelArgs, config: kiln_runtime::EngineConfig) -> Result<Model> {
    let path = model_path(&args.model)?;
    let backend = backend(args.device, &config)?;
    tracing::info!("device: {}", backend.name());
    Model::load(&path, backend, config).with_context(|| format!("loading {}", path.display()))
}

/// The backend `--device` asks for. Only the CPU has the exact kernels: `--exact` makes `auto` the
/// CPU and `cuda` an error (the CUDA products always take 16-bit integer activations).
pub(crate) fn backend(device: DeviceChoice, config: &kiln_runtime::EngineConfig) -> Result<Arc<dyn Backend>> {
    let exact = config.kernels == kiln_runtime::KernelPrecision::Exact;
    if exact && config.kv_type != kiln_runtime::KvType::F32 {
        bail!("--exact with --kv-type {}: the exact kernels keep the reference's f32 KV cache; drop one of the two", config.kv_type.name());
    }
    match device {
        DeviceChoice::Cpu => Ok(Arc::new(CpuBackend::from_config(config))),
        DeviceChoice::Cuda(n) if exact => {
            bail!("--exact with --device cuda:{n}: the CUDA backend has no exact kernels (its products take 16-bit integer activations); run the exact kernels with --device cpu")
        }
        DeviceChoice::Cuda(n) => cuda_backend(n),
        DeviceChoice::Auto if cuda_available() && !exact => cuda_backend(0),
        DeviceChoice::Auto => Ok(Arc::new(CpuBackend::from_config(config))),
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(ordinal: usize) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(kiln_cuda::CudaBackend::new(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(ordinal: usize) -> Result<Arc<dyn Backend>> {
    bail!("--device cuda:{ordinal}: this kiln was built without CUDA support (rebuild with `--features cuda`)")
}

#[cfg(feature = "cuda")]
fn cuda_available() -> bool {
    kiln_cuda::CudaBackend::available()
}

#[cfg(not(feature = "cuda"))]
fn cuda_available() -> bool {
    false
}

impl SamplingArgs {
    /// Generation parameters from the flags (a clock seed when none is given).
    fn params(&self) -> GenerateParams {
        let seed = self
            .seed
            .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
        GenerateParams {
            max_tokens: self.max_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repeat_penalty,
                seed,
                logit_bias: self.logit_bias.clone(),
                ..SamplingParams::default()
            },
            stop: self.stop.clone(),
            format: if self.json { OutputFormat::JsonObject } else { OutputFormat::Text },
        }
    }
}

/// Generates from `prompt` in `session`, streaming text to stdout; returns `None` when stdout
/// was closed (e.g. piped into `head`).
fn stream_to_stdout(session: &mut Session<'_>, prompt: &[u32], params: &GenerateParams) -> Result<Option<Generation>> {
    let mut stdout = std::io::stdout().lock();
    let mut closed = false;
    let result = generate(session, prompt, params, &mut |piece| {
        if stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()).is_err() {
            closed = true;
            return TextControl::Stop;
        }
        TextControl::Continue
    })?;
    if closed || writeln!(stdout).is_err() {
        return Ok(None);
    }
    Ok(Some(result))
}

/// Prints the timing line of one generation on stderr. The generation rate counts the tokens
/// after the first (which the prompt's step gives), so it is left out for fewer than two.
fn report(model: &Model, result: &Generation, seed: u64) {
    let n = result.tokens.len();
    let generation = match n {
        0 | 1 => format!("{n} token{}", if n == 1 { "" } else { "s" }),
        _ => format!("{n} tokens, {:.1} tok/s", (n - 1) as f64 / result.decode_secs.max(1e-9)),
    };
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {generation} | finish: {:?} | seed {} | {}",
        result.prompt_tokens,
        result.prompt_tokens as f64 / result.prefill_secs.max(1e-9),
        result.finish,
        seed,
        model.backend_name(),
    );
}

fn run(a: RunArgs) -> Result<()> {
    let model = load(&a.model)?;
    let tok = model.tokenizer();
    let prompt = if a.chat {
        ChatTemplate::from_gguf(model.file(), tok)?.encode(tok, &[ChatMessage::new("user", a.prompt.as_str())], true)?
    } else {
        tok.encode(&a.prompt)
    };
    let params = a.sampling.params();
    let mut session = model.new_session()?;
    if let Some(result) = stream_to_stdout(&mut session, &prompt, &params)? {
        report(&model, &result, params.sampling.seed);
    }
    tracing::info!(kv_cache_kib = session.kv_bytes() / 1024, plans = model.plans_compiled(), "session done");
    Ok(())
}

fn chat(a: ChatArgs) -> Result<()> {
    let model = load(&a.model)?;
    let tok = model.tokenizer();
    let mut params = a.sampling.params();
    let mut session = model.new_session()?;
    let mut conversation = Conversation::new(ChatTemplate::from_gguf(model.file(), tok)?, a.system.clone());
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        line.clear();
        if stdin.read_line(&mut line)? == 0 {
            eprintln!();
            return Ok(());
        }
        let user = line.trim();
        if user.is_empty() {
            continue;
        }
        // The KV cache keeps the conversation: a turn appends only what follows it. A turn that
        // would leave less than `reply_room` tokens of the context for the reply forgets the
        // oldest exchanges first (the system message stays).
        let before_turn = conversation.clone();
        let mut turn = conversation.user_turn(tok, user)?;
        let reply_room = params.max_tokens.clamp(1, (model.context() / 2).max(1));
        let end = |t: &TurnPrompt| match t {
            TurnPrompt::Continue(ids) => session.position() + ids.len(),
            TurnPrompt::Whole(ids) => ids.len(),
        };
        let mut forgotten = 0;
        while end(&turn) + reply_room > model.context() {
            match conversation.forget_oldest_exchange(tok)? {
                Some(t) => {
                    turn = t;
                    forgotten += 1;
                }
                None => break,
            }
        }
        if end(&turn) >= model.context() {
            // Not even alone: the conversation stays as it was.
            conversation = before_turn;
            eprintln!(
                "error: this message takes {} tokens, which leave no room for a reply in the context of {}; send a shorter one or restart with a larger --context",
                end(&turn),
                model.context()
            );
            continue;
        }
        if forgotten > 0 {
            eprintln!(
                "(the conversation outgrew the context of {} tokens: its oldest {forgotten} exchange(s) are forgotten)",
                model.context()
            );
        }
        let prompt = match turn {
            TurnPrompt::Continue(ids) => ids,
            TurnPrompt::Whole(ids) => {
                session.reset();
                ids
            }
        };
        let before = session.position();
        match stream_to_stdout(&mut session, &prompt, &params)? {
            Some(result) => {
                let fed = session.position() - before - prompt.len();
                conversation.reply(tok, &result.text, &result.tokens[..fed]);
                report(&model, &result, params.sampling.seed);
            }
            None => return Ok(()),
        }
        params.sampling.seed = params.sampling.seed.wrapping_add(1);
    }
}

fn tokenize(a: TokenizeArgs) -> Result<()> {
    let path = model_path(&a.model)?;
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let tok = Tokenizer::from_gguf(&file)?;
    println!("{}", serde_json::to_string(&tok.encode(&a.text))?);
    Ok(())
}

/// Log-probability of `target` under `logits`, in f64.
fn log_prob(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits[target as usize] as f64 - lse
}

fn perplexity(a: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let model = load(&a.model)?;
    let tok = model.tokenizer();
    let ids = tok.encode(&text);
    if ids.len() < 2 {
        bail!("{} has fewer than 2 tokens; nothing to score", a.file.display());
    }
    let ctx = model.context();
    let vocab = model.architecture().vocab_size();
    // One window when the text fits; otherwise llama-perplexity's scheme: windows of the context
    // size, each scoring its second half.
    let windows: Vec<(usize, usize, usize)> =
        if ids.len() <= ctx { vec![(0, ids.len(), 1)] } else { (0..ids.len() / ctx).map(|w| (w * ctx, (w + 1) * ctx, ctx / 2)).collect() };
    let mut scored = Vec::new();
    let mut session = model.new_session()?;
    let t0 = std::time::Instant::now();
    for (start, end, first) in windows {
        session.reset();
        let StepOutput::AllLogits { data, .. } = session.forward(&ids[start..end], OutputMode::AllLogits)? else {
            bail!("the model returned no logits");
        };
        for i in first..end - start {
            let target = ids[start + i];
            let lp = log_prob(&data[(i - 1) * vocab..i * vocab], target);
            scored.push((start + i, target, lp));
        }
    }
    let nll_mean = -scored.iter().map(|s| s.2).sum::<f64>() / scored.len() as f64;
    let ppl = nll_mean.exp();
    if a.json {
        let tokens: Vec<_> =
            scored.iter().map(|&(pos, id, lp)| json!({"pos": pos, "id": id, "piece": tok.piece(id), "logprob": lp})).collect();
        let out = json!({"perplexity": ppl, "nll_mean": nll_mean, "n_tokens": ids.len(), "n_scored": scored.len(), "tokens": tokens});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("perplexity: {ppl:.4} ({} tokens scored, mean NLL {nll_mean:.4})", scored.len());
    }
    eprintln!("{:.1} tokens/s", ids.len() as f64 / t0.elapsed().as_secs_f64());
    Ok(())
}

fn info(a: InfoArgs) -> Result<()> {
    let path = match &a.file {
        Some(p) => p.clone(),
        None => default_model()?,
    };
    print_info(&path, a.array_items)
}

fn print_info(path: &Path, items: usize) -> Result<()> {
    let f = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    println!("file: {}", path.display());
    println!(
        "gguf version {}, alignment {}, {} metadata keys, {} tensors",
        f.version(),
        f.alignment(),
        f.metadata().len(),
        f.tensors().len()
    );
    println!("\nmetadata:");
    for (k, v) in f.metadata() {
        println!("  {k} = {}", v.summary(items));
    }
    let mut by_type: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
    for t in f.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.n_bytes;
    }
    println!("\ntensors by type:");
    println!("  {:<8} {:>7} {:>16} {:>12}", "type", "count", "elements", "MiB");
    let (mut n, mut el, mut by) = (0, 0, 0);
    for (ty, (c, e, b)) in &by_type {
        println!("  {ty:<8} {c:>7} {e:>16} {:>12.2}", *b as f64 / (1 << 20) as f64);
        (n, el, by) = (n + c, el + e, by + b);
    }
    println!("  {:<8} {n:>7} {el:>16} {:>12.2}", "total", by as f64 / (1 << 20) as f64);
    Ok(())
}

fn synth(a: SynthArgs) -> Result<()> {
    use kiln_models::synth::{FormatMix, Preset};
    let Some(preset) = Preset::named(&a.preset) else {
        bail!("unknown preset '{}' (expected one of {})", a.preset, Preset::NAMES.join(", "));
    };
    let Some(mix) = FormatMix::parse(&a.formats) else {
        let names: Vec<String> = FormatMix::single_formats().map(|t| t.name().to_ascii_lowercase()).collect();
        bail!("unknown formats '{}' (expected q4_k_m or one of {})", a.formats, names.join(", "));
    };
    let t = std::time::Instant::now();
    let model = preset.model(mix, a.seed);
    model.write(&a.output).with_context(|| format!("writing {}", a.output.display()))?;
    eprintln!(
        "wrote {} ({} {}, {:.2} GB of weights) in {:.1} s",
        a.output.display(),
        a.preset,
        preset.arch(),
        model.tensor_bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn serve(a: ServeArgs) -> Result<()> {
    let path = model_path(&a.model.model)?;
    let model = load_with(&a.model, kiln_runtime::EngineConfig { plan_cache_capacity: a.plan_cache.max(1), ..a.model.config() })?;
    let model_id =
        a.model_id.clone().unwrap_or_else(|| path.file_stem().map_or_else(|| "kiln".to_string(), |s| s.to_string_lossy().into_owned()));
    let config = kiln_server::ServerConfig {
        host: a.host.clone(),
        port: a.port,
        parallel: a.parallel.max(1),
        queue: a.queue,
        prefill_chunk: a.prefill_chunk.max(1),
        model_id: model_id.clone(),
        ..kiln_server::ServerConfig::default()
    };
    let server = kiln_server::Server::start(model, config)?;
    eprintln!("kiln serve: model '{model_id}' on http://{} (Ctrl-C stops)", server.addr());
    server.wait()?;
    Ok(())
}
