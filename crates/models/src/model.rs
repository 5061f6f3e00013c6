//! A loaded model and its inference sessions.

use std::path::Path;
use std::sync::{Arc, Mutex};

use kiln_gguf::GgufFile;
use kiln_ir::{Among, BucketPolicy, OutputMode};
use kiln_runtime::{
    all_finite, compile, Backend, CompileCache, DeviceWeights, DrawSpec, EngineConfig, Executable, HostData, HostTensor, KvCache, PlanKey,
    StepInputs, WeightStore,
};
use kiln_tokenizer::Tokenizer;

use crate::{architecture_from_gguf, Architecture, ModelError};

/// A model file loaded onto a backend: weights once per device, plans compiled per bucket.
pub struct Model {
    file: Arc<GgufFile>,
    arch: Box<dyn Architecture>,
    tokenizer: Tokenizer,
    store: Arc<WeightStore>,
    backend: Arc<dyn Backend>,
    weights: Arc<dyn DeviceWeights>,
    plans: Mutex<CompileCache>,
    policy: BucketPolicy,
    config: EngineConfig,
}

/// What one forward step hands back.
#[derive(Clone, Debug, PartialEq)]
pub enum StepOutput {
    /// Logits of the last new token ([vocab]).
    Logits(Vec<f32>),
    /// Logits of every new token (`rows` × `vocab`, row-major).
    AllLogits {
        /// Rows (new tokens).
        rows: usize,
        /// Logits, row-major.
        data: Vec<f32>,
    },
    /// The greedy next token after the last new token.
    Token(u32),
    /// The [`CANDIDATES`](kiln_ir::CANDIDATES) likeliest next tokens after the last new token (the
    /// whole vocabulary where it is smaller) and their logits, likeliest first (the lower id first
    /// among equal logits).
    Candidates(Vec<(u32, f32)>),
    /// Final-norm hidden state of the last new token.
    Hidden(Vec<f32>),
}

impl Model {
    /// Opens `path` and loads it onto `backend` with `config`.
    pub fn load(path: &Path, backend: Arc<dyn Backend>, config: EngineConfig) -> Result<Model, ModelError> {
        let file = Arc::new(GgufFile::open(path)?);
        let arch = architecture_from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        if tokenizer.vocab_size() > arch.vocab_size() {
            return Err(ModelError::Metadata(format!(
                "the tokenizer has {} tokens but the embedding only {} rows",
                tokenizer.vocab_size(),
                arch.vocab_size()
            )));
        }
        let context = match config.context {
            0 => arch.trained_context(),
            n => n.min(arch.trained_context()),
        };
        let store = Arc::new(WeightStore::new(file.clone())?);
        let weights = backend.load_weights(&store)?;
        let plans = Mutex::new(CompileCache::new(config.plan_cache_capacity));
        let config = EngineConfig { context, ..config };
        Ok(Model { file, arch, tokenizer, store, backend, weights, plans, policy: BucketPolicy::new(context), config })
    }

    /// The tokenizer built from the file's metadata.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The architecture (hyperparameters and graph builder).
    pub fn architecture(&self) -> &dyn Architecture {
        self.arch.as_ref()
    }

    /// The model file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The context size in use.
    pub fn context(&self) -> usize {
        self.config.context
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// Plans compiled so far (compile-cache misses).
    pub fn plans_compiled(&self) -> u64 {
        self.plans.lock().map(|c| c.compiles()).unwrap_or(0)
    }

    /// Most prompt rows one step processes (the engine's `max_prefill_rows`).
    pub fn max_step_rows(&self) -> usize {
        self.config.max_prefill_rows.max(1)
    }

    /// A new, empty sequence.
    pub fn new_session(&self) -> Result<Session<'_>, ModelError> {
        let kv = self.backend.new_kv_cache(&self.arch.kv_layout(self.config.context, self.config.kv_type))?;
        Ok(Session { model: self, kv })
    }

    /// Decodes one token for each session in one batched step (the weights are read once for all
    /// of them): `tokens[i]` is appended to `sessions[i]`. See [`Model::forward_batch`].
    pub fn decode_batch(
        &self,
        sessions: &mut [&mut Session<'_>],
        tokens: &[u32],
        mode: OutputMode,
        draws: &[DrawSpec],
    ) -> Result<Vec<Result<StepOutput, ModelError>>, ModelError> {
        let chunks: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
        self.forward_batch(sessions, &chunks, mode, draws)
    }

    /// Appends `chunks[i]` to `sessions[i]` for every session in one step (the weights are read
    /// once for all of them): one new token each runs a batched decode plan, longer chunks a
    /// prefill plan over all their rows. Each session attends to its own KV cache at its own
    /// positions. Returns each session's output for `mode` (`Logits`, `Candidates`, `NextToken`
    /// or `Drawn`, for its last new token; `draws[i]` is session i's draw where `mode` is `Drawn`,
    /// and a step that the backend cannot draw returns the candidates or logits to draw from, as
    /// [`Session::forward_with`]); a non-finite row is an error for its session only. Fewer
    /// sessions than the backend batches from ([`kiln_runtime::Backend::batches_from`]) run one
    /// after another.
    pub fn forward_batch(
        &self,
        sessions: &mut [&mut Session<'_>],
        chunks: &[&[u32]],
        mode: OutputMode,
        draws: &[DrawSpec],
    ) -> Result<Vec<Result<StepOutput, ModelError>>, ModelError> {
        if matches!(mode, OutputMode::Drawn(_)) && draws.len() != sessions.len() {
            return Err(ModelError::InvalidParameter(format!("{} draws for {} sequences", draws.len(), sessions.len())));
        }
        if sessions.is_empty() || sessions.len() != chunks.len() || chunks.iter().any(|c| c.is_empty()) {
            let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
            return Err(ModelError::InvalidParameter(format!(
                "{} token chunks (lengths {lens:?}) for {} sequences",
                chunks.len(),
                sessions.len()
            )));
        }
        if !matches!(mode, OutputMode::Logits | OutputMode::NextToken | OutputMode::Candidates | OutputMode::Drawn(_)) {
            return Err(ModelError::InvalidParameter(format!("a batched step produces logits, candidates or tokens, not {mode:?}")));
        }
        let vocab = self.arch.vocab_size();
        if let Some(&bad) = chunks.iter().flat_map(|c| c.iter()).find(|&&t| t as usize >= vocab) {
            return Err(kiln_runtime::RuntimeError::TokenOutOfRange { id: bad, vocab }.into());
        }
        if let Some(needed) = sessions.iter().zip(chunks).map(|(s, c)| s.position() + c.len()).max().filter(|&n| n > self.context()) {
            return Err(ModelError::ContextOverflow { needed, context: self.context() });
        }
        let rows: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let total: usize = rows.iter().sum();
        let decode = rows.iter().all(|&r| r == 1);
        if !decode && total > self.config.max_prefill_rows.max(1) {
            return Err(ModelError::InvalidParameter(format!(
                "{total} prompt tokens in one batched step; at most {} fit",
                self.config.max_prefill_rows
            )));
        }
        if sessions.len() < self.backend.batches_from() {
            return Ok(sessions.iter_mut().zip(chunks).enumerate().map(|(i, (s, c))| s.forward_with(c, mode, draws.get(i))).collect());
        }
        // Position of each session's last new token.
        let positions: Vec<usize> = sessions.iter().zip(&rows).map(|(s, r)| s.position() + r - 1).collect();
        let max_past = sessions.iter().map(|s| s.position()).max().unwrap_or(0);
        let bucket =
            if decode { self.policy.decode_batch(max_past, sessions.len()) } else { self.policy.prefill_batch(total, sessions.len()) };
        let tokens: Vec<u32> = chunks.concat();
        let mut kvs: Vec<&mut dyn KvCache> = sessions.iter_mut().map(|s| s.kv.as_mut() as &mut dyn KvCache).collect();
        let plan_mode = self.plan_mode(mode);
        let draws = if matches!(plan_mode, OutputMode::Drawn(_)) { draws } else { &[] };
        let out = self.with_plan(PlanKey { mode: plan_mode, bucket }, |exec| Ok(exec.run_batch(&tokens, &rows, &mut kvs, draws)?))?;
        let t = out.into_iter().next().ok_or_else(|| ModelError::Metadata("plan produced no output".into()))?;
        let width = t.shape[1];
        let row_result = |i: usize| -> Result<StepOutput, ModelError> {
            let position = positions[i];
            match &t.data {
                HostData::I32(v) => match v.get(i) {
                    Some(&id) if id >= 0 => Ok(StepOutput::Token(id as u32)),
                    _ => Err(ModelError::NonFinite { position }),
                },
                HostData::F32(v) => {
                    let row = &v[i * width..(i + 1) * width];
                    if !all_finite(row) {
                        Err(ModelError::NonFinite { position })
                    } else {
                        Ok(float_output(mode, plan_mode, row.to_vec()))
                    }
                }
            }
        };
        Ok((0..sessions.len()).map(row_result).collect())
    }

    /// Runs `f` on the executable for `key`, compiling it on a compile-cache miss.
    fn with_plan<T>(&self, key: PlanKey, f: impl FnOnce(&mut dyn Executable) -> Result<T, ModelError>) -> Result<T, ModelError> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let exec = plans.get_or_compile(key, || {
            let graph = self.arch.build_graph(key.bucket, key.mode).map_err(|e| kiln_runtime::RuntimeError::Compile(e.to_string()))?;
            let plan = Arc::new(compile(&graph, &self.store)?);
            tracing::debug!(?key, steps = plan.steps.len(), arena_mb = plan.arena_words * 4 / (1 << 20), "compiled plan");
            self.backend.prepare(plan, &self.weights)
        })?;
        f(exec)
    }

    /// The output mode of the plan that serves `mode`: where the backend does not draw, what the
    /// host draws from (the candidates, or the logits); the logits for the candidates where the
    /// backend has no top-k head (the candidates are then taken from them on the host).
    fn plan_mode(&self, mode: OutputMode) -> OutputMode {
        let vocab = self.arch.vocab_size();
        match mode {
            OutputMode::Drawn(among) if !self.backend.draws(among, vocab) => match among {
                Among::Candidates => self.plan_mode(OutputMode::Candidates),
                Among::Vocabulary => OutputMode::Logits,
            },
            OutputMode::Candidates if !self.backend.takes_candidates(vocab) => OutputMode::Logits,
            m => m,
        }
    }

    /// Runs one step of at most one bucket's rows through the cached plan for it.
    fn run_step(
        &self,
        kv: &mut dyn KvCache,
        tokens: &[u32],
        mode: OutputMode,
        draw: Option<&DrawSpec>,
    ) -> Result<Vec<HostTensor>, ModelError> {
        let start = kv.len();
        let bucket = if tokens.len() == 1 { self.policy.decode(start) } else { self.policy.prefill(tokens.len()) };
        let key = PlanKey { mode, bucket };
        let draw = draw.filter(|_| matches!(mode, OutputMode::Drawn(_)));
        self.with_plan(key, |exec| Ok(exec.run(StepInputs { tokens, start_pos: start, draw }, kv)?))
    }
}

/// One sequence: its KV cache and position.
pub struct Session<'m> {
    model: &'m Model,
    kv: Box<dyn KvCache>,
}

impl<'m> Session<'m> {
    /// The model this session runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Tokens processed so far (the next token's position).
    pub fn position(&self) -> usize {
        self.kv.len()
    }

    /// Forgets the sequence.
    pub fn reset(&mut self) {
        self.kv.clear();
    }

    /// Bytes held by the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Appends `tokens` to the sequence and returns `mode`'s output for them. One path serves
    /// prefill (many tokens, run in chunks of at most one bucket) and decode (one token).
    /// [`OutputMode::Drawn`] needs [`forward_with`](Session::forward_with).
    pub fn forward(&mut self, tokens: &[u32], mode: OutputMode) -> Result<StepOutput, ModelError> {
        self.forward_with(tokens, mode, None)
    }

    /// [`forward`](Session::forward) with the sequence's `draw` where `mode` draws the next token
    /// ([`OutputMode::Drawn`]: a [`StepOutput::Token`]). Where the backend does not draw
    /// ([`kiln_runtime::Backend::draws`]), the step returns what the host draws from instead: the
    /// candidates, or the logits.
    pub fn forward_with(&mut self, tokens: &[u32], mode: OutputMode, draw: Option<&DrawSpec>) -> Result<StepOutput, ModelError> {
        if matches!(mode, OutputMode::Drawn(_)) && draw.is_none() {
            return Err(ModelError::InvalidParameter("a drawn step needs the sequence's draw".into()));
        }
        let model = self.model;
        let start = self.kv.len();
        if tokens.is_empty() {
            return Err(ModelError::InvalidParameter("no tokens to process".into()));
        }
        let needed = start + tokens.len();
        if needed > model.context() {
            return Err(ModelError::ContextOverflow { needed, context: model.context() });
        }
        let vocab = model.arch.vocab_size();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(kiln_runtime::RuntimeError::TokenOutOfRange { id: bad, vocab }.into());
        }
        let chunk = if mode == OutputMode::AllLogits { model.config.max_logit_rows } else { model.config.max_prefill_rows }.max(1);
        let mut all = Vec::new();
        let mut last = None;
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let final_chunk = (i + 1) * chunk >= tokens.len();
            // Chunks before the last only fill the KV cache: run them for the cheapest output.
            let step_mode = if final_chunk || mode == OutputMode::AllLogits { mode } else { OutputMode::Hidden };
            let out = model.run_step(self.kv.as_mut(), part, model.plan_mode(step_mode), draw)?;
            let t = out.into_iter().next().ok_or_else(|| ModelError::Metadata("plan produced no output".into()))?;
            if mode == OutputMode::AllLogits {
                check_finite(&t, self.kv.len() - part.len())?;
                if let HostData::F32(v) = t.data {
                    all.extend_from_slice(&v);
                }
            } else if final_chunk {
                last = Some(t);
            }
        }
        let pos = self.kv.len() - 1;
        match mode {
            OutputMode::AllLogits => Ok(StepOutput::AllLogits { rows: tokens.len(), data: all }),
            _ => {
                let t = last.ok_or_else(|| ModelError::Metadata("plan produced no output".into()))?;
                check_finite(&t, pos)?;
                match (mode, t.data) {
                    (OutputMode::NextToken | OutputMode::Drawn(_), HostData::I32(v)) => match v.first() {
                        Some(&id) if id >= 0 => Ok(StepOutput::Token(id as u32)),
                        _ => Err(ModelError::NonFinite { position: pos }),
                    },
                    (OutputMode::Hidden, HostData::F32(v)) => Ok(StepOutput::Hidden(v)),
                    (OutputMode::Logits | OutputMode::Candidates | OutputMode::Drawn(_), HostData::F32(v)) => {
                        Ok(float_output(mode, model.plan_mode(mode), v))
                    }
                    _ => Err(ModelError::Metadata("plan output has the wrong type".into())),
                }
            }
        }
    }
}

/// The step output for `mode` of a float row (finite) of a `plan_mode` plan: the candidates
/// where `mode` asks for them or draws among them (taken from the logits where the plan has no
/// top-k head), else the logits.
fn float_output(mode: OutputMode, plan_mode: OutputMode, row: Vec<f32>) -> StepOutput {
    if mode == OutputMode::Candidates || (mode == OutputMode::Drawn(Among::Candidates) && plan_mode == OutputMode::Candidates) {
        StepOutput::Candidates(candidates(plan_mode, &row))
    } else {
        StepOutput::Logits(row)
    }
}

/// A row of a `plan_mode` plan (finite) as the candidates (id, logit): a top-k head's (values, then
/// their ids as f32: `kiln_ir::Op::TopK`), or, from logits, their
/// [`CANDIDATES`](kiln_ir::CANDIDATES) largest as a top-k head gives them (largest first, the lower
/// id first among equals).
fn candidates(plan_mode: OutputMode, row: &[f32]) -> Vec<(u32, f32)> {
    if plan_mode == OutputMode::Candidates {
        let (values, ids) = row.split_at(row.len() / 2);
        ids.iter().zip(values).map(|(&id, &v)| (id as u32, v)).collect()
    } else {
        crate::sampling::top_ids(row, kiln_ir::CANDIDATES).into_iter().map(|id| (id, row[id as usize])).collect()
    }
}

/// Rejects NaN or infinity in float outputs (`first_pos`: position of the output's first row).
fn check_finite(t: &HostTensor, first_pos: usize) -> Result<(), ModelError> {
    if let HostData::F32(v) = &t.data {
        if all_finite(v) {
            return Ok(());
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            let row = i / t.shape[1].max(1);
            return Err(ModelError::NonFinite { position: first_pos + row });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_finite_finds_every_non_finite_value() {
        let v: Vec<f32> = (0..10_000).map(|i| (i as f32 * 0.37).sin() * 1e30).collect();
        assert!(all_finite(&v));
        assert!(all_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE, 1e-45, -0.0]));
        assert!(all_finite(&[]));
        // In the first chunk, at a chunk's edge and in the short last chunk.
        for at in [0, 4095, 4096, 9_999] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut w = v.clone();
                w[at] = bad;
                assert!(!all_finite(&w), "{bad} at {at}");
                let t = HostTensor { name: "logits".into(), shape: [4, 2_500], data: HostData::F32(w) };
                assert!(matches!(check_finite(&t, 7), Err(ModelError::NonFinite { position }) if position == 7 + at / 2_500));
            }
        }
    }
}
