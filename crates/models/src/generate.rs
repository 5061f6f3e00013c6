//! The generation loop: prefill, then one token at a time until a stop condition.

use std::time::Instant;

use kiln_ir::OutputMode;
use kiln_runtime::DrawSpec;
use kiln_tokenizer::{StreamDecoder, Tokenizer};

use crate::json::{JsonObjectPrefix, OutputFormat};
use crate::{sampling, ModelError, Sampler, SamplingParams, Session, StepOutput};

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// Generation stops when the text contains any of these (the stop string is not returned).
    pub stop: Vec<String>,
    /// What the text must be (any text, or one JSON object).
    pub format: OutputFormat,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The context is full.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
}

/// The streaming callback's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextControl {
    /// Keep generating.
    Continue,
    /// Stop now (cancellation).
    Stop,
}

/// The result of [`generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Generated token ids (end-of-generation token excluded).
    pub tokens: Vec<u32>,
    /// Generated text (stop string excluded).
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens processed.
    pub prompt_tokens: usize,
    /// Seconds spent on the prompt (through the first token's logits).
    pub prefill_secs: f64,
    /// Seconds spent generating after the first token.
    pub decode_secs: f64,
}

/// Text released to the caller, holding back what could still become a stop string.
struct StopFilter {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

impl StopFilter {
    /// Adds `piece`; returns the newly releasable text and whether a stop string was found.
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.text.push_str(piece);
        let found = self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| self.text[self.emitted..].find(s.as_str())).min();
        if let Some(at) = found {
            self.text.truncate(self.emitted + at);
            let out = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            return (out, true);
        }
        let tail = &self.text[self.emitted..];
        let held =
            tail.char_indices().map(|(i, _)| i).find(|&i| self.stops.iter().any(|s| s.starts_with(&tail[i..]))).unwrap_or(tail.len());
        let out = tail[..held].to_string();
        self.emitted += held;
        (out, false)
    }

    /// Releases whatever is held back.
    fn flush(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

/// Log-probabilities of one chosen token under the model's raw distribution (log-softmax of the
/// logits, before penalties and temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What one [`Generator::advance`] produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Advance {
    /// The token chosen from the step's output (may be an end-of-generation token).
    pub token: u32,
    /// Whether `token` is part of the generated text (false for end-of-generation, or when
    /// `max_tokens` was already reached).
    pub emitted: bool,
    /// Text released by this token (held-back text is released when generation ends).
    pub text: String,
    /// The token's log-probabilities, when they were asked for.
    pub logprob: Option<TokenLogprob>,
    /// Set when generation has ended; otherwise feed `token` to the next step.
    pub finish: Option<FinishReason>,
}

/// One sequence's generation state: sampler, incremental detokenizer, stop-string filter, stop
/// conditions. A driver runs the model steps ([`generate`] one sequence; a batching scheduler many
/// at once) and hands each step's output to [`Generator::advance`].
pub struct Generator {
    params: GenerateParams,
    logprobs: Option<usize>,
    sampler: Sampler,
    decoder: StreamDecoder,
    filter: StopFilter,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    /// The JSON read so far, when the text must be one JSON object.
    json: Option<JsonObjectPrefix>,
}

/// Candidates a constrained step tries, most likely first, before it checks every token.
const CONSTRAINED_TRIES: usize = 16;

impl Generator {
    /// Starts generating after `prompt`, checking the parameters; `logprobs` asks for each chosen
    /// token's log-probability and that many alternatives.
    pub fn new(params: GenerateParams, prompt: &[u32], logprobs: Option<usize>) -> Result<Self, ModelError> {
        let mut sampler = Sampler::new(params.sampling.clone())?;
        if prompt.is_empty() {
            return Err(ModelError::InvalidParameter("the prompt is empty".into()));
        }
        prompt.iter().for_each(|&t| sampler.observe(t));
        let filter = StopFilter { stops: params.stop.clone(), text: String::new(), emitted: 0 };
        let json = (params.format == OutputFormat::JsonObject).then(JsonObjectPrefix::new);
        Ok(Generator { params, logprobs, sampler, decoder: StreamDecoder::new(true), filter, tokens: Vec::new(), finish: None, json })
    }

    /// The step output this sequence needs: the in-graph greedy token when nothing else is
    /// wanted, the token drawn in the graph where the sampler's choice is a draw the graph makes
    /// as it would ([`Sampler::draws_among`]: top-k below 64 among the top-k head's candidates,
    /// or temperature alone among all logits; by [`Generator::draw`]), else the logits.
    pub fn mode(&self) -> OutputMode {
        let plain = self.logprobs.is_none() && self.json.is_none();
        match self.sampler.draws_among() {
            _ if !plain => OutputMode::Logits,
            _ if self.params.sampling.is_greedy() => OutputMode::NextToken,
            Some(among) => OutputMode::Drawn(among),
            None => OutputMode::Logits,
        }
    }

    /// The draw of this sequence's next step where [`mode`](Generator::mode) draws in the graph.
    pub fn draw(&self) -> Option<DrawSpec> {
        matches!(self.mode(), OutputMode::Drawn(_)).then(|| self.sampler.spec())
    }

    /// Generated tokens so far (end-of-generation token excluded).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The text generated so far, stop string excluded (some of it may still be held back).
    pub fn text(&self) -> &str {
        &self.filter.text
    }

    /// Why generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Ends generation at the caller's request; held-back text is dropped.
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
    }

    /// Takes the output of the step that processed the last fed token (the prompt, then each
    /// chosen token) in a sequence now holding `position` tokens of a `context`-token context,
    /// chooses the next token and applies the stop conditions.
    pub fn advance(&mut self, tok: &Tokenizer, out: StepOutput, position: usize, context: usize) -> Result<Advance, ModelError> {
        if self.finish.is_some() {
            return Err(ModelError::InvalidParameter("generation has already ended".into()));
        }
        let (token, logprob) = match out {
            StepOutput::Token(t) => {
                if matches!(self.mode(), OutputMode::Drawn(_)) {
                    // (The step drew with the sampler's state: the sampler steps past that draw.)
                    self.sampler.drew();
                }
                (t, None)
            }
            // (Taken only where the sampler chooses among them as it would from the logits.)
            StepOutput::Candidates(c) if self.mode() != OutputMode::Logits && self.sampler.chooses_among_candidates() => {
                (self.sampler.choose_among(&c), None)
            }
            StepOutput::Logits(mut l) => {
                let lp = self.logprobs.map(|n| logprobs_of(&l, n));
                let t = match &mut self.json {
                    Some(json) => {
                        let (t, next) = constrained_choice(&mut self.sampler, tok, json, &mut l)?;
                        *json = next;
                        t
                    }
                    None => self.sampler.sample(&mut l),
                };
                (t, lp.map(|f| f(t)))
            }
            StepOutput::Candidates(_) => {
                return Err(ModelError::InvalidParameter(
                    "this generation needs the logits (logprobs, JSON, a bias, penalties, top-k 0 or 64+)".into(),
                ))
            }
            _ => return Err(ModelError::InvalidParameter("generation needs a token, candidates or logits output".into())),
        };
        let mut adv = Advance { token, emitted: false, text: String::new(), logprob, finish: None };
        if self.tokens.len() >= self.params.max_tokens {
            return Ok(self.end(adv, FinishReason::Length));
        }
        if tok.is_end_of_generation(token) {
            return Ok(self.end(adv, FinishReason::Stop));
        }
        adv.emitted = true;
        self.tokens.push(token);
        self.sampler.observe(token);
        let (text, stopped) = self.filter.push(&self.decoder.push(tok, token));
        adv.text = text;
        if self.json.is_some_and(|json| json.is_complete()) {
            return Ok(self.end(adv, FinishReason::Stop));
        }
        if stopped {
            // Cut at a stop string: what was held back is part of the stop string, never released.
            self.finish = Some(FinishReason::Stop);
            adv.finish = self.finish;
            return Ok(adv);
        }
        if self.tokens.len() >= self.params.max_tokens {
            return Ok(self.end(adv, FinishReason::Length));
        }
        if position >= context {
            return Ok(self.end(adv, FinishReason::ContextFull));
        }
        Ok(adv)
    }

    /// Ends generation for `reason`, releasing what is still held back.
    fn end(&mut self, mut adv: Advance, reason: FinishReason) -> Advance {
        let (text, _) = self.filter.push(&self.decoder.finish());
        adv.text += &text;
        adv.text += &self.filter.flush();
        self.finish = Some(reason);
        adv.finish = self.finish;
        adv
    }
}

/// The next token under the JSON constraint and the JSON read with it: the sampler's choice
/// among the tokens that continue `json` (the most likely few are tried first; then every token
/// is checked).
fn constrained_choice(
    sampler: &mut Sampler,
    tok: &Tokenizer,
    json: &JsonObjectPrefix,
    logits: &mut [f32],
) -> Result<(u32, JsonObjectPrefix), ModelError> {
    let mut bytes = Vec::new();
    // The JSON read with token `id`, if it continues it.
    let mut continued = |id: u32| {
        // (No end-of-generation token before the object closes: it ends generation itself.)
        bytes.clear();
        tok.token_bytes(id, &mut bytes);
        let mut next = *json;
        (!bytes.is_empty() && next.feed_all(&bytes)).then_some(next)
    };
    sampler.adjust(logits);
    for _ in 0..CONSTRAINED_TRIES {
        let t = sampler.choose(logits);
        if let Some(next) = continued(t) {
            return Ok((t, next));
        }
        logits[t as usize] = f32::NEG_INFINITY;
    }
    let mut any = false;
    for (id, l) in logits.iter_mut().enumerate() {
        if *l != f32::NEG_INFINITY && continued(id as u32).is_none() {
            *l = f32::NEG_INFINITY;
        }
        any |= *l != f32::NEG_INFINITY;
    }
    if !any {
        return Err(ModelError::InvalidParameter("no token of the vocabulary continues the JSON text".into()));
    }
    let t = sampler.choose(logits);
    // (Every token left continues the JSON, and the sampler picks none at -inf while one is not.)
    let next = continued(t).ok_or_else(|| ModelError::InvalidParameter(format!("token {t} does not continue the JSON text")))?;
    Ok((t, next))
}

/// Log-softmax of `logits`: a function from the chosen token to its log-probability and the
/// `n` most likely tokens.
fn logprobs_of(logits: &[f32], n: usize) -> impl FnOnce(u32) -> TokenLogprob {
    let lse = sampling::log_sum_exp(logits);
    let top: Vec<(u32, f32)> = sampling::top_ids(logits, n).into_iter().map(|i| (i, (logits[i as usize] as f64 - lse) as f32)).collect();
    let all: Vec<f32> = logits.to_vec();
    move |t| TokenLogprob { logprob: all.get(t as usize).map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32), top }
}

/// Generates a continuation of `prompt` in `session`, streaming text to `on_text` as it is
/// produced (never half a UTF-8 character, never part of a stop string).
pub fn generate(
    session: &mut Session<'_>,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> TextControl,
) -> Result<Generation, ModelError> {
    let mut gen = Generator::new(params.clone(), prompt, None)?;
    let model = session.model();
    params.sampling.check_vocabulary(model.architecture().vocab_size())?;
    let (tok, context) = (model.tokenizer(), model.context());
    if session.position() + prompt.len() > context {
        return Err(ModelError::ContextOverflow { needed: session.position() + prompt.len(), context });
    }
    let t0 = Instant::now();
    let mut out = session.forward_with(prompt, gen.mode(), gen.draw().as_ref())?;
    let mut prefill_secs = None;
    let mut t1 = Instant::now();
    let finish = loop {
        let adv = gen.advance(tok, out, session.position(), context)?;
        if prefill_secs.is_none() {
            prefill_secs = Some(t0.elapsed().as_secs_f64());
            t1 = Instant::now();
        }
        if !adv.text.is_empty() && on_text(&adv.text) == TextControl::Stop && adv.finish.is_none() {
            gen.cancel();
            break FinishReason::Cancelled;
        }
        if let Some(f) = adv.finish {
            break f;
        }
        out = session.forward_with(&[adv.token], gen.mode(), gen.draw().as_ref())?;
    };
    Ok(Generation {
        tokens: gen.tokens,
        text: gen.filter.text,
        finish,
        prompt_tokens: prompt.len(),
        prefill_secs: prefill_secs.unwrap_or_default(),
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter { stops, text: String::new(), emitted: 0 };
        let mut streamed = String::new();
        for p in pieces {
            let (t, stop) = f.push(p);
            streamed += &t;
            if stop {
                return (streamed, f.text, true);
            }
        }
        streamed += &f.flush();
        (streamed, f.text, false)
    }

    #[test]
    fn stop_string_across_pieces() {
        let (streamed, text, stopped) = run(&["END"], &["hello E", "N", "D more"]);
        assert!(stopped);
        assert_eq!(streamed, "hello ");
        assert_eq!(text, "hello ");
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let (streamed, _, stopped) = run(&["END"], &["a E", "x", "b"]);
        assert!(!stopped);
        assert_eq!(streamed, "a Exb");
    }

    #[test]
    fn no_stops_streams_everything() {
        let (streamed, _, _) = run(&[], &["é", "日本"]);
        assert_eq!(streamed, "é日本");
    }
}
