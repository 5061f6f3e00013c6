//! Server counters and gauges, rendered as Prometheus text for `GET /metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (seconds) of the time-to-first-token histogram buckets.
const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Everything `/metrics` reports; updated lock-free by the handlers and the scheduler.
#[derive(Default)]
pub struct Metrics {
    /// Completion requests accepted into the queue.
    pub requests: AtomicU64,
    /// Chat completion requests accepted into the queue.
    pub chat_requests: AtomicU64,
    /// Requests answered with a 4xx for bad input.
    pub rejected_invalid: AtomicU64,
    /// Requests answered 429 because the queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Requests that finished generating.
    pub finished: AtomicU64,
    /// Requests cancelled by a client disconnect.
    pub cancelled: AtomicU64,
    /// Requests that failed inside the engine.
    pub failed: AtomicU64,
    /// Prompt tokens processed.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Requests waiting for a free sequence slot.
    pub queue_depth: AtomicU64,
    /// Sequences being prefilled or decoded.
    pub active: AtomicU64,
    /// Steps that decoded running sequences (some with prompt chunks too).
    pub decode_steps: AtomicU64,
    /// Microseconds spent in steps of decode rows only.
    pub decode_micros: AtomicU64,
    /// Prompt chunks run (one per sequence and step).
    pub prefill_chunks: AtomicU64,
    /// Microseconds spent in steps with prompt chunks (with or without decode rows).
    pub prefill_micros: AtomicU64,
    /// Time to first token: count per bucket of `TTFT_BUCKETS` (cumulative at render time).
    ttft_buckets: [AtomicU64; TTFT_BUCKETS.len()],
    /// Time to first token: observations.
    ttft_count: AtomicU64,
    /// Time to first token: sum in microseconds.
    ttft_micros: AtomicU64,
}

impl Metrics {
    /// Records one time to first token.
    pub fn observe_ttft(&self, secs: f64) {
        if let Some(i) = TTFT_BUCKETS.iter().position(|&b| secs <= b) {
            self.ttft_buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.ttft_count.fetch_add(1, Ordering::Relaxed);
        self.ttft_micros.fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(s, "{name}{labels} {v}");
            }
        };
        metric(
            "kiln_requests_total",
            "counter",
            "Requests accepted into the queue, by endpoint.",
            &[
                ("{endpoint=\"completions\"}", get(&self.requests) as f64),
                ("{endpoint=\"chat_completions\"}", get(&self.chat_requests) as f64),
            ],
        );
        metric(
            "kiln_requests_rejected_total",
            "counter",
            "Requests rejected before generation, by reason.",
            &[
                ("{reason=\"invalid\"}", get(&self.rejected_invalid) as f64),
                ("{reason=\"queue_full\"}", get(&self.rejected_queue_full) as f64),
            ],
        );
        metric(
            "kiln_requests_finished_total",
            "counter",
            "Requests that ended, by outcome.",
            &[
                ("{outcome=\"completed\"}", get(&self.finished) as f64),
                ("{outcome=\"cancelled\"}", get(&self.cancelled) as f64),
                ("{outcome=\"failed\"}", get(&self.failed) as f64),
            ],
        );
        metric("kiln_prompt_tokens_total", "counter", "Prompt tokens processed.", &[("", get(&self.prompt_tokens) as f64)]);
        metric("kiln_generation_tokens_total", "counter", "Tokens generated.", &[("", get(&self.generated_tokens) as f64)]);
        metric("kiln_queue_depth", "gauge", "Requests waiting for a sequence slot.", &[("", get(&self.queue_depth) as f64)]);
        metric("kiln_active_sequences", "gauge", "Sequences being prefilled or decoded.", &[("", get(&self.active) as f64)]);
        metric(
            "kiln_decode_steps_total",
            "counter",
            "Steps that decoded running sequences (some with prompt chunks too).",
            &[("", get(&self.decode_steps) as f64)],
        );
        metric(
            "kiln_decode_seconds_total",
            "counter",
            "Seconds spent in steps of decode rows only.",
            &[("", get(&self.decode_micros) as f64 / 1e6)],
        );
        metric(
            "kiln_prefill_chunks_total",
            "counter",
            "Prompt chunks run (one per sequence and step).",
            &[("", get(&self.prefill_chunks) as f64)],
        );
        metric(
            "kiln_prefill_seconds_total",
            "counter",
            "Seconds spent in steps with prompt chunks.",
            &[("", get(&self.prefill_micros) as f64 / 1e6)],
        );
        let busy = (get(&self.decode_micros) + get(&self.prefill_micros)) as f64 / 1e6;
        let tps = if busy > 0.0 { get(&self.generated_tokens) as f64 / busy } else { 0.0 };
        metric(
            "kiln_generation_tokens_per_second",
            "gauge",
            "Tokens generated per second of engine time (prefill and decode).",
            &[("", tps)],
        );
        let mut cumulative = 0;
        let mut samples: Vec<(String, f64)> = Vec::new();
        for (b, n) in TTFT_BUCKETS.iter().zip(&self.ttft_buckets) {
            cumulative += get(n);
            samples.push((format!("_bucket{{le=\"{b}\"}}"), cumulative as f64));
        }
        samples.push(("_bucket{le=\"+Inf\"}".into(), get(&self.ttft_count) as f64));
        samples.push(("_sum".into(), get(&self.ttft_micros) as f64 / 1e6));
        samples.push(("_count".into(), get(&self.ttft_count) as f64));
        let name = "kiln_time_to_first_token_seconds";
        let _ = writeln!(s, "# HELP {name} Seconds from request arrival to its first generated token.\n# TYPE {name} histogram");
        for (suffix, v) in samples {
            let _ = writeln!(s, "{name}{suffix} {v}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.requests.fetch_add(3, Ordering::Relaxed);
        m.observe_ttft(0.07);
        m.observe_ttft(0.3);
        m.observe_ttft(100.0);
        let text = m.render();
        assert!(text.contains("kiln_requests_total{endpoint=\"completions\"} 3\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.1\"} 1\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.5\"} 2\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("kiln_time_to_first_token_seconds_count 3\n"), "{text}");
        assert!(text.contains("# TYPE kiln_queue_depth gauge"), "{text}");
    }
}
