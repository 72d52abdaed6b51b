//! The body translation: shapes, refusals, fan-out, fields on the wire.

use super::*;
use serde_json::json;

fn plan(endpoint: Endpoint, body: Value) -> Result<Plan, BadRequest> {
    Body::parse(body.to_string().as_bytes())?.plan(endpoint, None, || "r".to_string())
}

fn completions(body: Value) -> Result<Plan, BadRequest> {
    plan(Endpoint::Completions, body)
}

fn chat(body: Value) -> Result<Plan, BadRequest> {
    plan(Endpoint::ChatCompletions, body)
}

fn refused(result: Result<Plan, BadRequest>) -> String {
    result.expect_err("refused").0
}

fn sampling(p: &Plan, i: usize) -> &pb::SamplingParams {
    p.requests[i].sampling.as_ref().unwrap()
}

#[test]
fn prompts_of_every_shape_fan_out_prompt_major_with_seeds_per_choice() {
    let p = completions(json!({"prompt": "hi"})).unwrap();
    assert_eq!(p.requests.len(), 1);
    assert_eq!(p.requests[0].request_id.as_deref(), Some("r"));
    assert_eq!(p.requests[0].max_tokens, Some(16), "OpenAI's default");
    let p = completions(json!({"prompt": [[1, 2], [3]], "n": 2, "seed": 9})).unwrap();
    let ids: Vec<_> = p
        .requests
        .iter()
        .map(|r| r.request_id.clone().unwrap())
        .collect();
    assert_eq!(ids, ["r-0", "r-1", "r-2", "r-3"]);
    assert_eq!(
        p.requests[2].input,
        Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
            ids: vec![3]
        }))
    );
    let seeds: Vec<_> = (0..4).map(|i| sampling(&p, i).seed.unwrap()).collect();
    assert_eq!(seeds, [9, 10, 9, 10]);
    assert_eq!(
        completions(json!({"prompt": [5, 6]})).unwrap().prompts,
        [Prompt::Ids(vec![5, 6])]
    );
    assert_eq!(
        completions(json!({"prompt": ["a", "b"]}))
            .unwrap()
            .prompts
            .len(),
        2
    );
    for bad_prompt in [
        json!([]),
        json!([1, "a"]),
        json!([-1]),
        json!(3),
        json!([{}]),
    ] {
        assert!(refused(completions(json!({"prompt": bad_prompt}))).contains("prompt"));
    }
    assert!(refused(completions(json!({"prompt": "x", "n": 17}))).contains("n must be"));
    let many = vec!["x"; 8];
    assert!(refused(completions(json!({"prompt": many, "n": 9}))).contains("72 generations"));
}

#[test]
fn fields_are_refused_by_name_when_unknown_or_on_the_other_endpoint() {
    assert!(refused(completions(json!({"prompt": "x", "temprature": 1}))).contains("temprature"));
    assert!(refused(completions(json!({"messages": []}))).contains("/v1/chat/completions"));
    assert!(refused(chat(json!({"messages": [], "echo": true}))).contains("/v1/completions"));
    assert!(refused(completions(json!({"max_tokens": 3}))).contains("`prompt` is required"));
    assert!(refused(chat(json!({}))).contains("`messages` is required"));
    assert!(refused(completions(json!({"prompt": "x", "best_of": 2}))).contains("best_of"));
    assert!(refused(completions(json!({"prompt": "x", "suffix": "y"}))).contains("suffix"));
    assert!(
        refused(completions(
            json!({"prompt": "x", "stream_options": {"include_usage": true}})
        ))
        .contains("stream=true")
    );
    // OpenAI's fields that change nothing here are accepted.
    assert!(completions(json!({"prompt": "x", "user": "u", "best_of": 1})).is_ok());
}

#[test]
fn continuous_usage_stats_needs_include_usage_as_in_vllm() {
    let options = |o: Value| {
        let p = chat(json!({"messages": [], "stream": true, "stream_options": o})).unwrap();
        (p.include_usage, p.continuous_usage)
    };
    assert_eq!(
        options(json!({"include_usage": true, "continuous_usage_stats": true})),
        (true, true)
    );
    assert_eq!(options(json!({"include_usage": true})), (true, false));
    // Without include_usage it is ignored, as vLLM ignores it.
    assert_eq!(
        options(json!({"continuous_usage_stats": true})),
        (false, false)
    );
    assert_eq!(
        options(json!({"include_usage": false, "continuous_usage_stats": true})),
        (false, false)
    );
    assert!(
        refused(completions(json!({
            "prompt": "x", "stream_options": {"continuous_usage_stats": true}
        })))
        .contains("stream=true")
    );
}

#[test]
fn sampling_fields_reach_the_wire() {
    let p = completions(json!({
        "prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
        "min_tokens": 2, "seed": -1, "logit_bias": {"42": -100}, "allowed_token_ids": [1, 42],
        "bad_words": ["no"], "stop": "\n", "stop_token_ids": [7], "ignore_eos": true,
        "include_stop_str_in_output": true, "truncate_prompt_tokens": 5, "cache_salt": "s",
        "max_tokens": 9, "prompt_logprobs": 2, "skip_special_tokens": false,
        "spaces_between_special_tokens": true,
    }))
    .unwrap();
    let r = &p.requests[0];
    let s = sampling(&p, 0);
    assert_eq!(
        (s.temperature, s.top_p, s.top_k),
        (Some(0.5), Some(0.9), None)
    );
    assert_eq!(s.seed, Some(u64::MAX));
    assert_eq!(s.logit_bias.get(&42), Some(&-100.0));
    assert_eq!(s.allowed_token_ids, [1, 42]);
    assert_eq!(s.prompt_logprobs, Some(2));
    assert_eq!(r.bad_words, ["no"]);
    assert_eq!(r.stop, ["\n"]);
    assert_eq!(r.stop_token_ids, [7]);
    assert!(r.ignore_eos && r.include_stop_str_in_output);
    assert_eq!(r.skip_special_tokens, Some(false));
    assert_eq!(r.truncate_prompt_tokens, Some(5));
    assert_eq!(r.cache_salt.as_deref(), Some("s"));
    assert_eq!(r.max_tokens, Some(9));
    assert!(p.prompt_logprobs);
    assert!(refused(completions(json!({"prompt": "x", "top_k": -2}))).contains("top_k"));
    assert!(
        refused(completions(json!({"prompt": "x", "logit_bias": {"a": 1}}))).contains("token ids")
    );
    assert!(refused(completions(json!({"prompt": "x", "stop": 3}))).contains("stop"));
}

#[test]
fn logprobs_take_each_endpoints_shape_and_echo_scores_the_prompt() {
    assert_eq!(
        completions(json!({"prompt": "x", "logprobs": 3}))
            .unwrap()
            .logprobs,
        Some(3)
    );
    assert!(refused(completions(json!({"prompt": "x", "logprobs": true}))).contains("integer"));
    let p = chat(json!({"messages": [], "logprobs": true, "top_logprobs": 4})).unwrap();
    assert_eq!((p.logprobs, sampling(&p, 0).logprobs), (Some(4), Some(4)));
    assert_eq!(
        chat(json!({"messages": [], "logprobs": true}))
            .unwrap()
            .logprobs,
        Some(0)
    );
    assert!(refused(chat(json!({"messages": [], "logprobs": 2}))).contains("boolean"));
    assert!(refused(chat(json!({"messages": [], "top_logprobs": 2}))).contains("logprobs=true"));
    let p = completions(json!({"prompt": "x", "echo": true, "logprobs": 2})).unwrap();
    assert!(p.echo);
    assert_eq!(sampling(&p, 0).prompt_logprobs, Some(2));
    assert!(
        !p.prompt_logprobs,
        "the echo's scores are not vLLM's prompt_logprobs field"
    );
}

#[test]
fn chat_messages_tools_and_template_options() {
    let p = chat(json!({
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": false},
        "max_completion_tokens": 7, "max_tokens": 99,
    }))
    .unwrap();
    let Some(pb::generate_request::Input::Chat(c)) = &p.requests[0].input else {
        panic!("chat input");
    };
    let roles: Vec<_> = c.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    assert_eq!(c.messages[1].content, "ab");
    assert_eq!(c.messages[2].content, "");
    assert_eq!(c.enable_thinking, Some(false));
    assert_eq!(c.tools.len(), 1);
    assert_eq!(
        p.requests[0].max_tokens,
        Some(7),
        "max_completion_tokens wins"
    );
    assert_eq!(
        chat(json!({"messages": []})).unwrap().requests[0].max_tokens,
        None
    );
    let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]});
    assert!(refused(chat(image)).contains("only text"));
    let calls = json!({"messages": [{"role": "user", "tool_calls": [{}]}]});
    assert!(refused(chat(calls)).contains("only for role \"assistant\""));
    let call = json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let calls = json!({"messages": [
        {"role": "assistant", "content": null, "tool_calls": [call], "reasoning_content": "r"},
    ]});
    let Some(pb::generate_request::Input::Chat(c)) = &chat(calls).unwrap().requests[0].input else {
        panic!("chat input");
    };
    assert_eq!(c.messages[0].tool_calls, [call.to_string()]);
    let required = json!({"messages": [], "tool_choice": "required"});
    assert!(refused(chat(required)).contains("tool_choice"));
    let kwargs = json!({"messages": [], "chat_template_kwargs": {"foo": 1}});
    assert!(refused(chat(kwargs)).contains("chat_template_kwargs.foo"));
}

#[test]
fn one_structured_output_from_any_of_its_spellings() {
    use pb::structured_output::Kind;
    let kind = |body: Value| {
        chat(body).unwrap().requests[0]
            .sampling
            .as_ref()
            .unwrap()
            .structured_output
            .clone()
            .and_then(|s| s.kind)
    };
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        kind(json!({"messages": [], "guided_regex": "[0-9]+"})),
        Some(Kind::Regex("[0-9]+".into()))
    );
    assert_eq!(
        kind(json!({"messages": [], "structured_outputs": {"choice": ["y", "n"]}})),
        Some(Kind::Choice(pb::Choices {
            choices: vec!["y".into(), "n".into()]
        }))
    );
    assert_eq!(
        kind(json!({"messages": [], "guided_json": schema})),
        Some(Kind::JsonSchema(schema.to_string()))
    );
    assert_eq!(
        kind(
            json!({"messages": [], "response_format": {"type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": true}}})
        ),
        Some(Kind::JsonSchema(schema.to_string()))
    );
    assert_eq!(
        kind(json!({"messages": [], "response_format": {"type": "json_object"}})),
        Some(Kind::JsonObject(true))
    );
    assert_eq!(
        kind(json!({"messages": [], "structured_outputs": {"json_object": true}})),
        Some(Kind::JsonObject(true))
    );
    assert_eq!(
        kind(json!({"messages": [], "structured_outputs": {"json_object": false}})),
        None
    );
    let two = json!({"messages": [], "guided_regex": "a",
        "response_format": {"type": "json_object"}});
    assert!(refused(chat(two)).contains("guided_regex and response_format"));
    assert_eq!(
        kind(json!({"messages": [], "response_format": {"type": "text"}})),
        None
    );
    let both = json!({"messages": [], "guided_regex": "a", "guided_choice": ["b"]});
    assert!(refused(chat(both)).contains("guided_regex and guided_choice"));
    let gbnf = "root ::= [a-z]+";
    for field in [
        json!({"structured_outputs": {"grammar": gbnf}}),
        json!({"guided_grammar": gbnf}),
        json!({"ebnf": gbnf}),
    ] {
        let mut body = json!({"messages": []});
        body.as_object_mut()
            .unwrap()
            .extend(field.as_object().unwrap().clone());
        assert_eq!(kind(body), Some(Kind::Grammar(gbnf.into())));
    }
    let two = json!({"messages": [], "guided_grammar": gbnf, "ebnf": gbnf});
    assert!(refused(chat(two)).contains("guided_grammar and ebnf"));
    let unknown = json!({"messages": [], "response_format": {"type": "grammar"}});
    assert!(refused(chat(unknown)).contains("grammar"));
}

#[test]
fn the_header_id_names_the_request_before_the_body_id() {
    let body = Body::parse(br#"{"prompt": "x", "request_id": "body"}"#).unwrap();
    let p = body.plan(
        Endpoint::Completions,
        Some("head".into()),
        || unreachable!(),
    );
    assert_eq!(p.unwrap().id, "head");
    let body = Body::parse(br#"{"prompt": "x", "request_id": "body"}"#).unwrap();
    let p = body.plan(Endpoint::Completions, None, || unreachable!());
    assert_eq!(p.unwrap().id, "body");
}

#[test]
fn an_answer_sent_back_whole_is_accepted_and_bad_messages_are_named() {
    // What the `openai` client's `message.model_dump()` gives for an answer.
    let answer = json!({"role": "assistant", "content": "Hi", "refusal": null, "annotations": [],
        "audio": null, "function_call": null, "tool_calls": null});
    let p = chat(json!({"messages": [{"role": "user", "content": "x"}, answer]})).unwrap();
    let Some(pb::generate_request::Input::Chat(c)) = &p.requests[0].input else {
        panic!("chat input");
    };
    assert_eq!(c.messages[1].content, "Hi");
    let audio = json!({"messages": [{"role": "assistant", "audio": {"id": "a"}}]});
    assert!(refused(chat(audio)).contains("messages[0].audio"));
    let unknown =
        json!({"messages": [{"role": "user", "content": "x"}, {"role": "user", "colour": 1}]});
    let message = refused(chat(unknown));
    assert!(
        message.contains("messages[1]: unknown field `colour`"),
        "{message}"
    );
    assert!(!message.contains("expected one of"), "{message}");
}

#[test]
fn a_forcing_tool_choice_guides_the_answer_into_one_call() {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "now"}},
        {"type": "function", "function": {"name": "ping", "parameters":
            {"type": "object", "properties": {}}}},
    ]);
    let regex_of = |choice: Value| -> String {
        let p = chat(json!({"messages": [], "tools": tools, "tool_choice": choice})).unwrap();
        assert!(p.forced_tool && p.tools);
        match sampling(&p, 0)
            .structured_output
            .clone()
            .and_then(|s| s.kind)
        {
            Some(pb::structured_output::Kind::Regex(r)) => r,
            other => panic!("a regex, got {other:?}"),
        }
    };
    let named = regex_of(json!({"type": "function", "function": {"name": "get_weather"}}));
    let re = regex::Regex::new(&format!("^{named}$")).unwrap();
    assert!(re.is_match(
        "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
    ));
    assert!(!re.is_match("<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>"));
    assert!(!re.is_match("{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}"));
    let any = regex::Regex::new(&format!("^{}$", regex_of(json!("required")))).unwrap();
    assert!(any.is_match("<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>"));
    // `required`: one call or more, a newline after each; a named function: once.
    let two = "<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>\n\
               <tool_call>\n{\"name\":\"ping\",\"arguments\":{}}\n</tool_call>";
    assert!(any.is_match(two));
    let now = regex_of(json!({"type": "function", "function": {"name": "now"}}));
    assert!(
        !regex::Regex::new(&format!("^{now}$"))
            .unwrap()
            .is_match(two)
    );
    assert!(any.is_match(
        "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"x\"}}\n</tool_call>"
    ));
    // `parallel_tool_calls: false`: `required` is exactly one call, of any tool.
    let p = chat(
        json!({"messages": [], "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": false}),
    )
    .unwrap();
    assert!(!p.parallel_tool_calls);
    let Some(pb::structured_output::Kind::Regex(single)) = sampling(&p, 0)
        .structured_output
        .clone()
        .and_then(|s| s.kind)
    else {
        panic!("a regex")
    };
    let single = regex::Regex::new(&format!("^{single}$")).unwrap();
    assert!(single.is_match("<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>"));
    assert!(!single.is_match(two));
    // A tool declared with empty properties takes no arguments: its call is small enough
    // for a guide (any object would not be).
    let ping = regex_of(json!({"type": "function", "function": {"name": "ping"}}));
    let re = regex::Regex::new(&format!("^{ping}$")).unwrap();
    assert!(re.is_match("<tool_call>\n{\"name\":\"ping\",\"arguments\":{}}\n</tool_call>"));
    assert!(!re.is_match("<tool_call>\n{\"name\":\"ping\",\"arguments\":{\"a\":1}}\n</tool_call>"));
    assert!(ping.len() < 500, "{ping}");
    for choice in [json!("auto"), json!("none")] {
        let p = chat(json!({"messages": [], "tools": tools, "tool_choice": choice})).unwrap();
        assert!(!p.forced_tool && sampling(&p, 0).structured_output.is_none());
    }
    let unknown = json!({"messages": [], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}});
    assert!(refused(chat(unknown)).contains("`nope`, which is not in tools"));
    let both =
        json!({"messages": [], "tools": tools, "tool_choice": "required", "guided_regex": "a"});
    assert!(refused(chat(both)).contains("leave out the structured output"));
    assert!(refused(chat(json!({"messages": [], "tool_choice": 3}))).contains("tool_choice"));
}
