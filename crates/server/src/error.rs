//! Errors: the server's own (startup), and API errors answered as OpenAI-style JSON.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be bound or served.
    #[error("server I/O on {addr}: {source}")]
    Io {
        /// The address.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The KV caches of `parallel` sequences could not be allocated (at start).
    #[error(
        "allocating the KV caches of {parallel} concurrent sequences of {context} positions each (lower --parallel or --context, or use --kv-type f16): {source}"
    )]
    KvCaches {
        /// Sequences served at once.
        parallel: usize,
        /// Positions each cache holds.
        context: usize,
        /// What failed.
        source: kiln_models::ModelError,
    },
    /// The scheduler thread or the runtime failed.
    #[error("server: {0}")]
    Internal(String),
}

/// An error answered to a client: an HTTP status and OpenAI's
/// `{"error": {"message", "type", "param", "code"}}` body.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What was wrong, for people.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `not_found_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// This error with a machine-readable `code`.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// This error with HTTP status `status`.
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// A 404 for a model this server does not serve.
    pub fn model_not_found(model: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model '{model}' does not exist; this server serves '{served}'"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// A 429: the request queue is full.
    pub fn queue_full(capacity: usize) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is busy: {capacity} requests are already queued; retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    /// A 503: the server is shutting down.
    pub fn shutting_down() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            kind: "server_error",
            param: None,
            code: Some("shutting_down"),
        }
    }

    /// A 500 for a failure inside the engine.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
