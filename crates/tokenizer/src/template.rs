//! Chat templates: the model's own Jinja template (`tokenizer.chat_template`), rendered with
//! minijinja; a file without one gets the built-in Gemma turn format if it is a Gemma, else ChatML.

use kiln_gguf::GgufFile;
use minijinja::{context, Environment, Error, ErrorKind};

use crate::{gemma_chat_prompt, ChatMessage, Tokenizer, TokenizerError};

/// The metadata key holding a model's Jinja chat template.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// ChatML, the turn format of a file without a template that is not a Gemma (llama.cpp's default
/// too).
const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// How a conversation becomes prompt tokens for one model.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    /// The Jinja source, or none for the built-in Gemma format.
    source: Option<String>,
    /// Text of the BOS token (`bos_token` in the template).
    bos: String,
    /// Text of the EOS token (`eos_token` in the template).
    eos: String,
}

/// The template environment: minijinja's builtins plus `raise_exception`, as Hugging Face provides.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    env
}

impl ChatTemplate {
    /// A template from Jinja `source` (checked now), or the built-in Gemma format for `None`;
    /// `bos` and `eos` are the texts the template sees as `bos_token` and `eos_token`.
    pub fn new(source: Option<String>, bos: &str, eos: &str) -> Result<Self, TokenizerError> {
        if let Some(src) = &source {
            environment()
                .template_from_str(src)
                .map_err(|e| TokenizerError::ChatTemplate(format!("{CHAT_TEMPLATE_KEY} does not parse: {e:#}")))?;
        }
        Ok(ChatTemplate { source, bos: bos.to_string(), eos: eos.to_string() })
    }

    /// The template of a model file: `tokenizer.chat_template`, else the built-in Gemma format for
    /// a Gemma and ChatML for any other architecture.
    pub fn from_gguf(file: &GgufFile, tok: &Tokenizer) -> Result<Self, TokenizerError> {
        let source = match file.get(CHAT_TEMPLATE_KEY) {
            Some(_) => Some(
                file.get_str(CHAT_TEMPLATE_KEY).map_err(|source| TokenizerError::Metadata { key: CHAT_TEMPLATE_KEY, source })?.to_string(),
            ),
            None if file.architecture().is_ok_and(|a| a.starts_with("gemma")) => None,
            None => Some(CHATML.to_string()),
        };
        let text = |id: Option<u32>| id.and_then(|i| tok.piece(i)).unwrap_or("").to_string();
        Self::new(source, &text(tok.bos_id()), &text(tok.eos_id()))
    }

    /// Whether this renders a Jinja template (the file's, or ChatML), else the built-in Gemma format.
    pub fn is_jinja(&self) -> bool {
        self.source.is_some()
    }

    /// Renders `messages`; `add_generation_prompt` opens the assistant's turn. A template that
    /// raises (e.g. roles that do not alternate) gives an error with its message.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let Some(src) = &self.source else {
            return Ok(gemma_chat_prompt(messages, add_generation_prompt));
        };
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        };
        environment().render_str(src, ctx).map_err(|e| {
            let msg = match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or("the chat template raised an error").to_string(),
                _ => format!("{e:#}"),
            };
            TokenizerError::ChatTemplate(msg)
        })
    }

    /// The prompt tokens for `messages`: rendered, then encoded. BOS is added unless the rendered
    /// text already starts with it (templates usually write `{{ bos_token }}` themselves).
    pub fn encode(&self, tok: &Tokenizer, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>, TokenizerError> {
        Ok(self.encode_rendered(tok, &self.render(messages, add_generation_prompt)?))
    }

    /// The prompt tokens of `text` this template rendered: BOS added unless the text starts with it.
    fn encode_rendered(&self, tok: &Tokenizer, text: &str) -> Vec<u32> {
        let has_bos = !self.bos.is_empty() && text.starts_with(&self.bos);
        tok.encode_with(text, !has_bos)
    }
}

/// A conversation kept in one KV cache (`kiln chat`): each user turn gives only the tokens that
/// follow what the cache already holds, rendered by the model's template.
#[derive(Clone, Debug)]
pub struct Conversation {
    /// The model's chat template.
    template: ChatTemplate,
    /// The messages so far, replies as the user saw them.
    messages: Vec<ChatMessage>,
    /// The text the cache holds: the rendered prompts and the reply tokens fed back, in order.
    held: String,
}

/// The prompt of one user turn of a [`Conversation`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnPrompt {
    /// The whole conversation, BOS first: the first turn, or one whose history the template
    /// renders otherwise than the cache holds it (a reply the template trims, one stopped at a
    /// stop string). The caller empties the cache first.
    Whole(Vec<u32>),
    /// Only what follows the cache's text (no BOS; with a reply cut at `max_tokens`, its last
    /// token, which was never fed back, first).
    Continue(Vec<u32>),
}

impl Conversation {
    /// A conversation rendered by `template`, opened by a `system` message if given.
    pub fn new(template: ChatTemplate, system: Option<String>) -> Self {
        let messages = system.map(|s| vec![ChatMessage::new("system", s)]).unwrap_or_default();
        Conversation { template, messages, held: String::new() }
    }

    /// Adds the user's message and returns the turn's prompt, the assistant's turn opened. A
    /// template that rejects the conversation leaves it as it was.
    pub fn user_turn(&mut self, tok: &Tokenizer, text: &str) -> Result<TurnPrompt, TokenizerError> {
        self.messages.push(ChatMessage::new("user", text));
        let full = match self.template.render(&self.messages, true) {
            Ok(full) => full,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        let prompt = match full.strip_prefix(self.held.as_str()) {
            Some(rest) if !self.held.is_empty() => TurnPrompt::Continue(tok.encode_with(rest, false)),
            _ => TurnPrompt::Whole(self.template.encode_rendered(tok, &full)),
        };
        self.held = full;
        Ok(prompt)
    }

    /// Records the assistant's reply: `shown` as the user saw it (the history the template
    /// renders), `fed` the generated tokens the cache holds (all but an ending token never fed back).
    pub fn reply(&mut self, tok: &Tokenizer, shown: &str, fed: &[u32]) {
        self.messages.push(ChatMessage::new("assistant", shown));
        self.held += &tok.decode(fed, false);
    }

    /// For a turn whose prompt does not fit the context: forgets the oldest user message and
    /// reply before the turn's own message (the system message stays) and returns the turn's
    /// prompt again, the whole conversation (the caller empties the cache); `None` when nothing
    /// is left to forget.
    pub fn forget_oldest_exchange(&mut self, tok: &Tokenizer) -> Result<Option<TurnPrompt>, TokenizerError> {
        let first = usize::from(self.messages.first().is_some_and(|m| m.role == "system"));
        // (The turn's own message is the last; an exchange is a user message and its reply.)
        if self.messages.len() < first + 3 {
            return Ok(None);
        }
        self.messages.drain(first..first + 2);
        let full = self.template.render(&self.messages, true)?;
        let ids = self.template.encode_rendered(tok, &full);
        self.held = full;
        Ok(Some(TurnPrompt::Whole(ids)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3's chat template, as published with google/gemma-3-270m-it (tokenizer_config.json).
    const GEMMA3: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

    /// Llama 3's chat template (meta-llama/Meta-Llama-3-8B-Instruct).
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    /// Qwen2's chat template without tools (Qwen/Qwen2-7B-Instruct).
    const QWEN2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi!"),
            ChatMessage::new("assistant", "Hello."),
            ChatMessage::new("user", " What is 2+2?\n"),
        ]
    }

    #[test]
    fn gemma_jinja_template_equals_the_built_in_format() {
        let jinja = ChatTemplate::new(Some(GEMMA3.to_string()), "<bos>", "<eos>").unwrap();
        let builtin = ChatTemplate::new(None, "<bos>", "<eos>").unwrap();
        assert!(jinja.is_jinja() && !builtin.is_jinja());
        for n in 1..=4 {
            let msgs = &conversation()[..n];
            for agp in [false, true] {
                let j = jinja.render(msgs, agp).unwrap();
                assert_eq!(j, format!("<bos>{}", builtin.render(msgs, agp).unwrap()), "{n} messages, {agp}");
            }
        }
    }

    #[test]
    fn llama3_and_qwen2_templates() {
        let llama = ChatTemplate::new(Some(LLAMA3.to_string()), "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let msgs = &conversation()[1..2];
        assert_eq!(
            llama.render(msgs, true).unwrap(),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let qwen = ChatTemplate::new(Some(QWEN2.to_string()), "", "<|im_end|>").unwrap();
        assert_eq!(
            qwen.render(msgs, true).unwrap(),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_conversation_continues_its_cache_until_the_history_renders_otherwise() {
        let tok = crate::tokenizer::tests::tiny(false);
        let enc = |t: &str| tok.encode_with(t, false);
        for (template, bos) in [(None, ""), (Some(GEMMA3.to_string()), "<bos>")] {
            let mut c = Conversation::new(ChatTemplate::new(template, "<bos>", "<eos>").unwrap(), Some("Be brief.".into()));
            // First turn: the whole prompt, BOS once.
            let first = "<start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n";
            let mut want = vec![2];
            want.extend(enc(first));
            assert_eq!(c.user_turn(&tok, "hello").unwrap(), TurnPrompt::Whole(want), "{bos}");
            // The reply was fed back whole: the next turn is only what follows it.
            let reply = enc("hello");
            c.reply(&tok, "hello", &reply);
            let next = "<end_of_turn>\n<start_of_turn>user\nhe<end_of_turn>\n<start_of_turn>model\n";
            assert_eq!(c.user_turn(&tok, "he").unwrap(), TurnPrompt::Continue(enc(next)), "{bos}");
            // A reply whose last token never reached the cache (cut at max_tokens): the next turn
            // feeds it.
            c.reply(&tok, "hello", &reply[..reply.len() - 1]);
            let next = "hello<end_of_turn>\n<start_of_turn>user\nhe<end_of_turn>\n<start_of_turn>model\n";
            assert_eq!(c.user_turn(&tok, "he").unwrap(), TurnPrompt::Continue(enc(next)), "{bos}");
            // A reply the template renders otherwise (trimmed): the whole conversation again.
            c.reply(&tok, "hello\n\n", &enc("hello\n\n"));
            match c.user_turn(&tok, "hello").unwrap() {
                TurnPrompt::Whole(ids) => {
                    let turn = |u: &str, m: &str| format!("<start_of_turn>user\n{u}<end_of_turn>\n<start_of_turn>model\n{m}");
                    let end = "<end_of_turn>\n";
                    let text =
                        format!("<bos>{first}hello{end}{}{end}{}{end}{}", turn("he", "hello"), turn("he", "hello"), turn("hello", ""));
                    assert_eq!(tok.decode(&ids, false), text, "{bos}");
                }
                other => panic!("{bos}: {other:?}"),
            }
        }
        // A template that rejects the conversation leaves it as it was.
        let mut c = Conversation::new(ChatTemplate::new(Some(GEMMA3.to_string()), "<bos>", "<eos>").unwrap(), None);
        c.user_turn(&tok, "hello").unwrap();
        c.messages.push(ChatMessage::new("user", "out of turn"));
        assert!(c.user_turn(&tok, "he").is_err());
        assert_eq!(c.messages.len(), 2);
    }

    #[test]
    fn a_conversation_forgets_its_oldest_exchanges_to_fit() {
        let tok = crate::tokenizer::tests::tiny(false);
        let mut c = Conversation::new(ChatTemplate::new(None, "<bos>", "<eos>").unwrap(), Some("Be brief.".into()));
        c.user_turn(&tok, "hello").unwrap();
        c.reply(&tok, "he", &tok.encode_with("he", false));
        c.user_turn(&tok, "hell").unwrap();
        c.reply(&tok, "lo", &tok.encode_with("lo", false));
        c.user_turn(&tok, "oh").unwrap();
        // The first exchange goes, the system message stays (in the first user turn, as Gemma's
        // format puts it).
        let Some(TurnPrompt::Whole(ids)) = c.forget_oldest_exchange(&tok).unwrap() else { panic!() };
        let want = "<bos><start_of_turn>user\nBe brief.\n\nhell<end_of_turn>\n<start_of_turn>model\nlo<end_of_turn>\n<start_of_turn>user\noh<end_of_turn>\n<start_of_turn>model\n";
        assert_eq!(tok.decode(&ids, false), want);
        // The next reply continues the cache that prompt filled.
        c.reply(&tok, "he", &tok.encode_with("he", false));
        assert!(matches!(c.user_turn(&tok, "h").unwrap(), TurnPrompt::Continue(_)));
        // Then the second, then nothing is left but the system message and the turn's own.
        assert!(c.forget_oldest_exchange(&tok).unwrap().is_some());
        assert!(c.forget_oldest_exchange(&tok).unwrap().is_some());
        assert_eq!(c.forget_oldest_exchange(&tok).unwrap(), None);
        assert_eq!(c.messages.len(), 2);
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_errors() {
        let jinja = ChatTemplate::new(Some(GEMMA3.to_string()), "<bos>", "<eos>").unwrap();
        let bad = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
        let err = jinja.render(&bad, true).unwrap_err().to_string();
        assert!(err.contains("Conversation roles must alternate"), "{err}");
        let err = ChatTemplate::new(Some("{% for %}".into()), "", "").unwrap_err().to_string();
        assert!(err.contains("tokenizer.chat_template does not parse"), "{err}");
    }
}
