//! Chat prompt formatting.

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    /// "system", "user" or "assistant" (written as "model"); other roles are written as given.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Formats `messages` with Gemma 3's chat template (without the `<bos>` text; `encode` adds BOS).
///
/// Each message becomes `<start_of_turn>{role}\n{content}<end_of_turn>\n`, with "assistant" written
/// as "model" and the content trimmed of surrounding whitespace. A leading "system" message is not
/// a turn of its own: its content plus "\n\n" is prepended to the first following message (so a
/// conversation of only a system message renders nothing for it, as the template does).
/// `add_generation_prompt` appends `<start_of_turn>model\n`.
pub fn gemma_chat_prompt(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let (prefix, turns) = match messages.split_first() {
        Some((first, rest)) if first.role == "system" => (format!("{}\n\n", first.content), rest),
        _ => (String::new(), messages),
    };
    let mut out = String::new();
    for (i, m) in turns.iter().enumerate() {
        let role = if m.role == "assistant" { "model" } else { m.role.as_str() };
        out.push_str("<start_of_turn>");
        out.push_str(role);
        out.push('\n');
        if i == 0 {
            out.push_str(&prefix);
        }
        out.push_str(m.content.trim());
        out.push_str("<end_of_turn>\n");
    }
    if add_generation_prompt {
        out.push_str("<start_of_turn>model\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_model_user() {
        let msgs = [ChatMessage::new("user", "Hi!"), ChatMessage::new("assistant", "Hello."), ChatMessage::new("user", " What is 2+2?\n")];
        assert_eq!(
            gemma_chat_prompt(&msgs, true),
            "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(gemma_chat_prompt(&msgs[..1], false), "<start_of_turn>user\nHi!<end_of_turn>\n");
    }

    #[test]
    fn system_goes_into_first_user_turn() {
        let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")];
        assert_eq!(gemma_chat_prompt(&msgs, true), "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
        assert_eq!(gemma_chat_prompt(&msgs[..1], true), "<start_of_turn>model\n");
        assert_eq!(gemma_chat_prompt(&[], false), "");
    }
}
