//! The `kiln` command line.

mod bench;
mod cli;
mod commands;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let level = match cli.verbose {
        0 => tracing::Level::WARN,
        1 => tracing::Level::INFO,
        _ => tracing::Level::DEBUG,
    };
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(level).with_target(false).init();
    match commands::dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", chain_message(&e));
            ExitCode::FAILURE
        }
    }
}

/// `e` and its causes joined by ": ", each said once: the library errors already end their own
/// message with their I/O cause, which `{:#}` would print a second time.
fn chain_message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain().map(|c| c.to_string()) {
        if out.is_empty() {
            out = cause;
        } else if !out.ends_with(&cause) {
            out.push_str(": ");
            out.push_str(&cause);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chain_message;

    /// An error that, as the library errors do, ends its message with its cause and also gives
    /// that cause as its source.
    #[derive(Debug)]
    struct OpenFailed(std::io::Error);

    impl std::fmt::Display for OpenFailed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot open 'm.gguf': {}", self.0)
        }
    }

    impl std::error::Error for OpenFailed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_at_the_end_of_the_message_is_said_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(OpenFailed(io())).context("loading m.gguf");
        assert_eq!(format!("{e:#}"), "loading m.gguf: cannot open 'm.gguf': no such file: no such file");
        assert_eq!(chain_message(&e), "loading m.gguf: cannot open 'm.gguf': no such file");
        // A cause the message does not end with is kept.
        let e = anyhow::Error::new(io()).context("loading m.gguf");
        assert_eq!(chain_message(&e), "loading m.gguf: no such file");
    }
}
