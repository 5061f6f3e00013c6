//! Parsing OpenAI requests: every field checked for type and range, errors naming the field.

use std::sync::atomic::{AtomicU64, Ordering};

use kiln_models::{GenerateParams, OutputFormat, SamplingParams};
use kiln_tokenizer::ChatMessage;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Most stop strings per request.
const MAX_STOPS: usize = 16;
/// Most alternatives per token in `logprobs`/`top_logprobs`.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Text, tokenized with BOS.
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// A conversation, rendered with the chat template.
    Messages(Vec<ChatMessage>),
}

/// A parsed, range-checked request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The model named by the client, if any.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// `max_tokens` (or `max_completion_tokens`), if given.
    pub max_tokens: Option<usize>,
    /// Sampling and stop strings (`max_tokens` is set once the prompt length is known).
    pub params: GenerateParams,
    /// Stream with server-sent events.
    pub stream: bool,
    /// Send a last chunk with `usage` (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Log-probabilities with this many alternatives per token, if asked for.
    pub logprobs: Option<usize>,
}

/// Typed access to a request object's fields.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The field, `None` when absent or null.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn number(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| ApiError::invalid(Some(name), format!("'{name}' must be a number, got {v}")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(Some(name), format!("'{name}' must be between {lo} and {hi}, got {x}")));
        }
        Ok(Some(x as f32))
    }

    fn integer(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let x = v.as_i64().ok_or_else(|| ApiError::invalid(Some(name), format!("'{name}' must be an integer, got {v}")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(Some(name), format!("'{name}' must be between {lo} and {hi}, got {x}")));
        }
        Ok(Some(x))
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        v.as_bool().map(Some).ok_or_else(|| ApiError::invalid(Some(name), format!("'{name}' must be a boolean, got {v}")))
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        v.as_str().map(Some).ok_or_else(|| ApiError::invalid(Some(name), format!("'{name}' must be a string, got {v}")))
    }
}

/// A seed from the clock and a counter, for requests without one.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Parses a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Request, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| ApiError::invalid(None, format!("the request body is not valid UTF-8 ({e})")))?;
    if text.trim().is_empty() {
        return Err(ApiError::invalid(None, "the request body is empty; send a JSON object"));
    }
    let value: Value =
        serde_json::from_str(text).map_err(|e| ApiError::invalid(None, format!("the request body is not valid JSON: {e}")))?;
    let Value::Object(map) = &value else {
        return Err(ApiError::invalid(None, "the request body must be a JSON object"));
    };
    let f = Fields(map);
    let model = f.string("model")?.map(str::to_string);
    let prompt = match endpoint {
        Endpoint::Completions => parse_prompt(f.get("prompt"))?,
        Endpoint::Chat => Prompt::Messages(parse_messages(f.get("messages"))?),
    };
    if let Some(n) = f.integer("n", i64::MIN, i64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid(Some("n"), format!("only n = 1 is supported, got {n}")));
        }
    }
    if let Some(b) = f.integer("best_of", i64::MIN, i64::MAX)? {
        if b != 1 {
            return Err(ApiError::invalid(Some("best_of"), format!("only best_of = 1 is supported, got {b}")));
        }
    }
    if f.boolean("echo")? == Some(true) {
        return Err(ApiError::invalid(Some("echo"), "echo is not supported"));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(Some("suffix"), "suffix is not supported"));
    }
    // Asked-for behaviour this server does not have is refused, not silently ignored.
    for name in ["tools", "functions"] {
        if f.get(name).is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(ApiError::invalid(Some(name), format!("'{name}' (function calling) is not supported")));
        }
    }
    let format = match f.get("response_format") {
        None | Some(Value::Null) => OutputFormat::Text,
        Some(v) => match v.get("type").and_then(Value::as_str) {
            Some("text") => OutputFormat::Text,
            Some("json_object") => OutputFormat::JsonObject,
            _ => {
                let kind = v.get("type").map_or_else(|| v.to_string(), Value::to_string);
                return Err(ApiError::invalid(
                    Some("response_format"),
                    format!("'response_format' {kind} is not supported: only \"text\" and \"json_object\" (no JSON schemas)"),
                ));
            }
        },
    };
    let max_tokens = match f.integer("max_completion_tokens", 1, i64::MAX)? {
        Some(m) => Some(m),
        None => f.integer("max_tokens", 1, i64::MAX)?,
    }
    .map(|m| usize::try_from(m).unwrap_or(usize::MAX));
    let logprobs = match endpoint {
        Endpoint::Completions => f.integer("logprobs", 0, MAX_TOP_LOGPROBS as i64)?.map(|n| n as usize),
        Endpoint::Chat => {
            let top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?.map(|n| n as usize);
            match f.boolean("logprobs")? {
                Some(true) => Some(top.unwrap_or(0)),
                _ if top.is_some() => {
                    return Err(ApiError::invalid(Some("top_logprobs"), "top_logprobs needs logprobs = true"));
                }
                _ => None,
            }
        }
    };
    let seed = match f.get("seed") {
        None => fresh_seed(),
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(ApiError::invalid(Some("seed"), format!("'seed' must be an integer, got {v}"))),
        },
    };
    let sampling = SamplingParams {
        temperature: f.number("temperature", 0.0, 2.0)?.unwrap_or(1.0),
        top_k: f.integer("top_k", -1, i64::from(u32::MAX))?.map_or(0, |k| k.max(0) as usize),
        top_p: f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0),
        min_p: f.number("min_p", 0.0, 1.0)?.unwrap_or(0.0),
        repetition_penalty: f.number("repetition_penalty", 0.0, 10.0)?.unwrap_or(1.0),
        frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        presence_penalty: f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        seed,
        logit_bias: parse_logit_bias(f.get("logit_bias"))?,
    };
    if sampling.top_p == 0.0 {
        return Err(ApiError::invalid(Some("top_p"), "'top_p' must be greater than 0"));
    }
    if sampling.repetition_penalty == 0.0 {
        return Err(ApiError::invalid(Some("repetition_penalty"), "'repetition_penalty' must be greater than 0"));
    }
    let stop = parse_stop(f.get("stop"))?;
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o).boolean("include_usage")?.unwrap_or(false),
        Some(v) => return Err(ApiError::invalid(Some("stream_options"), format!("'stream_options' must be an object, got {v}"))),
    };
    Ok(Request {
        endpoint,
        model,
        prompt,
        max_tokens,
        params: GenerateParams { max_tokens: 0, sampling, stop, format },
        stream,
        include_usage,
        logprobs,
    })
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases from -100 to 100.
fn parse_logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("logit_bias"), m);
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(other) => return Err(bad(format!("'logit_bias' must be an object of token ids to biases, got {other}"))),
    };
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id = key.trim().parse::<u32>().map_err(|_| bad(format!("'logit_bias' keys must be token ids, got '{key}'")))?;
        let bias = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| bad(format!("the bias of token {id} must be a number from -100 to 100, got {value}")))?;
        biases.push((id, bias as f32));
    }
    Ok(biases)
}

fn parse_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let bad = |m: &str| ApiError::invalid(Some("prompt"), m);
    let token = |v: &Value| -> Result<u32, ApiError> {
        v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| bad("token ids in 'prompt' must be non-negative integers"))
    };
    let prompt = match v {
        None => return Err(bad("'prompt' is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => return Err(bad("'prompt' is empty")),
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(ids)] => Prompt::Tokens(ids.iter().map(token).collect::<Result<_, _>>()?),
            items if items.iter().all(Value::is_number) => Prompt::Tokens(items.iter().map(token).collect::<Result<_, _>>()?),
            _ => return Err(bad("'prompt' must be a string, a list of token ids, or a list of one of those (batches are not supported)")),
        },
        Some(other) => return Err(bad(&format!("'prompt' must be a string or a list of token ids, got {other}"))),
    };
    match &prompt {
        Prompt::Text(s) if s.is_empty() => Err(bad("'prompt' is empty")),
        Prompt::Tokens(t) if t.is_empty() => Err(bad("'prompt' is empty")),
        _ => Ok(prompt),
    }
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages"), m);
    let Some(Value::Array(items)) = v else {
        return Err(bad("'messages' must be a non-empty list of messages".into()));
    };
    if items.is_empty() {
        return Err(bad("'messages' is empty".into()));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let Value::Object(m) = m else { return Err(bad(format!("messages[{i}] must be an object"))) };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => return Err(bad(format!("messages[{i}].role must be a string"))),
        };
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system",
            other => return Err(bad(format!("messages[{i}].role '{other}' is not one of system, developer, user, assistant, tool"))),
        };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (Some(kind), _) if kind != "text" => {
                            return Err(bad(format!("messages[{i}].content[{j}]: content of type '{kind}' is not supported")))
                        }
                        _ => return Err(bad(format!("messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": string}}"))),
                    }
                }
                text
            }
            _ => return Err(bad(format!("messages[{i}].content must be a string or a list of text parts"))),
        };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = |m: &str| ApiError::invalid(Some("stop"), m);
    let stops: Vec<String> = match v {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| bad("'stop' must be a string or a list of strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("'stop' must be a string or a list of strings")),
    };
    if stops.len() > MAX_STOPS {
        return Err(bad(&format!("at most {MAX_STOPS} stop strings are supported, got {}", stops.len())));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(endpoint: Endpoint, body: &str) -> ApiError {
        parse(endpoint, body.as_bytes()).expect_err(body)
    }

    #[test]
    fn parses_the_usual_fields() {
        let r = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0,"top_k":3,"stop":"\n","seed":-1,"stream":true,
                "stream_options":{"include_usage":true},"logprobs":2,"user":"x","n":1}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!((r.max_tokens, r.stream, r.include_usage, r.logprobs), (Some(5), true, true, Some(2)));
        assert_eq!(r.params.sampling.temperature, 0.0);
        assert_eq!(r.params.sampling.top_k, 3);
        assert_eq!(r.params.sampling.seed, u64::MAX);
        assert_eq!(r.params.stop, vec!["\n".to_string()]);
        let c = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"user","content":"q"},{"role":"assistant","content":null}],"logprobs":true,"top_logprobs":3,
                "max_completion_tokens":7}"#,
        )
        .unwrap();
        let Prompt::Messages(m) = c.prompt else { panic!() };
        assert_eq!(m, vec![ChatMessage::new("system", "ab"), ChatMessage::new("user", "q"), ChatMessage::new("assistant", "")]);
        assert_eq!((c.logprobs, c.max_tokens), (Some(3), Some(7)));
        assert_eq!(parse(Endpoint::Completions, br#"{"prompt":[[1,2,3]]}"#).unwrap().prompt, Prompt::Tokens(vec![1, 2, 3]));
        let b = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"q"}],"logit_bias":{"17":-100,"4":2.5},"tools":[],"response_format":{"type":"text"}}"#,
        )
        .unwrap();
        assert_eq!(b.params.format, OutputFormat::Text);
        let j = parse(Endpoint::Chat, br#"{"messages":[{"role":"user","content":"q"}],"response_format":{"type":"json_object"}}"#).unwrap();
        assert_eq!(j.params.format, OutputFormat::JsonObject);
        let mut bias = b.params.sampling.logit_bias;
        bias.sort_by_key(|&(id, _)| id);
        assert_eq!(bias, vec![(4, 2.5), (17, -100.0)]);
    }

    #[test]
    fn bad_fields_name_themselves() {
        use Endpoint::*;
        let cases: &[(Endpoint, &str, Option<&str>, &str)] = &[
            (Completions, "{", None, "not valid JSON"),
            (Completions, "[1]", None, "JSON object"),
            (Completions, "", None, "empty"),
            (Completions, r#"{"prompt":""}"#, Some("prompt"), "empty"),
            (Completions, r#"{"prompt":5}"#, Some("prompt"), "must be a string"),
            (Completions, r#"{"prompt":["a","b"]}"#, Some("prompt"), "batches"),
            (Completions, r#"{"prompt":[-1]}"#, Some("prompt"), "non-negative"),
            (Completions, r#"{}"#, Some("prompt"), "required"),
            (Completions, r#"{"prompt":"a","n":2}"#, Some("n"), "n = 1"),
            (Completions, r#"{"prompt":"a","temperature":"hot"}"#, Some("temperature"), "must be a number"),
            (Completions, r#"{"prompt":"a","temperature":3}"#, Some("temperature"), "between 0 and 2"),
            (Completions, r#"{"prompt":"a","max_tokens":0}"#, Some("max_tokens"), "between 1"),
            (Completions, r#"{"prompt":"a","max_tokens":1.5}"#, Some("max_tokens"), "integer"),
            (Completions, r#"{"prompt":"a","top_p":0}"#, Some("top_p"), "greater than 0"),
            (Completions, r#"{"prompt":"a","stop":[1]}"#, Some("stop"), "list of strings"),
            (Completions, r#"{"prompt":"a","stream":"yes"}"#, Some("stream"), "boolean"),
            (Completions, r#"{"prompt":"a","logprobs":21}"#, Some("logprobs"), "between 0 and 20"),
            (Completions, r#"{"prompt":"a","echo":true}"#, Some("echo"), "not supported"),
            (Completions, r#"{"prompt":"a","model":7}"#, Some("model"), "string"),
            (Completions, r#"{"prompt":"a","seed":"x"}"#, Some("seed"), "integer"),
            (Chat, r#"{"messages":[]}"#, Some("messages"), "empty"),
            (Chat, r#"{"messages":"hi"}"#, Some("messages"), "list"),
            (Chat, r#"{"messages":[{"role":"wizard","content":"x"}]}"#, Some("messages"), "not one of"),
            (Chat, r#"{"messages":[{"role":"user","content":5}]}"#, Some("messages"), "content"),
            (Chat, r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, Some("messages"), "not supported"),
            (Chat, r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#, Some("top_logprobs"), "logprobs = true"),
            (Completions, r#"{"prompt":"a","logit_bias":[1]}"#, Some("logit_bias"), "must be an object"),
            (Completions, r#"{"prompt":"a","logit_bias":{"x":1}}"#, Some("logit_bias"), "token ids, got 'x'"),
            (Completions, r#"{"prompt":"a","logit_bias":{"-3":1}}"#, Some("logit_bias"), "token ids, got '-3'"),
            (Completions, r#"{"prompt":"a","logit_bias":{"5":101}}"#, Some("logit_bias"), "from -100 to 100, got 101"),
            (Completions, r#"{"prompt":"a","logit_bias":{"5":"up"}}"#, Some("logit_bias"), "from -100 to 100"),
            (Chat, r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#, Some("tools"), "not supported"),
            (Chat, r#"{"messages":[{"role":"user","content":"x"}],"functions":[{}]}"#, Some("functions"), "not supported"),
            (
                Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}}"#,
                Some("response_format"),
                "\"json_schema\" is not supported",
            ),
            (Chat, r#"{"messages":[{"role":"user","content":"x"}],"response_format":"json"}"#, Some("response_format"), "not supported"),
        ];
        for (endpoint, body, param, needle) in cases {
            let e = err(*endpoint, body);
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), *param, "{body}: {}", e.message);
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
        let e = parse(Completions, b"{\"prompt\":\"\xff\"}").unwrap_err();
        assert!(e.message.contains("UTF-8"), "{}", e.message);
    }
}
