//! The continuous-batching scheduler: one thread owns the model and, between decode steps, admits
//! queued requests, prefills newcomers in chunks, runs one batched decode step for every active
//! sequence, streams each new piece of text to its request, and drops sequences whose client went
//! away (freeing their KV cache).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_models::{FinishReason, Generator, Model, ModelError, OutputMode, Session, StepOutput, TokenLogprob};
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
    /// Most prompt tokens prefilled between two decode steps (over all newcomers).
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

impl Seq<'_> {
    fn cancelled(&self) -> bool {
        self.job.events.is_closed()
    }
}

/// The outcome of handing one step output to a sequence.
enum Outcome {
    Running,
    Ended,
}

/// Runs the scheduler loop until `stop` is set and every admitted request has ended.
pub fn run(model: &Model, jobs: Receiver<Job>, config: SchedulerConfig, metrics: Arc<Metrics>, stop: Arc<AtomicBool>) {
    let mut seqs: Vec<Seq<'_>> = Vec::new();
    let mut open = true;
    let mut stopping_since: Option<Instant> = None;
    loop {
        // Admit newcomers while there are free slots (block when idle).
        while open && seqs.len() < config.parallel.max(1) {
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
            match model.new_session() {
                Ok(session) => {
                    metrics.active.fetch_add(1, Ordering::Relaxed);
                    seqs.push(Seq { job, session, prefilled: 0, next: None, started: false });
                }
                Err(e) => fail(&job.events, &metrics, &e),
            }
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
                }
            }
        }
        // Drop sequences whose client went away: their KV cache is freed with the session.
        seqs.retain(|s| {
            let gone = s.cancelled();
            if gone {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                metrics.active.fetch_sub(1, Ordering::Relaxed);
            }
            !gone
        });
        if seqs.is_empty() {
            if !open {
                return;
            }
            continue;
        }
        prefill_chunks(model, &mut seqs, config, &metrics);
        decode_step(model, &mut seqs, &metrics);
    }
}

/// Answers a request with an engine failure.
fn fail(events: &UnboundedSender<Event>, metrics: &Metrics, e: &ModelError) {
    metrics.failed.fetch_add(1, Ordering::Relaxed);
    let _ = events.send(Event::Failed(ApiError::internal(e.to_string())));
}

/// Prefills newcomers, oldest first, up to `prefill_chunk` prompt tokens in all (so running
/// streams wait at most that long between two tokens); a long prompt takes several rounds.
fn prefill_chunks(model: &Model, seqs: &mut Vec<Seq<'_>>, config: SchedulerConfig, metrics: &Metrics) {
    let mut budget = config.prefill_chunk.max(1);
    let mut i = 0;
    while budget > 0 && i < seqs.len() {
        if seqs[i].next.is_some() {
            i += 1;
            continue;
        }
        let seq = &mut seqs[i];
        let end = (seq.prefilled + budget).min(seq.job.prompt.len());
        budget -= end - seq.prefilled;
        let last = end == seq.job.prompt.len();
        // Chunks before the last only fill the KV cache: the cheapest output will do.
        let mode = if last { seq.job.generator.mode() } else { OutputMode::Hidden };
        let t0 = Instant::now();
        let result = seq.session.forward(&seq.job.prompt[seq.prefilled..end], mode);
        metrics.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        metrics.prefill_micros.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        let outcome = match result {
            Ok(out) => {
                metrics.prompt_tokens.fetch_add((end - seq.prefilled) as u64, Ordering::Relaxed);
                seq.prefilled = end;
                if last {
                    deliver(model, seq, Ok(out), metrics)
                } else {
                    Outcome::Running
                }
            }
            Err(e) => deliver(model, seq, Err(e), metrics),
        };
        match outcome {
            Outcome::Ended => {
                seqs.remove(i);
                metrics.active.fetch_sub(1, Ordering::Relaxed);
            }
            Outcome::Running => i += 1,
        }
    }
}

/// One batched decode step over every sequence past its prompt.
fn decode_step(model: &Model, seqs: &mut Vec<Seq<'_>>, metrics: &Metrics) {
    let ready: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].next.is_some()).collect();
    if ready.is_empty() {
        return;
    }
    // One step serves all: logits when any sequence samples or wants log-probabilities (greedy
    // ones take the argmax on the host), else the in-graph greedy head.
    let mode =
        if ready.iter().any(|&i| seqs[i].job.generator.mode() == OutputMode::Logits) { OutputMode::Logits } else { OutputMode::NextToken };
    let tokens: Vec<u32> = ready.iter().filter_map(|&i| seqs[i].next).collect();
    let t0 = Instant::now();
    let results = {
        let mut sessions: Vec<&mut Session<'_>> = seqs.iter_mut().filter(|s| s.next.is_some()).map(|s| &mut s.session).collect();
        model.decode_batch(&mut sessions, &tokens, mode)
    };
    metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
    metrics.decode_micros.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
    let mut ended = Vec::new();
    match results {
        Ok(outs) => {
            for (&i, out) in ready.iter().zip(outs) {
                if let Outcome::Ended = deliver(model, &mut seqs[i], out, metrics) {
                    ended.push(i);
                }
            }
        }
        Err(e) => {
            for &i in &ready {
                fail(&seqs[i].job.events, metrics, &e);
                ended.push(i);
            }
        }
    }
    // Remove from the back so the indices stay valid (and the admission order is kept).
    ended.sort_unstable();
    for i in ended.into_iter().rev() {
        seqs.remove(i);
        metrics.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Hands a step's output to its sequence's generator and streams what it produced.
fn deliver(model: &Model, seq: &mut Seq<'_>, out: Result<StepOutput, ModelError>, metrics: &Metrics) -> Outcome {
    let adv = out.and_then(|out| seq.job.generator.advance(model.tokenizer(), out, seq.session.position(), model.context()));
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
