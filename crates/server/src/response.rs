//! OpenAI response shapes: whole answers, stream chunks, usage and log-probabilities.

use kiln_models::{FinishReason, TokenLogprob};
use kiln_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

use crate::request::Endpoint;

/// What identifies one answer: shared by all of its stream chunks.
#[derive(Clone, Debug)]
pub struct Envelope {
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's id.
    pub model: String,
    /// Which endpoint.
    pub endpoint: Endpoint,
}

impl Envelope {
    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, stream: bool, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(stream)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("system_fingerprint".into(), json!(concat!("kiln-", env!("CARGO_PKG_VERSION"))));
        m.insert("choices".into(), choices);
        m
    }

    /// A whole (non-streamed) answer.
    pub fn answer(&self, text: &str, logprobs: Option<&Logprobs>, finish: FinishReason, usage: Usage) -> Value {
        let lp = logprobs.map_or(Value::Null, |l| l.to_json(self.endpoint));
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason(finish)}),
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": lp,
                "finish_reason": finish_reason(finish),
            }),
        };
        let mut m = self.wrap(false, json!([choice]));
        m.insert("usage".into(), usage.to_json());
        Value::Object(m)
    }

    /// The opening chunk of a chat stream (the assistant role, no content yet).
    pub fn role_chunk(&self) -> Value {
        Value::Object(
            self.wrap(true, json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])),
        )
    }

    /// A chunk carrying `text` (and its tokens' log-probabilities).
    pub fn text_chunk(&self, text: &str, logprobs: Option<&Logprobs>) -> Value {
        let lp = logprobs.map_or(Value::Null, |l| l.to_json(self.endpoint));
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": null}),
            Endpoint::Chat => json!({"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}),
        };
        Value::Object(self.wrap(true, json!([choice])))
    }

    /// The closing chunk: the finish reason, and the usage (null when a usage-only chunk follows).
    pub fn finish_chunk(&self, finish: FinishReason, usage: Option<Usage>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason(finish)}),
            Endpoint::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason(finish)}),
        };
        let mut m = self.wrap(true, json!([choice]));
        m.insert("usage".into(), usage.map_or(Value::Null, |u| u.to_json()));
        Value::Object(m)
    }

    /// The usage-only chunk of `stream_options.include_usage` (no choices).
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut m = self.wrap(true, json!([]));
        m.insert("usage".into(), usage.to_json());
        Value::Object(m)
    }
}

/// OpenAI's finish reason: a full context counts as `length`.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::Cancelled => "cancelled",
    }
}

/// Token counts of one answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Generated tokens.
    pub completion: usize,
}

impl Usage {
    fn to_json(self) -> Value {
        json!({"prompt_tokens": self.prompt, "completion_tokens": self.completion, "total_tokens": self.prompt + self.completion})
    }
}

/// One generated token's log-probabilities, with texts resolved.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    text: String,
    logprob: f32,
    top: Vec<(String, f32)>,
    offset: usize,
}

/// Log-probabilities of a run of generated tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logprobs {
    entries: Vec<Entry>,
}

/// The text of token `id` as it reads in the output (`▁` as a space; bytes as `<0xXX>`).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.piece(id).unwrap_or("").replace('\u{2581}', " ")
}

impl Logprobs {
    /// Adds token `id` (whose text starts at byte `offset` of the answer) and its alternatives.
    pub fn push(&mut self, tok: &Tokenizer, id: u32, lp: &TokenLogprob, offset: usize) {
        let top = lp.top.iter().map(|&(t, l)| (token_text(tok, t), l)).collect();
        self.entries.push(Entry { text: token_text(tok, id), logprob: lp.logprob, top, offset });
    }

    /// Whether no token was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn to_json(&self, endpoint: Endpoint) -> Value {
        let num = |x: f32| if x.is_finite() { json!(x) } else { json!(-9999.0) };
        match endpoint {
            Endpoint::Completions => {
                let top: Vec<Value> =
                    self.entries.iter().map(|e| Value::Object(e.top.iter().map(|(t, l)| (t.clone(), num(*l))).collect())).collect();
                json!({
                    "tokens": self.entries.iter().map(|e| e.text.clone()).collect::<Vec<_>>(),
                    "token_logprobs": self.entries.iter().map(|e| num(e.logprob)).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": self.entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
                })
            }
            Endpoint::Chat => {
                let item = |t: &str, l: f32| json!({"token": t, "logprob": num(l), "bytes": t.as_bytes()});
                let content: Vec<Value> = self
                    .entries
                    .iter()
                    .map(|e| {
                        let mut v = item(&e.text, e.logprob);
                        v["top_logprobs"] = Value::Array(e.top.iter().map(|(t, l)| item(t, *l)).collect());
                        v
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
        }
    }
}
