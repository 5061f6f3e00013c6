//! Shared by the server's integration tests: an in-process server on a free port serving the
//! default model, and a minimal HTTP/1.1 client that can send anything (bad methods, invalid
//! UTF-8, huge bodies) and read server-sent events.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use kiln_cpu::CpuBackend;
use kiln_models::Model;
use kiln_runtime::{Backend, EngineConfig};
use kiln_server::{Server, ServerConfig, ServerError};
use serde_json::Value;

/// The model id the test servers use.
pub const MODEL_ID: &str = "test-model";
/// The context the test servers use (small, so over-long prompts are cheap to write).
pub const CONTEXT: usize = 512;

/// Starts a server for the default model with `parallel` slots and a queue of `queue`.
pub fn start(parallel: usize, queue: usize) -> Server {
    try_start(Arc::new(CpuBackend::new(2)), parallel, queue).expect("start the server")
}

/// Starts a server for the default model on `backend` with `parallel` slots and a queue of `queue`.
pub fn try_start(backend: Arc<dyn Backend>, parallel: usize, queue: usize) -> Result<Server, ServerError> {
    let path = kiln_hub::ensure_default_model().expect("the default model");
    let config = EngineConfig { threads: 2, context: CONTEXT, plan_cache_capacity: 64, ..EngineConfig::default() };
    let model = Model::load(&path, backend, config).expect("load the default model");
    let config = ServerConfig {
        port: 0,
        parallel,
        queue,
        model_id: MODEL_ID.into(),
        handle_signals: false,
        max_body_bytes: 1 << 20,
        ..ServerConfig::default()
    };
    Server::start(model, config)
}

/// An HTTP response.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers (names lower-cased).
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The `data:` payloads of a server-sent event stream.
    pub fn events(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body)
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_string)
            .collect()
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Sends `method path` with `body` (as JSON content) and reads the whole response.
pub fn send(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before reading a huge body, and close: write from another
    // thread while this one reads, and ignore write errors.
    let mut writer = s.try_clone().unwrap();
    let body = body.to_vec();
    let sending = std::thread::spawn(move || {
        let _ = writer.write_all(&body);
    });
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let _ = s.shutdown(std::net::Shutdown::Both);
    let _ = sending.join();
    parse(&raw)
}

/// POSTs a JSON value.
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    send(addr, "POST", path, body.to_string().as_bytes())
}

/// GETs a path.
pub fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, "GET", path, b"")
}

fn parse(raw: &[u8]) -> Reply {
    let split =
        raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.lines();
    let status: u16 = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|c| c.parse().ok()).expect("status line");
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())).collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    Reply { status, headers, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

/// The value of a metric sample (the line that starts with `sample`).
pub fn metric(addr: SocketAddr, sample: &str) -> f64 {
    let text = String::from_utf8(get(addr, "/metrics").body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {sample} in\n{text}"))
}

/// Polls `cond` every 50 ms for at most `secs` seconds.
pub fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}
