//! Chat templates: the built-in Qwen3 ChatML template and templates from model directories.

use std::path::Path;

use pd_engine::tokenizer::{
    ChatMessage, ChatRole, ChatTemplateOptions, ChatTool, ChatToolCall, QWEN3_TOKENIZER_JSON,
    Tokenizer, TokenizerError,
};

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new(ChatRole::System, "You are a helpful assistant."),
        ChatMessage::new(ChatRole::User, "What is 2+2?"),
    ]
}

const RENDERED: &str = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                        <|im_start|>user\nWhat is 2+2?<|im_end|>\n";

fn options(add_generation_prompt: bool, enable_thinking: Option<bool>) -> ChatTemplateOptions {
    ChatTemplateOptions {
        add_generation_prompt,
        enable_thinking,
        ..ChatTemplateOptions::default()
    }
}

/// A model directory with the Qwen3 tokenizer.json and the given extra files.
fn model_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), QWEN3_TOKENIZER_JSON).unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn config_with_template(template: &str) -> String {
    serde_json::json!({
        "eos_token": "<|im_end|>",
        "bos_token": null,
        "pad_token": {"content": "<|endoftext|>", "special": true},
        "chat_template": template,
    })
    .to_string()
}

#[test]
fn system_and_user_without_generation_prompt() {
    let tok = Tokenizer::qwen3().unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), false).unwrap(),
        RENDERED
    );
}

#[test]
fn system_and_user_with_generation_prompt() {
    let tok = Tokenizer::qwen3().unwrap();
    let expected = format!("{RENDERED}<|im_start|>assistant\n");
    assert_eq!(
        tok.apply_chat_template(&conversation(), true).unwrap(),
        expected
    );
    // enable_thinking = true is the same as leaving it undefined.
    assert_eq!(
        tok.apply_chat_template_with(&conversation(), &options(true, Some(true)))
            .unwrap(),
        expected
    );
}

#[test]
fn enable_thinking_false_adds_an_empty_think_block() {
    let tok = Tokenizer::qwen3().unwrap();
    assert_eq!(
        tok.apply_chat_template_with(&conversation(), &options(true, Some(false)))
            .unwrap(),
        format!("{RENDERED}<|im_start|>assistant\n<think>\n\n</think>\n\n")
    );
    // Without a generation prompt there is nothing to append to.
    assert_eq!(
        tok.apply_chat_template_with(&conversation(), &options(false, Some(false)))
            .unwrap(),
        RENDERED
    );
}

#[test]
fn every_role_and_multi_turn() {
    let tok = Tokenizer::qwen3().unwrap();
    let messages = vec![
        ChatMessage::new(ChatRole::User, "Weather in Paris?"),
        ChatMessage::new(ChatRole::Assistant, "<tool_call>\n{}\n</tool_call>"),
        ChatMessage::new(ChatRole::Tool, "{\"temp\": 21}"),
        ChatMessage::new(ChatRole::Assistant, "21 °C, sunny."),
    ];
    assert_eq!(
        tok.apply_chat_template(&messages, false).unwrap(),
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>\n\
         <|im_start|>tool\n{\"temp\": 21}<|im_end|>\n\
         <|im_start|>assistant\n21 °C, sunny.<|im_end|>\n"
    );
    assert_eq!(
        tok.apply_chat_template(&[], true).unwrap(),
        "<|im_start|>assistant\n"
    );
}

#[test]
fn rendered_prompt_tokenizes_with_control_tokens() {
    let tok = Tokenizer::qwen3().unwrap();
    let prompt = tok.apply_chat_template(&conversation(), true).unwrap();
    let ids = tok.encode(&prompt).unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 2);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}

#[test]
fn unknown_role_is_refused_with_a_clear_error() {
    for role in ["system", "user", "assistant", "tool"] {
        assert_eq!(role.parse::<ChatRole>().unwrap().as_str(), role);
    }
    let err = "wizard".parse::<ChatRole>().unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnknownChatRole { role } if role == "wizard"),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains("`wizard`"), "{message}");
    assert!(
        message.contains("system, user, assistant, tool"),
        "{message}"
    );
    assert!("User".parse::<ChatRole>().is_err(), "roles are lowercase");
}

#[test]
fn built_in_template_refuses_unknown_roles_itself() {
    // The committed template is also used by Jinja2 (transformers), where roles are free
    // strings. Rendering it with a role outside the enum must raise its own error.
    let built_in: serde_json::Value =
        serde_json::from_str(pd_engine::tokenizer::QWEN3_TOKENIZER_CONFIG_JSON).unwrap();
    let template = built_in["chat_template"].as_str().unwrap();
    let patched = template.replace(
        "message['role']",
        "(message['role'] | replace('tool', 'robot'))",
    );
    let dir = model_dir(&[("tokenizer_config.json", &config_with_template(&patched))]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let err = tok
        .apply_chat_template(&[ChatMessage::new(ChatRole::Tool, "x")], false)
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::ChatTemplateRender { .. }),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains("unknown chat role \"robot\""), "{message}");
    assert!(message.contains("tokenizer_config.json"), "{message}");
}

#[test]
fn from_dir_uses_the_directory_template() {
    let template = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}\
                    {% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}";
    let dir = model_dir(&[("tokenizer_config.json", &config_with_template(template))]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), true).unwrap(),
        "[SYSTEM] You are a helpful assistant.\n[USER] What is 2+2?\n[ASSISTANT]<|im_end|>"
    );
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.vocab_size(), 151_669);
}

#[test]
fn from_dir_prefers_chat_template_jinja() {
    let dir = model_dir(&[
        (
            "tokenizer_config.json",
            &config_with_template("from config"),
        ),
        ("chat_template.jinja", "from file: {{ messages | length }}"),
    ]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), false).unwrap(),
        "from file: 2"
    );
}

#[test]
fn from_dir_reads_named_templates() {
    let config = serde_json::json!({
        "eos_token": "<|endoftext|>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default {{ messages[0].content }}"},
        ],
    });
    let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), false).unwrap(),
        "default You are a helpful assistant."
    );
    assert_eq!(tok.eos_token_id(), Some(151_643));
}

#[test]
fn from_dir_falls_back_to_the_built_in_template() {
    let builtin = Tokenizer::qwen3().unwrap();
    let expected = builtin.apply_chat_template(&conversation(), true).unwrap();

    let no_template = serde_json::json!({"eos_token": "<|im_end|>"}).to_string();
    let dir = model_dir(&[("tokenizer_config.json", &no_template)]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), true).unwrap(),
        expected
    );

    // No tokenizer_config.json at all: built-in template, no eos token.
    let dir = model_dir(&[]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&conversation(), true).unwrap(),
        expected
    );
    assert_eq!(tok.eos_token_id(), None);
}

#[test]
fn python_style_methods_and_tojson() {
    let template = "{%- for m in messages -%}\
        {%- if m.content.startswith('<think>') -%}\
        {{ m.content.split('</think>')[-1].lstrip('\\n') }}|\
        {%- else -%}\
        {{ m.content.strip().replace(' ', '_') }}|\
        {%- endif -%}\
        {%- endfor -%}\
        {%- for k, v in {'b': 1, 'a': [1, 'é<>']}.items() -%}{{ k }}={{ v | tojson }};{%- endfor -%}\
        {{ {'x': {'y': none}} | tojson }}";
    let dir = model_dir(&[("tokenizer_config.json", &config_with_template(template))]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let messages = vec![
        ChatMessage::new(ChatRole::Assistant, "<think>\nhmm\n</think>\n\nAnswer"),
        ChatMessage::new(ChatRole::User, "  two words  "),
    ];
    // Dicts keep their insertion order, as Python's do (`b` before `a`).
    assert_eq!(
        tok.apply_chat_template(&messages, false).unwrap(),
        "Answer|two_words|b=1;a=[1, \"é<>\"];{\"x\": {\"y\": null}}"
    );
}

#[test]
fn template_errors_name_their_origin() {
    let dir = model_dir(&[(
        "tokenizer_config.json",
        &config_with_template("{% for m in messages %}unclosed"),
    )]);
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(err, TokenizerError::ChatTemplateSyntax { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

    let dir = model_dir(&[(
        "tokenizer_config.json",
        &config_with_template("{{ raise_exception('no system prompts, please') }}"),
    )]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let err = tok.apply_chat_template(&conversation(), false).unwrap_err();
    assert!(
        err.to_string().contains("no system prompts, please"),
        "{err}"
    );
}

#[test]
fn bad_model_directories_name_the_file_at_fault() {
    let missing = Path::new("/nonexistent/model/dir");
    let err = Tokenizer::from_dir(missing).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("/nonexistent/model/dir/tokenizer.json"),
        "{err}"
    );

    let dir = model_dir(&[("tokenizer_config.json", "{not json")]);
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::Json { .. }), "{err:?}");

    let config = serde_json::json!({"eos_token": "<|no_such_token|>"}).to_string();
    let dir = model_dir(&[("tokenizer_config.json", &config)]);
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    match &err {
        TokenizerError::Config { field, .. } => assert_eq!(field, "eos_token"),
        other => panic!("expected a Config error, got {other:?}"),
    }
    assert!(err.to_string().contains("<|no_such_token|>"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"version\": \"1.0\"}").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(err, TokenizerError::TokenizerJson { .. }),
        "{err:?}"
    );

    // Decoding is byte-level; a tokenizer with another decoder is refused up front.
    let byte_level = "\"decoder\": {\n    \"add_prefix_space\": false,\n    \"trim_offsets\": false,\n    \
                      \"type\": \"ByteLevel\",\n    \"use_regex\": false\n  }";
    assert!(QWEN3_TOKENIZER_JSON.contains(byte_level));
    let fused = QWEN3_TOKENIZER_JSON.replacen(byte_level, "\"decoder\": {\"type\": \"Fuse\"}", 1);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), fused).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnsupportedDecoder { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("`Fuse`"), "{err}");
}

/// One function tool, its keys deliberately not in alphabetical order.
const TOOL: &str = r#"{"type": "function", "function": {"name": "get_weather",
    "description": "Weather in a city, °C", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;

#[test]
fn the_built_in_template_lists_tools_as_jinja2_renders_them() {
    // tools/tokenizer/verify_against_tiktoken.py renders the same with Python's Jinja2 and
    // transformers' tojson (TOOLS_RENDERED there).
    let expected = "<|im_start|>system\nYou are terse.\n\n# Tools\n\nThese functions are \
        available, one JSON signature per line inside <tools></tools>:\n<tools>\n\
        {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \
        \"Weather in a city, °C\", \"parameters\": {\"type\": \"object\", \"properties\": \
        {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nTo call a \
        function, reply with a JSON object of its name and arguments inside \
        <tool_call></tool_call> tags, one call per pair of tags:\n<tool_call>\n{\"name\": \
        <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call><|im_end|>\n\
        <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n";
    let tok = Tokenizer::qwen3().unwrap();
    let messages = vec![
        ChatMessage::new(ChatRole::System, "You are terse."),
        ChatMessage::new(ChatRole::User, "Hi!"),
    ];
    let with_tools = ChatTemplateOptions {
        add_generation_prompt: true,
        tools: vec![ChatTool::from_json(TOOL).unwrap()],
        ..ChatTemplateOptions::default()
    };
    assert_eq!(
        tok.apply_chat_template_with(&messages, &with_tools)
            .unwrap(),
        expected
    );
    // Without tools, nothing changes.
    assert_eq!(
        tok.apply_chat_template(&messages, true).unwrap(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn a_model_template_sees_tools_in_their_own_key_order() {
    let template = "{%- if tools -%}{%- for t in tools -%}{{ t | tojson }}|\
        {{ t.function | tojson(sort_keys=true) }}|{{ t.function.name }}{%- endfor -%}\
        {%- else -%}none{%- endif -%}";
    let dir = model_dir(&[("tokenizer_config.json", &config_with_template(template))]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let tools = ChatTemplateOptions {
        tools: vec![
            ChatTool::from_json(r#"{"z": 1, "function": {"name": "f", "a": [2]}}"#).unwrap(),
        ],
        ..ChatTemplateOptions::default()
    };
    assert_eq!(
        tok.apply_chat_template_with(&conversation(), &tools)
            .unwrap(),
        r#"{"z": 1, "function": {"name": "f", "a": [2]}}|{"a": [2], "name": "f"}|f"#
    );
    assert_eq!(
        tok.apply_chat_template_with(&conversation(), &ChatTemplateOptions::default())
            .unwrap(),
        "none"
    );
    for bad in ["[1]", "\"f\"", "{", ""] {
        assert!(ChatTool::from_json(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn assistant_tool_calls_render_as_jinja2_renders_them() {
    // CALLS / CALLS_RENDERED in tools/tokenizer/verify_against_tiktoken.py: the same text
    // from Python's Jinja2. Arguments as OpenAI's JSON text, then as an object.
    let tok = Tokenizer::qwen3().unwrap();
    let mut assistant = ChatMessage::new(ChatRole::Assistant, "");
    assistant.tool_calls = vec![
        ChatToolCall::from_json(
            r#"{"id": "c1", "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\": \"Paris\"}"}}"#,
        )
        .unwrap(),
        ChatToolCall::from_json(
            r#"{"type": "function", "function": {"name": "get_weather",
                "arguments": {"city": "Lyon"}}}"#,
        )
        .unwrap(),
    ];
    let messages = vec![
        ChatMessage::new(ChatRole::User, "Weather in Paris and Lyon?"),
        assistant,
        ChatMessage::new(ChatRole::Tool, "18"),
    ];
    assert_eq!(
        tok.apply_chat_template(&messages, true).unwrap(),
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n<|im_start|>assistant\n\
         <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
         </tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \
         \"Lyon\"}}\n</tool_call><|im_end|>\n<|im_start|>tool\n18<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // A model's own template sees them as `message.tool_calls`, keys in their order.
    let template = "{%- for m in messages -%}{%- for c in m.tool_calls or [] -%}\
        {{ c.function.name }}:{{ c.function.arguments is string }}:{{ c | tojson }};\
        {%- endfor -%}{%- endfor -%}";
    let dir = model_dir(&[("tokenizer_config.json", &config_with_template(template))]);
    let custom = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        custom.apply_chat_template(&messages, false).unwrap(),
        "get_weather:True:{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \
         \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}};\
         get_weather:False:{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \
         \"arguments\": {\"city\": \"Lyon\"}}};"
    );
}

#[test]
fn malformed_tool_calls_are_refused_with_what_is_missing() {
    for (json, want) in [
        ("[1]", "JSON object"),
        (r#"{"function": {"arguments": "{}"}}"#, "string `name`"),
        (r#"{"function": {"name": "f"}}"#, "`arguments`"),
        (
            r#"{"function": {"name": "f", "arguments": 3}}"#,
            "`arguments`",
        ),
        ("{", "not valid JSON"),
    ] {
        let err = ChatToolCall::from_json(json).unwrap_err();
        assert!(err.contains(want), "{json}: {err}");
    }
}
