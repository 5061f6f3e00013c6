//! Command-line flags. Every engine setting comes from here into one [`EngineConfig`].

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kiln_runtime::{EngineConfig, KernelPrecision, KvType};

/// kiln: run quantized language models from GGUF files.
#[derive(Parser, Debug)]
#[command(version, about)]
pub struct Cli {
    /// More log output on stderr (-v info, -vv debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a continuation of a prompt, streamed to stdout (timings go to stderr).
    Run(RunArgs),
    /// Chat interactively: one user turn per line of stdin, the model's answer streamed back.
    Chat(ChatArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(TokenizeArgs),
    /// Perplexity of a text file (llama-perplexity style).
    Perplexity(PerplexityArgs),
    /// Print a GGUF file's metadata and a tensor summary.
    Info(InfoArgs),
    /// Download the default model into the cache and print its path.
    Pull,
    /// Measure prompt processing and token generation speed (llama-bench style).
    Bench(BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API, batching concurrent requests.
    Serve(ServeArgs),
    /// Write a random-weight Gemma 3, Llama or Qwen GGUF of a released shape (speed measurements without weights).
    Synth(SynthArgs),
}

/// `kiln synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Shape of a released model: Gemma 3 270m, 1b, 4b, 12b or 27b; llama3.2-1b, llama3.2-3b,
    /// llama3.1-8b, llama3.1-70b; qwen2.5-0.5b, qwen2.5-7b; qwen3-0.6b, qwen3-8b.
    #[arg(long, default_value = "270m")]
    pub preset: String,
    /// Block formats: `q4_k_m` (a Q4_K_M-like mix) or one format for every matrix (`q8_0`, `q4_k`, ...).
    #[arg(long, default_value = "q4_k_m")]
    pub formats: String,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output file.
    #[arg(short, long)]
    pub output: PathBuf,
}

/// Which model and how to run it.
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// GGUF model file (default: Gemma 3 270M Q4_K_M, downloaded on first use).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// CPU threads (0: one per core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// Context size in tokens (0: the model's trained context).
    #[arg(short = 'c', long, default_value_t = EngineConfig::default().context)]
    pub context: usize,
    /// Most tokens per prefill step (longer prompts run in chunks).
    #[arg(long, default_value_t = EngineConfig::default().max_prefill_rows)]
    pub batch_size: usize,
    /// Run the exact (reference) kernels: weights dequantized to f32, f32 activations; slower.
    #[arg(long)]
    pub exact: bool,
    /// KV cache element type: `f32` (the reference's numerics) or `f16` (half the cache's memory
    /// and reads, as llama.cpp's default; keys and values rounded to 11 significant bits).
    #[arg(long, default_value = "f32", value_parser = parse_kv_type)]
    pub kv_type: KvType,
    /// Device: `cpu`, `cuda` or `cuda:N` (needs a build with the `cuda` feature), or `auto` (CUDA
    /// when built in and a GPU is present, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
}

/// Where a model runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
    /// CUDA device 0 when available, else the CPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(DeviceChoice::Auto),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("unknown device '{s}' (expected cpu, cuda, cuda:N or auto)")),
        }
    }
}

/// `--kv-type`.
fn parse_kv_type(s: &str) -> Result<KvType, String> {
    [KvType::F32, KvType::F16]
        .into_iter()
        .find(|t| t.name() == s)
        .ok_or_else(|| format!("unknown KV cache type '{s}' (expected f32 or f16)"))
}

impl ModelArgs {
    /// The engine configuration these flags describe.
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            threads: self.threads,
            context: self.context,
            max_prefill_rows: self.batch_size.max(1),
            kernels: if self.exact { KernelPrecision::Exact } else { KernelPrecision::Fast },
            kv_type: self.kv_type,
            ..EngineConfig::default()
        }
    }
}

/// How tokens are chosen (llama.cpp's defaults).
#[derive(Args, Debug)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Top-k sampling (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (nucleus) sampling (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p sampling (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed (default: from the clock; printed on stderr).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the text contains this string (may be repeated).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Add BIAS to token ID's logit before sampling (may be repeated; -100 all but bans the
    /// token; `kiln tokenize` gives ids).
    #[arg(long, value_name = "ID=BIAS", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Generate one JSON object: each token must continue valid JSON, and generation ends when
    /// the object closes.
    #[arg(long)]
    pub json: bool,
}

/// One `--logit-bias` value: `ID=BIAS`.
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s.split_once('=').ok_or_else(|| format!("expected ID=BIAS (e.g. 1234=-100), got '{s}'"))?;
    let id = id.trim().parse().map_err(|_| format!("the token id '{id}' is not a non-negative integer"))?;
    let bias: f32 = bias.trim().parse().map_err(|_| format!("the bias '{bias}' is not a number"))?;
    if !bias.is_finite() {
        return Err(format!("the bias must be finite, got {bias}"));
    }
    Ok((id, bias))
}

/// `kiln run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sampling.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Wrap the prompt in the model's chat turn format.
    #[arg(long)]
    pub chat: bool,
    /// The prompt.
    pub prompt: String,
}

/// `kiln chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sampling (`-n` bounds each answer).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system prompt, put before the first user turn.
    #[arg(long)]
    pub system: Option<String>,
}

/// `kiln tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// GGUF model file (default: the default model).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// The text.
    pub text: String,
}

/// `kiln perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(short, long)]
    pub file: PathBuf,
    /// Print JSON with every token's log-likelihood.
    #[arg(long)]
    pub json: bool,
}

/// `kiln info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    /// GGUF file (default: the default model).
    pub file: Option<PathBuf>,
    /// Array elements shown per metadata array.
    #[arg(long, default_value_t = 8)]
    pub array_items: usize,
}

/// `kiln bench` output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchOutput {
    /// A markdown table.
    Md,
    /// A JSON array of records with llama-bench's field names.
    Json,
}

/// `kiln bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to process (comma-separated; 0 skips prompt processing).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    pub n_prompt: Vec<usize>,
    /// Token counts to generate (comma-separated; 0 skips generation).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    pub n_gen: Vec<usize>,
    /// Parallel sequences for generation (comma-separated): `tg N` with S > 1 decodes S sequences
    /// together, one batched step per token, and reports their aggregate tokens/s.
    #[arg(short = 's', long = "seqs", value_delimiter = ',', default_value = "1")]
    pub seqs: Vec<usize>,
    /// Tokens already in the context before each test (comma-separated, as llama-bench's
    /// `-d`): each sequence first processes that many prompt tokens, untimed.
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    pub n_depth: Vec<usize>,
    /// Repetitions of each test (after one warm-up run).
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repetitions: usize,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = BenchOutput::Md)]
    pub output: BenchOutput,
}

/// `kiln serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most requests generated at once (their decode steps run as one batch).
    #[arg(long, default_value_t = 16)]
    pub parallel: usize,
    /// Most requests waiting for a free slot; more are answered 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Most prompt tokens prefilled in one step while sequences are decoding (keeps running streams flowing).
    #[arg(long, default_value_t = 64)]
    pub prefill_chunk: usize,
    /// Compiled plans kept (prefill chunks and batched decode buckets).
    #[arg(long, default_value_t = 64)]
    pub plan_cache: usize,
    /// The model id clients use (default: the model file's name without extension).
    #[arg(long)]
    pub model_id: Option<String>,
}
