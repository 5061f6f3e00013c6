//! kiln's OpenAI-compatible HTTP server with continuous batching.
//!
//! [`Server::start`] binds the address, starts the scheduler thread (which allocates the KV caches
//! of `parallel` sequences once, owns them, and runs one batched decode step for all of them,
//! admitting and prefilling newcomers in chunks between steps) and serves `POST /v1/completions`,
//! `POST /v1/chat/completions` (whole answers or server-sent events), `GET /v1/models`,
//! `GET /health` and `GET /metrics` (Prometheus text).

mod error;
mod http;
mod metrics;
mod request;
mod response;
mod scheduler;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kiln_models::Model;
use kiln_tokenizer::ChatTemplate;

pub use error::{ApiError, ServerError};

/// Server settings (from `kiln serve`'s flags).
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    /// Address to listen on.
    pub host: String,
    /// Port (0: any free port).
    pub port: u16,
    /// Most sequences generated at once (decoded together in one batched step).
    pub parallel: usize,
    /// Most requests waiting for a free sequence; more are answered 429.
    pub queue: usize,
    /// Most prompt tokens prefilled in one step while sequences are decoding.
    pub prefill_chunk: usize,
    /// Largest request body accepted (bytes); larger ones are answered 413.
    pub max_body_bytes: usize,
    /// The id clients name the model by (`model` field, `/v1/models`).
    pub model_id: String,
    /// Shut down gracefully on SIGINT/SIGTERM.
    pub handle_signals: bool,
    /// After shutdown starts, running requests may finish for this long before being cancelled.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            parallel: 16,
            queue: 64,
            prefill_chunk: 64,
            max_body_bytes: 2 << 20,
            model_id: "kiln".into(),
            handle_signals: true,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl Server {
    /// Loads nothing, binds `config.host:config.port`, and starts serving `model` on background
    /// threads.
    pub fn start(model: Model, config: ServerConfig) -> Result<Server, ServerError> {
        let model = Arc::new(model);
        let template = ChatTemplate::from_gguf(model.file(), model.tokenizer()).map_err(|e| ServerError::Internal(e.to_string()))?;
        let bind = format!("{}:{}", config.host, config.port);
        let io = {
            let addr = bind.clone();
            move |source| ServerError::Io { addr: addr.clone(), source }
        };
        let listener = std::net::TcpListener::bind(&bind).map_err(&io)?;
        listener.set_nonblocking(true).map_err(&io)?;
        let addr = listener.local_addr().map_err(&io)?;
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("kiln-http").enable_all().build().map_err(&io)?;
        let metrics = Arc::new(metrics::Metrics::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (jobs, jobs_rx) = std::sync::mpsc::sync_channel(config.queue);
        let sched_config = scheduler::SchedulerConfig {
            parallel: config.parallel.max(1),
            prefill_chunk: config.prefill_chunk.max(1),
            shutdown_grace: config.shutdown_grace,
        };
        let (ready, ready_rx) = std::sync::mpsc::sync_channel(1);
        let scheduler = {
            let (model, metrics, stop) = (model.clone(), metrics.clone(), stop.clone());
            std::thread::Builder::new()
                .name("kiln-scheduler".into())
                .spawn(move || scheduler::run(&model, jobs_rx, sched_config, metrics, stop, ready))
                .map_err(&io)?
        };
        // Every sequence's KV cache is allocated before the first request is taken.
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                return Err(ServerError::KvCaches { parallel: sched_config.parallel, context: model.context(), source });
            }
            Err(_) => return Err(ServerError::Internal("the scheduler thread ended before it started".into())),
        }
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let state = Arc::new(http::AppState {
            model,
            template,
            model_id: config.model_id.clone(),
            jobs,
            queue: config.queue,
            metrics,
            stop: stop.clone(),
            started,
        });
        let app = http::router(state, config.max_body_bytes);
        let (shutdown, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
        let handle_signals = config.handle_signals;
        let serve_io = io.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-server".into())
            .spawn(move || {
                let served = runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).map_err(&serve_io)?;
                    let signal = async move {
                        tokio::select! {
                            _ = shutdown_rx => {}
                            _ = termination(), if handle_signals => tracing::warn!("shutting down: finishing running requests"),
                        }
                        stop.store(true, Ordering::Relaxed);
                    };
                    axum::serve(listener, app).with_graceful_shutdown(signal).await.map_err(&serve_io)
                });
                // The router (and with it the job queue) is gone: the scheduler ends once its
                // running requests have.
                let joined = scheduler.join().map_err(|_| ServerError::Internal("the scheduler thread panicked".into()));
                served.and(joined)
            })
            .map_err(|source| ServerError::Io { addr: addr.to_string(), source })?;
        Ok(Server { addr, shutdown: Some(shutdown), thread: Some(thread) })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Blocks until the server stops (after SIGINT/SIGTERM when `handle_signals` is set).
    pub fn wait(mut self) -> Result<(), ServerError> {
        self.join()
    }

    /// Stops accepting requests, lets running ones finish (within the grace period), and waits.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.join()
    }

    fn join(&mut self) -> Result<(), ServerError> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServerError::Internal("the server thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = self.join();
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn termination() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
