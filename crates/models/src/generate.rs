//! The generation loop: prefill, then one token at a time until a stop condition.

use std::time::Instant;

use kiln_ir::OutputMode;
use kiln_tokenizer::StreamDecoder;

use crate::{ModelError, Sampler, SamplingParams, Session, StepOutput};

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// Generation stops when the text contains any of these (the stop string is not returned).
    pub stop: Vec<String>,
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
struct StopFilter<'a> {
    stops: &'a [String],
    text: String,
    emitted: usize,
}

impl StopFilter<'_> {
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
        let held = tail
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&tail[i..])))
            .unwrap_or(tail.len());
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

/// The next token from a step's output: computed in the graph (greedy) or sampled from logits.
fn choose(out: StepOutput, sampler: &mut Sampler) -> Result<u32, ModelError> {
    match out {
        StepOutput::Token(t) => Ok(t),
        StepOutput::Logits(mut l) => Ok(sampler.sample(&mut l)),
        _ => Err(ModelError::InvalidParameter("generation needs a token or logits output".into())),
    }
}

/// Generates a continuation of `prompt` in `session`, streaming text to `on_text` as it is
/// produced (never half a UTF-8 character, never part of a stop string).
pub fn generate(
    session: &mut Session<'_>,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> TextControl,
) -> Result<Generation, ModelError> {
    let mut sampler = Sampler::new(params.sampling.clone())?;
    if prompt.is_empty() {
        return Err(ModelError::InvalidParameter("the prompt is empty".into()));
    }
    let model = session.model();
    let (tok, context) = (model.tokenizer(), model.context());
    if session.position() + prompt.len() > context {
        return Err(ModelError::ContextOverflow { needed: session.position() + prompt.len(), context });
    }
    prompt.iter().for_each(|&t| sampler.observe(t));
    let mode = if params.sampling.is_greedy() { OutputMode::NextToken } else { OutputMode::Logits };
    let t0 = Instant::now();
    let out = session.forward(prompt, mode)?;
    let mut next = choose(out, &mut sampler)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut decoder = StreamDecoder::new(true);
    let mut filter = StopFilter { stops: &params.stop, text: String::new(), emitted: 0 };
    let mut tokens = Vec::new();
    let mut stop_string_found = false;
    let finish = loop {
        if tokens.len() >= params.max_tokens {
            break FinishReason::Length;
        }
        if tok.is_end_of_generation(next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        sampler.observe(next);
        let (text, stopped) = filter.push(&decoder.push(tok, next));
        if !text.is_empty() && on_text(&text) == TextControl::Stop {
            break FinishReason::Cancelled;
        }
        if stopped {
            stop_string_found = true;
            break FinishReason::Stop;
        }
        if tokens.len() >= params.max_tokens {
            break FinishReason::Length;
        }
        if session.position() >= context {
            break FinishReason::ContextFull;
        }
        next = choose(session.forward(&[next], mode)?, &mut sampler)?;
    };
    // Release what is still held back (incomplete characters, possible stop-string prefixes) unless
    // the text was cut at a stop string or the caller cancelled; an end-of-generation token
    // releases it like `max_tokens` or a full context.
    if !stop_string_found && finish != FinishReason::Cancelled {
        let (text, _) = filter.push(&decoder.finish());
        let rest = text + &filter.flush();
        if !rest.is_empty() {
            on_text(&rest);
        }
    }
    Ok(Generation {
        tokens,
        text: filter.text,
        finish,
        prompt_tokens: prompt.len(),
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter { stops: &stops, text: String::new(), emitted: 0 };
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
