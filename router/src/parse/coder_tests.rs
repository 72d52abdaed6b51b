//! Qwen3-Coder's calls (`--tool-call-parser qwen3_coder`): vLLM's cases and the edges of
//! its format, whole and streamed.

use super::*;
use serde_json::{Value, json};

fn tools() -> Arc<Schemas> {
    // vLLM's test tools, and one of every type.
    Arc::new(Schemas::new(&[
        json!({"type": "function", "function": {"name": "get_current_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "state": {"type": "string"},
                "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}}}}}),
        json!({"type": "function", "function": {"name": "calculate_area",
            "parameters": {"type": "object", "properties": {
                "shape": {"type": "string"}, "dimensions": {"type": "object"},
                "precision": {"type": "integer"}}}}}),
        json!({"type": "function", "function": {"name": "test_types",
            "parameters": {"type": "object", "properties": {
                "int_param": {"type": "integer"}, "float_param": {"type": "float"},
                "num_param": {"type": "number"}, "bool_param": {"type": "boolean"},
                "str_param": {"type": "string"}, "obj_param": {"type": "object"},
                "arr_param": {"type": "array"}}}}}),
    ]))
}

/// Whole, and streamed by character and in pieces of 2, 3, 5, 7 characters: all agree.
fn parse(reasoning: bool, text: &str) -> Parsed {
    let whole = AnswerParser::qwen3_coder(reasoning, tools()).parse_whole(text);
    let chars: Vec<char> = text.chars().collect();
    for size in [1, 2, 3, 5, 7] {
        let mut parser = AnswerParser::qwen3_coder(reasoning, tools());
        let mut pieces = Parsed::default();
        for chunk in chars.chunks(size) {
            pieces.append(parser.push(&chunk.iter().collect::<String>()));
        }
        pieces.append(parser.finish());
        assert_eq!(pieces, whole, "streamed in pieces of {size}: {text:?}");
    }
    whole
}

fn args(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).expect(&call.arguments)
}

const DALLAS: &str = "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n\
    </parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n\
    </parameter>\n</function>\n</tool_call>";

#[test]
fn vllms_cases_read_alike() {
    // Single call: the arguments as vLLM's json.dumps writes them.
    let p = parse(false, DALLAS);
    assert_eq!(p.content, "");
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].name.as_deref(), Some("get_current_weather"));
    assert_eq!(
        p.calls[0].arguments,
        r#"{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}"#
    );
    // Content before it.
    let p = parse(
        false,
        &format!("Sure! Let me check the weather for you.{DALLAS}"),
    );
    assert_eq!(p.content, "Sure! Let me check the weather for you.");
    assert_eq!(p.calls.len(), 1);
    // Parallel calls.
    let orlando = DALLAS.replace("Dallas", "Orlando").replace("TX", "FL");
    let p = parse(false, &format!("{DALLAS}\n{orlando}"));
    assert_eq!(p.content, "");
    assert_eq!(p.calls.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(args(&p.calls[1])["city"], "Orlando");
    assert_eq!(args(&p.calls[1])["state"], "FL");
    // A multi-line object value.
    let p = parse(
        false,
        "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n\
         <parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n\
         <parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>",
    );
    assert_eq!(
        p.calls[0].arguments,
        r#"{"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2}"#
    );
    // Typed parameters.
    let p = parse(
        false,
        "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n\
         <parameter=float_param>\n2.75\n</parameter>\n<parameter=num_param>\n2.0\n\
         </parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\n\
         hello world\n</parameter>\n<parameter=obj_param>\n{\"key\": \"value\"}\n</parameter>\n\
         <parameter=arr_param>\n[1, \"a\"]\n</parameter>\n<parameter=extra>\n7\n</parameter>\n\
         <parameter=str_param2>\nnull\n</parameter>\n</function>\n</tool_call>",
    );
    assert_eq!(
        args(&p.calls[0]),
        json!({"int_param": 42, "float_param": 2.75, "num_param": 2, "bool_param": true,
               "str_param": "hello world", "obj_param": {"key": "value"},
               "arr_param": [1, "a"], "extra": "7", "str_param2": null})
    );
    // No calls: all content.
    let p = parse(false, "This is a test without tools");
    assert_eq!(p.content, "This is a test without tools");
    assert!(p.calls.is_empty());
}

#[test]
fn values_keep_their_inner_newlines_and_fall_back_to_strings() {
    let p = parse(
        false,
        "<tool_call>\n<function=test_types>\n<parameter=str_param>\n\nline 1\n  line 2\n\n\
         </parameter>\n<parameter=int_param>\nmany\n</parameter>\n<parameter=obj_param>\n\
         {broken\n</parameter>\n<parameter=bool_param>\nyes\n</parameter>\n</function>\n\
         </tool_call>",
    );
    assert_eq!(
        args(&p.calls[0]),
        json!({"str_param": "\nline 1\n  line 2\n", "int_param": "many",
               "obj_param": "{broken", "bool_param": false})
    );
    // A tool the request does not have: strings.
    let p = parse(
        false,
        "<tool_call><function=other><parameter=n>5</parameter></function></tool_call>",
    );
    assert_eq!(
        (p.calls[0].name.as_deref(), p.calls[0].arguments.as_str()),
        (Some("other"), r#"{"n": "5"}"#)
    );
}

#[test]
fn reasoning_then_calls_and_text_around_them() {
    let p = parse(
        true,
        &format!("<think>\nWeather, then.\n</think>\n\nChecking.\n\n{DALLAS}\n\nDone."),
    );
    assert_eq!(p.reasoning, "Weather, then.");
    assert_eq!(p.content, "Checking.Done.");
    assert_eq!(p.calls.len(), 1);
    // A block without a function is content as written; so are Hermes blocks.
    let p = parse(false, "a <tool_call>{\"name\": \"f\"}</tool_call> b");
    assert_eq!(p.content, "a <tool_call>{\"name\": \"f\"}</tool_call> b");
    assert!(p.calls.is_empty());
    // Two functions in one block are two calls; text between them is dropped.
    let p = parse(
        false,
        "<tool_call><function=a></function> x <function=b><parameter=q>1</parameter>\
         </function></tool_call>",
    );
    assert_eq!(p.calls.len(), 2);
    assert_eq!(
        (p.calls[0].arguments.as_str(), p.calls[1].arguments.as_str()),
        ("{}", r#"{"q": "1"}"#)
    );
}

#[test]
fn missing_closing_tags_end_where_vllm_ends_them() {
    // No `</parameter>`: the next `<parameter=` or `</function>` ends the value; vLLM's
    // `$` drops one more newline before `</function>`.
    let p = parse(
        false,
        "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nParis\n\
         <parameter=state>\nIDF\n\n</function>\n</tool_call>",
    );
    assert_eq!(p.calls[0].arguments, r#"{"city": "Paris", "state": "IDF"}"#);
    // No `</function>`: `</tool_call>` ends it.
    let p = parse(
        false,
        "<tool_call>\n<function=calculate_area>\n<parameter=precision>\n3\n</parameter>\n\
         </tool_call> after",
    );
    assert_eq!(p.calls[0].arguments, r#"{"precision": 3}"#);
    assert_eq!(p.content, "after");
    // No `</tool_call>`: the end of the answer ends the block; what follows a function
    // in it is dropped.
    let p = parse(
        false,
        "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nParis\n</parameter>\n\
         </function>\nThe weather is nice.",
    );
    assert_eq!(p.calls[0].arguments, r#"{"city": "Paris"}"#);
    assert_eq!(p.content, "");
    // Cut off inside a value: it runs to the end (two more newlines dropped there).
    let p = parse(
        false,
        "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nPar\n\n\n",
    );
    assert_eq!(p.calls[0].arguments, r#"{"city": "Par"}"#);
    // Cut off inside the function's name: the block is content.
    let p = parse(false, "Hi <tool_call>\n<function=get_cur");
    assert_eq!(p.content, "Hi <tool_call>\n<function=get_cur");
    assert!(p.calls.is_empty());
    // A parameter without a name's end is dropped.
    let p = parse(
        false,
        "<tool_call><function=f><parameter=x</function></tool_call>",
    );
    assert_eq!(p.calls[0].arguments, "{}");
}

#[test]
fn a_call_streams_its_name_then_each_parameter() {
    let mut p = AnswerParser::qwen3_coder(false, tools());
    assert_eq!(p.push("Let me see.\n<tool_").content, "Let me see.");
    assert!(p.push("call>\n<function=calculate_ar").is_empty());
    let out = p.push("ea>\n<parameter=shape>\ncir");
    assert_eq!(out.calls[0].name.as_deref(), Some("calculate_area"));
    assert_eq!(out.calls[0].arguments, "{");
    assert!(p.push("cle\n</parameter>").calls[0].arguments == r#""shape": "circle""#);
    assert!(p.push("\n<parameter=precision>\n3\n</param").is_empty());
    assert_eq!(p.push("eter>\n").calls[0].arguments, r#", "precision": 3"#);
    assert_eq!(p.push("</function>\n").calls[0].arguments, "}");
    assert!(p.push("</tool_call>").is_empty());
    assert_eq!(p.calls(), 1);
    assert!(p.finish().is_empty());
}
