//! The embedded Qwen3 chat template rendered with hostile conversations: any roles in any
//! order, contents holding template syntax, special tokens and `<think>`/`<tool_call>` tags,
//! tool calls and tools with odd names, arguments and nesting, with and without the
//! generation prompt and `enable_thinking`.
//!
//! Properties: rendering never panics and fails only with the template's own typed render
//! error; a rendered prompt shows every user turn (without tool calls) verbatim in its own
//! block, never evaluates message text as template code, ends with the
//! assistant opening when asked (with the empty think block for `enable_thinking: false`),
//! and tokenizes into ids that decode back to it.
#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pd_engine::tokenizer::{
    ChatMessage, ChatRole, ChatTemplateOptions, ChatTool, ChatToolCall, Tokenizer, TokenizerError,
};
use serde_json::{Value, json};

#[derive(Debug, Arbitrary)]
struct Conversation {
    messages: Vec<Message>,
    tools: Vec<Tool>,
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
}

#[derive(Debug, Arbitrary)]
struct Message {
    role: u8,
    content: Text,
    calls: Vec<Call>,
}

/// Text: arbitrary, or arbitrary with something the template or the model treats specially.
#[derive(Debug, Arbitrary)]
struct Text {
    piece: u8,
    text: String,
}

const PIECES: [&str; 12] = [
    "{{ messages }}",
    "{% raw %}",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_response>",
    "{{ raise_exception('x') }}",
    "\n\n",
    "{#",
    "\u{0}",
];

impl Text {
    fn get(&self) -> String {
        match PIECES.get(usize::from(self.piece)) {
            Some(p) if self.piece.is_multiple_of(2) => format!("{p}{}", self.text),
            Some(p) => format!("{}{p}", self.text),
            None => self.text.clone(),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Call {
    name: Text,
    arguments: Args,
    flat: bool,
}

#[derive(Debug, Arbitrary)]
enum Args {
    Text(Text),
    Object(Vec<(String, Json)>),
}

#[derive(Debug, Arbitrary)]
enum Json {
    Null,
    Bool(bool),
    Number(i64),
    Float(f64),
    String(Text),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    fn value(&self, depth: usize) -> Value {
        if depth > 8 {
            return Value::Null;
        }
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => json!(b),
            Json::Number(n) => json!(n),
            Json::Float(f) => json!(f),
            Json::String(t) => json!(t.get()),
            Json::Array(items) => Value::Array(items.iter().map(|j| j.value(depth + 1)).collect()),
            Json::Object(fields) => object(fields, depth + 1),
        }
    }
}

fn object(fields: &[(String, Json)], depth: usize) -> Value {
    Value::Object(
        fields
            .iter()
            .map(|(k, v)| (k.clone(), v.value(depth)))
            .collect(),
    )
}

#[derive(Debug, Arbitrary)]
enum Tool {
    Function {
        name: Text,
        description: Option<Text>,
        parameters: Vec<(String, Json)>,
    },
    Raw(Vec<(String, Json)>),
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::qwen3().expect("the embedded Qwen3 tokenizer"))
}

fuzz_target!(|c: Conversation| {
    let messages: Vec<ChatMessage> = c
        .messages
        .iter()
        .take(16)
        .map(|m| {
            let role = ChatRole::ALL[usize::from(m.role) % ChatRole::ALL.len()];
            let mut message = ChatMessage::new(role, m.content.get());
            message.tool_calls = m
                .calls
                .iter()
                .take(4)
                .map(|call| {
                    let arguments = match &call.arguments {
                        Args::Text(t) => json!(t.get()),
                        Args::Object(fields) => object(fields, 0),
                    };
                    let function = json!({"name": call.name.get(), "arguments": arguments});
                    let value = if call.flat {
                        function
                    } else {
                        json!({"id": "call_0", "type": "function", "function": function})
                    };
                    ChatToolCall::from_json(&value.to_string()).expect("a well-formed call")
                })
                .collect();
            message
        })
        .collect();
    let tools = c
        .tools
        .iter()
        .take(4)
        .map(|t| {
            let value = match t {
                Tool::Function {
                    name,
                    description,
                    parameters,
                } => json!({"type": "function", "function": {
                    "name": name.get(),
                    "description": description.as_ref().map(Text::get),
                    "parameters": object(parameters, 0),
                }}),
                Tool::Raw(fields) => object(fields, 0),
            };
            ChatTool::from_json(&value.to_string()).expect("a JSON object is a tool")
        })
        .collect();
    let options = ChatTemplateOptions {
        add_generation_prompt: c.add_generation_prompt,
        enable_thinking: c.enable_thinking,
        tools,
    };
    let t = tokenizer();
    let text = match t.apply_chat_template_with(&messages, &options) {
        Ok(text) => text,
        Err(TokenizerError::ChatTemplateRender { .. }) => return,
        Err(e) => panic!("the built-in template failed with {e:?}"),
    };
    for m in &messages {
        // (Tool calls follow a turn's content, whatever its role.)
        if m.role == ChatRole::User && m.tool_calls.is_empty() {
            let block = format!("<|im_start|>user\n{}<|im_end|>\n", m.content);
            assert!(
                text.contains(&block),
                "a user turn is shown verbatim: {block:?} in {text:?}"
            );
        }
    }
    if c.add_generation_prompt {
        let end = if c.enable_thinking == Some(false) {
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        } else {
            "<|im_start|>assistant\n"
        };
        assert!(text.ends_with(end), "the prompt ends with {end:?}");
    }
    let ids = t.encode(&text).expect("a rendered prompt tokenizes");
    let back = t.decode(&ids, false).expect("its ids decode");
    use unicode_normalization::UnicodeNormalization;
    assert_eq!(
        back,
        text.nfc().collect::<String>(),
        "the prompt's ids decode back to it"
    );
});
