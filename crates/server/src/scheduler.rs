//! The continuous-batching scheduler: one thread owns the model and, between steps, admits queued
//! requests, runs one batched step that decodes a token for every running sequence and prefills
//! chunks of newcomers' prompts, streams each new piece of text to its request, and drops
//! sequences whose client went away. The KV caches of `parallel` sequences are allocated once, at
//! start, and reused: a request never waits for, or fails on, an allocation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_models::{Advance, DrawSpec, FinishReason, Generator, Model, ModelError, OutputMode, Session, StepOutput, TokenLogprob};
use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// A request handed to the scheduler: prompt tokens and a ready generator.
pub struct Job {
    /// Prompt token ids (non-empty, fits the context with `max_tokens`).
    pub prompt: Vec<u32>,
    /// The sequence's sampler, detokenizer and stop conditions.
    pub generator: Generator,
    /// Where the events of this request go; a closed channel cancels the request.
    pub events: UnboundedSender<Event>,
    /// When the request arrived (for time to first token).
    pub arrived: Instant,
}

/// What the scheduler tells a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token and the text it released (possibly empty: held back).
    Token {
        /// Released text.
        text: String,
        /// The token's log-probabilities, when asked for.
        logprob: Option<(u32, TokenLogprob)>,
    },
    /// Generation ended.
    Done {
        /// Why.
        finish: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The request failed (engine error, shutdown).
    Failed(ApiError),
}

/// Scheduler settings.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most sequences decoded together.
    pub parallel: usize,
    /// Most prompt tokens prefilled in one step while sequences are decoding (over all newcomers).
    pub prefill_chunk: usize,
    /// After shutdown is asked for, running requests may finish for this long; then they are
    /// cancelled.
    pub shutdown_grace: Duration,
}

/// One admitted request.
struct Seq<'m> {
    job: Job,
    session: Session<'m>,
    /// Prompt tokens prefilled so far.
    prefilled: usize,
    /// The token to feed at the next decode step (set once the prompt is done).
    next: Option<u32>,
    /// Whether the first token was produced (for time to first token).
    started: bool,
}

impl<'m> Seq<'m> {
    fn cancelled(&self) -> bool {
        self.job.events.is_closed()
    }

    /// The sequence's session, emptied for the next request.
    fn into_session(mut self) -> Session<'m> {
        self.session.reset();
        self.session
    }
}

/// The outcome of handing one step output to a sequence.
enum Outcome {
    Running,
    Ended,
}

/// Allocates the sessions of `config.parallel` sequences, tells `ready` whether that worked, and
/// then runs the scheduler loop until `stop` is set and every admitted request has ended.
pub fn run(
    model: &Model,
    jobs: Receiver<Job>,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
    ready: SyncSender<Result<(), ModelError>>,
) {
    let mut free: Vec<Session<'_>> = Vec::with_capacity(config.parallel);
    for _ in 0..config.parallel.max(1) {
        match model.new_session() {
            Ok(s) => free.push(s),
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        }
    }
    let _ = ready.send(Ok(()));
    let mut seqs: Vec<Seq<'_>> = Vec::new();
    let mut open = true;
    let mut stopping_since: Option<Instant> = None;
    loop {
        // Admit newcomers while there are free slots (block when idle).
        while open && !free.is_empty() {
            let job = if seqs.is_empty() {
                match jobs.recv_timeout(Duration::from_millis(100)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            metrics.active.fetch_add(1, Ordering::Relaxed);
            let session = free.pop().expect("a free session");
            seqs.push(Seq { job, session, prefilled: 0, next: None, started: false });
        }
        if stop.load(Ordering::Relaxed) {
            // Shutting down: requests still queued are answered, running ones may finish within
            // the grace period.
            open = false;
            while let Ok(job) = jobs.try_recv() {
                metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Failed(ApiError::shutting_down()));
            }
            let since = *stopping_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= config.shutdown_grace {
                for s in seqs.drain(..) {
                    let _ = s.job.events.send(Event::Failed(ApiError::shutting_down()));
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    metrics.active.fetch_sub(1, Ordering::Relaxed);
                    free.push(s.into_session());
                }
            }
        }
        // Drop sequences whose client went away: their session goes back to the free ones.
        let gone: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].cancelled()).collect();
        metrics.cancelled.fetch_add(gone.len() as u64, Ordering::Relaxed);
        remove_ended(&mut seqs, gone, &mut free, &metrics);
        if seqs.is_empty() {
            if !open {
                return;
            }
            continue;
        }
        step(model, &mut seqs, &mut free, config, &metrics);
    }
}

/// Answers a request with an engine failure.
fn fail(events: &UnboundedSender<Event>, metrics: &Metrics, e: &ModelError) {
    metrics.failed.fetch_add(1, Ordering::Relaxed);
    let _ = events.send(Event::Failed(ApiError::internal(e.to_string())));
}

/// What one sequence contributes to a step.
#[derive(Clone, Copy)]
enum Part {
    /// Its next token (the sequence is past its prompt).
    Decode,
    /// Its prompt from what is prefilled so far up to this end.
    Prompt(usize),
}

/// One step over the active sequences: every sequence past its prompt decodes its next token,
/// and newcomers, oldest first, add prompt chunks of up to `prefill_chunk` tokens in all while
/// any sequence is decoding (so running streams wait at most that long between two tokens), or
/// up to one step's rows when none is; a long prompt takes several steps. All of it runs as one
/// batched step, so the weights are read once for decode and prefill rows alike.
fn step<'m>(model: &'m Model, seqs: &mut Vec<Seq<'m>>, free: &mut Vec<Session<'m>>, config: SchedulerConfig, metrics: &Metrics) {
    let decoding = seqs.iter().filter(|s| s.next.is_some()).count();
    let limit = model.max_step_rows().saturating_sub(decoding);
    // (With more sequences decoding than a step holds rows, newcomers wait for room.)
    let mut budget = if decoding > 0 { config.prefill_chunk.max(1).min(limit) } else { limit };
    let mut parts: Vec<(usize, Part)> = Vec::with_capacity(seqs.len());
    for (i, seq) in seqs.iter().enumerate() {
        if seq.next.is_some() {
            parts.push((i, Part::Decode));
        } else if budget > 0 {
            let end = (seq.prefilled + budget).min(seq.job.prompt.len());
            budget -= end - seq.prefilled;
            parts.push((i, Part::Prompt(end)));
        }
    }
    if parts.is_empty() {
        return;
    }
    let finishing = |seq: &Seq<'_>, part: Part| match part {
        Part::Decode => true,
        Part::Prompt(end) => end == seq.job.prompt.len(),
    };
    let t0 = Instant::now();
    let results = if let [(i, Part::Prompt(end))] = parts[..] {
        // A lone prompt chunk: one before the prompt's last only fills the KV cache, so the
        // cheapest output will do.
        let seq = &mut seqs[i];
        let gen = &seq.job.generator;
        let (mode, draw) = if end == seq.job.prompt.len() { (gen.mode(), gen.draw()) } else { (OutputMode::Hidden, None) };
        Ok(vec![seq.session.forward_with(&seq.job.prompt[seq.prefilled..end], mode, draw.as_ref())])
    } else {
        let modes: Vec<OutputMode> =
            parts.iter().filter(|&&(i, p)| finishing(&seqs[i], p)).map(|&(i, _)| seqs[i].job.generator.mode()).collect();
        let mode = batch_mode(&modes);
        let mut chosen = parts.iter().peekable();
        let mut sessions: Vec<&mut Session<'_>> = Vec::with_capacity(parts.len());
        let mut chunks: Vec<&[u32]> = Vec::with_capacity(parts.len());
        let mut draws = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let Some(&(_, part)) = chosen.next_if(|&&(j, _)| j == i) else { continue };
            let chunk = match part {
                Part::Decode => std::slice::from_ref(seq.next.as_ref().expect("a decoding sequence has its next token")),
                Part::Prompt(end) => &seq.job.prompt[seq.prefilled..end],
            };
            if matches!(mode, OutputMode::Drawn(_)) {
                // (Greedy sequences, and prompt chunks whose output is not used, take the likeliest.)
                let draw = if finishing(seq, part) { seq.job.generator.draw() } else { None };
                draws.push(draw.unwrap_or_else(DrawSpec::greedy));
            }
            chunks.push(chunk);
            sessions.push(&mut seq.session);
        }
        model.forward_batch(&mut sessions, &chunks, mode, &draws)
    };
    let micros = t0.elapsed().as_micros() as u64;
    let prompts = parts.iter().filter(|(_, p)| matches!(p, Part::Prompt(_))).count() as u64;
    metrics.prefill_chunks.fetch_add(prompts, Ordering::Relaxed);
    if prompts == 0 {
        metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
        metrics.decode_micros.fetch_add(micros, Ordering::Relaxed);
    } else if decoding > 0 {
        // A mixed step counts as a decode step, its time as prefill (it stalled the streams).
        metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
        metrics.prefill_micros.fetch_add(micros, Ordering::Relaxed);
    } else {
        metrics.prefill_micros.fetch_add(micros, Ordering::Relaxed);
    }
    let results = match results {
        Ok(r) => r,
        Err(e) => {
            for &(i, _) in &parts {
                fail(&seqs[i].job.events, metrics, &e);
            }
            return remove_ended(seqs, parts.iter().map(|&(i, _)| i).collect(), free, metrics);
        }
    };
    // The outputs that are used: failures, and those of sequences past their prompt.
    let mut used = Vec::with_capacity(parts.len());
    for (&(i, part), result) in parts.iter().zip(results) {
        let seq = &mut seqs[i];
        if let (Part::Prompt(end), Ok(_)) = (part, &result) {
            metrics.prompt_tokens.fetch_add((end - seq.prefilled) as u64, Ordering::Relaxed);
            seq.prefilled = end;
        }
        if result.is_err() || finishing(seq, part) {
            used.push((i, result));
        }
    }
    let mut ended = Vec::new();
    for (i, adv) in advance_all(model, seqs, used) {
        if let Outcome::Ended = deliver(&mut seqs[i], adv, metrics) {
            ended.push(i);
        }
    }
    remove_ended(seqs, ended, free, metrics);
}

/// The output of a step that serves sequences wanting `modes`: the logits when any needs them, or
/// when some draw among candidates and others among all logits; else the draw when any draws (the
/// greedy ones draw at temperature 0: the likeliest token); else the in-graph greedy head.
fn batch_mode(modes: &[OutputMode]) -> OutputMode {
    let mut mode = OutputMode::NextToken;
    for &m in modes {
        mode = match (mode, m) {
            (_, OutputMode::NextToken) => mode,
            (OutputMode::NextToken, m) => m,
            (a, b) if a == b => a,
            _ => OutputMode::Logits,
        };
    }
    mode
}

/// Hands each used output (`used`: sequence index, in increasing order, and its step's output) to
/// its sequence's generator, which chooses the next token. Where several sequences choose from
/// logits, they choose on several threads: a choice over a vocabulary of 262,144 tokens takes
/// 0.1-0.7 ms, as long as a whole batched step on a GPU.
fn advance_all(
    model: &Model,
    seqs: &mut [Seq<'_>],
    used: Vec<(usize, Result<StepOutput, ModelError>)>,
) -> Vec<(usize, Result<Advance, ModelError>)> {
    let sampling = used.iter().filter(|(_, out)| matches!(out, Ok(StepOutput::Logits(_)))).count();
    let mut outs = used.into_iter().peekable();
    let mut work: Vec<(usize, &mut Generator, usize, Result<StepOutput, ModelError>)> = Vec::with_capacity(outs.len());
    for (i, seq) in seqs.iter_mut().enumerate() {
        if let Some((_, out)) = outs.next_if(|(j, _)| *j == i) {
            work.push((i, &mut seq.job.generator, seq.session.position(), out));
        }
    }
    let advance = |(i, generator, position, out): (usize, &mut Generator, usize, Result<StepOutput, ModelError>)| {
        (i, out.and_then(|out| generator.advance(model.tokenizer(), out, position, model.context())))
    };
    if sampling > 1 {
        work.into_par_iter().map(advance).collect()
    } else {
        work.into_iter().map(advance).collect()
    }
}

/// Removes the sequences at `ended` (in increasing order), keeping the admission order, and puts
/// their sessions back with the free ones.
fn remove_ended<'m>(seqs: &mut Vec<Seq<'m>>, ended: Vec<usize>, free: &mut Vec<Session<'m>>, metrics: &Metrics) {
    // From the back, so the indices stay valid.
    for i in ended.into_iter().rev() {
        free.push(seqs.remove(i).into_session());
        metrics.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Streams what a sequence's generator made of its step's output (or the failure).
fn deliver(seq: &mut Seq<'_>, adv: Result<Advance, ModelError>, metrics: &Metrics) -> Outcome {
    let adv = match adv {
        Ok(a) => a,
        Err(e) => {
            fail(&seq.job.events, metrics, &e);
            return Outcome::Ended;
        }
    };
    if !seq.started {
        seq.started = true;
        metrics.observe_ttft(seq.job.arrived.elapsed().as_secs_f64());
    }
    if adv.emitted {
        metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    }
    let logprob = if adv.emitted { adv.logprob.map(|lp| (adv.token, lp)) } else { None };
    if (!adv.text.is_empty() || logprob.is_some()) && seq.job.events.send(Event::Token { text: adv.text, logprob }).is_err() {
        seq.job.generator.cancel();
        metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        return Outcome::Ended;
    }
    match adv.finish {
        Some(finish) => {
            metrics.finished.fetch_add(1, Ordering::Relaxed);
            let _ = seq.job.events.send(Event::Done {
                finish,
                prompt_tokens: seq.job.prompt.len(),
                completion_tokens: seq.job.generator.tokens().len(),
            });
            Outcome::Ended
        }
        None => {
            seq.next = Some(adv.token);
            Outcome::Running
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_models::Among;

    #[test]
    fn a_batch_takes_the_richest_output_its_sequences_need() {
        let (greedy, logits) = (OutputMode::NextToken, OutputMode::Logits);
        let (cand, vocab) = (OutputMode::Drawn(Among::Candidates), OutputMode::Drawn(Among::Vocabulary));
        for (modes, want) in [
            (vec![], greedy),
            (vec![greedy, greedy], greedy),
            (vec![greedy, cand, cand], cand),
            (vec![vocab, greedy], vocab),
            (vec![cand, vocab], logits),
            (vec![greedy, logits, cand], logits),
            (vec![vocab, vocab, logits], logits),
        ] {
            assert_eq!(batch_mode(&modes), want, "{modes:?}");
        }
    }
}
