//! The HTTP API against an in-process server running the default model: endpoints and response
//! shapes, streaming, a suite of malformed and hostile requests (each a 4xx with an OpenAI-style
//! error, the server serving the next good request), greedy text equal alone and among 8
//! concurrent requests (batched decode), client disconnects cancelling, a full queue answering
//! 429, and graceful shutdown.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// One server shared by the tests that do not count or time anything.
fn shared() -> SocketAddr {
    static SERVER: OnceLock<(kiln_server::Server, SocketAddr)> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let s = start(8, 64);
            let addr = s.addr();
            (s, addr)
        })
        .1
}

fn completion(addr: SocketAddr, body: Value) -> Value {
    let r = post(addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn greedy_text(addr: SocketAddr, prompt: &str, max_tokens: usize) -> String {
    let v = completion(addr, json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}));
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn endpoints_answer_in_openai_shapes() {
    let addr = shared();
    assert_eq!(get(addr, "/health").json()["status"], "ok");
    let models = get(addr, "/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL_ID);
    assert_eq!(get(addr, &format!("/v1/models/{MODEL_ID}")).json()["object"], "model");

    let v = completion(
        addr,
        json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2}),
    );
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL_ID);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "length");
    assert!(!c["text"].as_str().unwrap().is_empty());
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 6);
    assert!(u["prompt_tokens"].as_u64().unwrap() >= 5);
    assert_eq!(u["total_tokens"].as_u64(), Some(u["prompt_tokens"].as_u64().unwrap() + 6));
    let lp = &c["logprobs"];
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().map(Vec::len), Some(6), "logprobs.{key}: {lp}");
    }
    // Greedy: each chosen token is the most likely one, and its log-probability is the top one.
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(top.len() <= 2 && !top.is_empty());
        let best = top.values().map(|x| x.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0 && (chosen - best).abs() < 1e-4, "token {i}: {chosen} vs best {best}");
    }
    let text: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(text, c["text"].as_str().unwrap());

    let v = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
                "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 1}),
    )
    .json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    let content = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    assert!(content[0]["token"].is_string() && content[0]["logprob"].is_number() && content[0]["bytes"].is_array());
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 1);

    let metrics = String::from_utf8(get(addr, "/metrics").body).unwrap();
    for name in [
        "kiln_requests_total{endpoint=\"completions\"}",
        "kiln_generation_tokens_total",
        "kiln_queue_depth",
        "kiln_time_to_first_token_seconds_count",
        "kiln_generation_tokens_per_second",
    ] {
        assert!(metrics.contains(name), "{name} missing from\n{metrics}");
    }
}

#[test]
fn streamed_text_equals_the_whole_answer_and_stop_strings_do_not_leak() {
    let addr = shared();
    let prompt = "Once upon a time, in a small village,";
    let whole = greedy_text(addr, prompt, 12);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"].get(0)?.get("text")?.as_str().map(str::to_string)).collect();
    assert_eq!(streamed, whole);
    let finish = chunks.iter().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a finish chunk");
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    // Asked for, the usage comes once, in its own last chunk.
    assert!(finish["usage"].is_null(), "{finish}");
    let usage_only = chunks.last().unwrap();
    assert_eq!(usage_only["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage_only["usage"]["completion_tokens"], 12);

    // A stop string from the middle of the greedy text: the answer is the text before it.
    let words: Vec<&str> = whole.split_inclusive(' ').collect();
    assert!(words.len() >= 3, "{whole:?}");
    let stop = words[2].trim().to_string();
    let at = whole.find(stop.as_str()).unwrap();
    for stream in [false, true] {
        let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop.clone(), "@@never@@"], "stream": stream});
        let r = post(addr, "/v1/completions", &body);
        let (text, reason) = if stream {
            let chunks: Vec<Value> = r.events().iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
            let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap().to_string()).collect();
            let finish = chunks.iter().find(|c| c["choices"][0]["finish_reason"].is_string()).expect("a finish chunk");
            // Not asked for, the usage rides on the finish chunk (as llama.cpp's server sends it).
            assert!(finish["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{finish}");
            (text, finish["choices"][0]["finish_reason"].as_str().unwrap().to_string())
        } else {
            let v = r.json();
            (v["choices"][0]["text"].as_str().unwrap().to_string(), v["choices"][0]["finish_reason"].as_str().unwrap().to_string())
        };
        assert_eq!(text, whole[..at], "stream {stream}, stop {stop:?}");
        assert_eq!(reason, "stop");
    }

    // Chat streams open with the assistant role and end with [DONE].
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true, "temperature": 0}),
    );
    let events = r.events();
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(events.last().unwrap(), "[DONE]");
}

/// Checks an OpenAI-style error body.
fn assert_error(r: &Reply, status: u16, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{what}: {v}");
}

#[test]
fn bad_requests_get_4xx_errors_and_the_server_keeps_serving() {
    let addr = shared();
    let long_prompt = "word ".repeat(CONTEXT + 10);
    let huge = vec![b' '; 2 << 20];
    let cases: Vec<(&str, &str, &str, Vec<u8>, u16)> = vec![
        ("malformed JSON", "POST", "/v1/completions", b"{\"prompt\": \"hi\"".to_vec(), 400),
        ("not an object", "POST", "/v1/completions", b"[\"hi\"]".to_vec(), 400),
        ("empty body", "POST", "/v1/completions", b"".to_vec(), 400),
        ("invalid UTF-8", "POST", "/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), 400),
        ("wrong type", "POST", "/v1/completions", br#"{"prompt": "hi", "max_tokens": "ten"}"#.to_vec(), 400),
        ("empty prompt", "POST", "/v1/completions", br#"{"prompt": ""}"#.to_vec(), 400),
        ("missing prompt", "POST", "/v1/completions", br#"{"max_tokens": 3}"#.to_vec(), 400),
        ("over-long prompt", "POST", "/v1/completions", json!({"prompt": long_prompt}).to_string().into_bytes(), 400),
        (
            "max_tokens beyond the context",
            "POST",
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": CONTEXT}).to_string().into_bytes(),
            400,
        ),
        ("negative max_tokens", "POST", "/v1/completions", br#"{"prompt": "hi", "max_tokens": -5}"#.to_vec(), 400),
        ("n = 2", "POST", "/v1/completions", br#"{"prompt": "hi", "n": 2}"#.to_vec(), 400),
        ("temperature out of range", "POST", "/v1/completions", br#"{"prompt": "hi", "temperature": 7.5}"#.to_vec(), 400),
        ("top_p zero", "POST", "/v1/completions", br#"{"prompt": "hi", "top_p": 0}"#.to_vec(), 400),
        ("stop of the wrong type", "POST", "/v1/completions", br#"{"prompt": "hi", "stop": {"a": 1}}"#.to_vec(), 400),
        ("too many logprobs", "POST", "/v1/completions", br#"{"prompt": "hi", "logprobs": 50}"#.to_vec(), 400),
        ("token id outside the vocabulary", "POST", "/v1/completions", br#"{"prompt": [2, 999999999]}"#.to_vec(), 400),
        (
            "logit bias outside the vocabulary",
            "POST",
            "/v1/completions",
            br#"{"prompt": "hi", "logit_bias": {"999999999": 1}}"#.to_vec(),
            400,
        ),
        ("logit bias out of range", "POST", "/v1/completions", br#"{"prompt": "hi", "logit_bias": {"5": -300}}"#.to_vec(), 400),
        (
            "function calling",
            "POST",
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#.to_vec(),
            400,
        ),
        (
            "structured output",
            "POST",
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}"#.to_vec(),
            400,
        ),
        ("unknown model", "POST", "/v1/completions", br#"{"prompt": "hi", "model": "gpt-17"}"#.to_vec(), 404),
        ("unknown model card", "GET", "/v1/models/gpt-17", Vec::new(), 404),
        ("wrong method", "GET", "/v1/completions", Vec::new(), 405),
        ("wrong method on chat", "PUT", "/v1/chat/completions", b"{}".to_vec(), 405),
        ("unknown path", "POST", "/v1/embeddings", b"{}".to_vec(), 404),
        ("huge body", "POST", "/v1/completions", huge, 413),
        ("chat without messages", "POST", "/v1/chat/completions", br#"{"model": "test-model"}"#.to_vec(), 400),
        ("chat with empty messages", "POST", "/v1/chat/completions", br#"{"messages": []}"#.to_vec(), 400),
        ("chat with an unknown role", "POST", "/v1/chat/completions", br#"{"messages": [{"role": "root", "content": "x"}]}"#.to_vec(), 400),
        (
            "chat with non-text content",
            "POST",
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#.to_vec(),
            400,
        ),
        ("deeply nested JSON", "POST", "/v1/completions", format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), 400),
    ];
    assert!(cases.len() >= 15);
    // Requests that reach a generation endpoint are counted as rejected in the metrics.
    let counted = cases.iter().filter(|c| c.1 == "POST" && c.2.starts_with("/v1/c")).count() as f64;
    let before = metric(addr, "kiln_requests_rejected_total{reason=\"invalid\"}");
    for (what, method, path, body, status) in cases {
        let r = send(addr, method, path, &body);
        assert_error(&r, status, what);
        // The next good request is served.
        assert!(!greedy_text(addr, "Hello", 1).is_empty(), "after {what}");
    }
    let rejected = metric(addr, "kiln_requests_rejected_total{reason=\"invalid\"}") - before;
    assert_eq!(rejected, counted);
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let addr = shared();
    let path = kiln_hub::ensure_default_model().expect("the default model");
    let model = kiln_models::Model::load(&path, std::sync::Arc::new(kiln_cpu::CpuBackend::new(1)), Default::default()).unwrap();
    let id_of = |text: &str| {
        let ids = model.tokenizer().encode_with(text, false);
        assert_eq!(ids.len(), 1, "{text:?} is one token");
        ids[0]
    };
    let first = |bias: Value| {
        let body = json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logit_bias": bias});
        completion(addr, body)["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let greedy = first(json!({}));
    let banned = first(json!({ id_of(&greedy).to_string(): -100 }));
    assert_ne!(banned, greedy, "the greedy token banned");
    assert!(!banned.is_empty());
    assert_eq!(first(json!({ id_of(" London").to_string(): 100 })), " London", "a token forced");
    // The same ban through the chat endpoint.
    let body = json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 1, "temperature": 0});
    let chat = |b: &Value| post(addr, "/v1/chat/completions", b).json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let reply = chat(&body);
    let mut banned_body = body.clone();
    banned_body["logit_bias"] = json!({ id_of(&reply).to_string(): -100 });
    assert_ne!(chat(&banned_body), reply);
}

#[test]
fn json_object_format_gives_one_json_object() {
    let addr = shared();
    let prompt = "Question: what is the capital of France? Answer in JSON with keys city and country.\nAnswer:";
    let body = |format: Value| json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 60, "temperature": 0, "response_format": format});
    let v = completion(addr, body(json!({"type": "json_object"})));
    let text = v["choices"][0]["text"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    assert!(parsed.is_object(), "{text:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "the object closing ends generation: {v}");
    // Unconstrained, the same greedy request is not JSON.
    let free = completion(addr, body(json!({"type": "text"})))["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(serde_json::from_str::<Value>(&free).is_err(), "{free:?}");
    // Sampled and streamed through the chat endpoint: still one object.
    let chat = json!({"messages": [{"role": "user", "content": "Describe a cat as JSON."}], "max_tokens": 80, "temperature": 1.0,
        "seed": 11, "stream": true, "response_format": {"type": "json_object"}});
    let r = post(addr, "/v1/chat/completions", &chat);
    let mut streamed = String::new();
    let mut finish = Value::Null;
    for e in r.events().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        streamed += c["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    // (Cut at max_tokens, the text is a prefix of an object: its first byte opens it.)
    assert!(streamed.starts_with('{'), "{streamed:?}");
    if finish == "stop" {
        assert!(serde_json::from_str::<Value>(&streamed).unwrap().is_object(), "{streamed:?}");
    } else {
        assert_eq!(finish, "length", "{streamed:?}");
    }
}

#[test]
fn greedy_text_is_the_same_alone_and_among_8_concurrent_requests() {
    let server = start(8, 16);
    let addr = server.addr();
    let prompts: Vec<String> = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "def fibonacci(n):",
        "The best way to learn a language is",
        "Water boils at",
        "Once upon a time",
        "The quick brown fox",
        "In 1492, Columbus",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let tokens = 10;
    let alone: Vec<String> = prompts.iter().map(|p| greedy_text(addr, p, tokens)).collect();
    let steps_before = metric(addr, "kiln_decode_steps_total");
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(move || greedy_text(addr, p, tokens))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let steps = metric(addr, "kiln_decode_steps_total") - steps_before;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "prompt {i} ({:?}): alone vs among 8", prompts[i]);
    }
    // The 8 requests' decode steps ran batched: far fewer steps than 8 × (tokens - 1).
    assert!(steps < (8 * (tokens - 1)) as f64 / 2.0, "{steps} decode steps for 8 × {} tokens", tokens - 1);
    server.shutdown().unwrap();
}

/// Opens a streaming request and reads until the first text chunk arrives.
fn open_stream(addr: SocketAddr, max_tokens: usize) -> TcpStream {
    let body =
        json!({"prompt": "Tell me a long story about a dragon.", "max_tokens": max_tokens, "stream": true, "temperature": 0}).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head =
        format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"text\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

#[test]
fn disconnects_cancel_a_full_queue_answers_429_and_shutdown_is_graceful() {
    let server = start(1, 1);
    let addr = server.addr();
    // One running request fills the only slot.
    let running = open_stream(addr, 400);
    assert!(wait_for(60, || metric(addr, "kiln_active_sequences") == 1.0));
    // The next one waits in the queue (capacity 1) ...
    let queued = std::thread::spawn(move || greedy_text(addr, "Hello", 2));
    assert!(wait_for(60, || metric(addr, "kiln_queue_depth") == 1.0));
    // ... and one more is refused.
    let r = post(addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2}));
    assert_error(&r, 429, "queue full");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(metric(addr, "kiln_requests_rejected_total{reason=\"queue_full\"}"), 1.0);
    // The running client goes away: its sequence is cancelled, and the queued one runs.
    drop(running);
    assert!(wait_for(60, || metric(addr, "kiln_requests_finished_total{outcome=\"cancelled\"}") == 1.0));
    assert!(!queued.join().unwrap().is_empty());
    assert!(wait_for(60, || metric(addr, "kiln_active_sequences") == 0.0));
    // A request in flight when shutdown starts still finishes; the server then stops.
    let mut stream = open_stream(addr, 8);
    let shut = std::thread::spawn(move || server.shutdown());
    let mut rest = String::new();
    stream.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("[DONE]"), "{rest}");
    shut.join().unwrap().unwrap();
    assert!(TcpStream::connect(addr).is_err(), "the server still accepts connections after shutdown");
}
