//! The answer parser's cases: Qwen3's reasoning and Hermes's calls, whole and streamed.

use super::*;

fn call(index: usize, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        index,
        name: Some(name.into()),
        arguments: arguments.into(),
    }
}

/// The answer parsed whole, and streamed one character (and one byte-sized piece) at a
/// time: all three agree.
fn parse(reasoning: bool, tools: bool, text: &str) -> Parsed {
    let whole = AnswerParser::parse_all(reasoning, tools, text);
    let mut parser = AnswerParser::new(reasoning, tools);
    let mut streamed = Parsed::default();
    for c in text.chars() {
        streamed.append(parser.push(&c.to_string()));
    }
    streamed.append(parser.finish());
    assert_eq!(streamed, whole, "streamed by character: {text:?}");
    for size in [2, 3, 5, 7] {
        let mut parser = AnswerParser::new(reasoning, tools);
        let mut pieces = Parsed::default();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(size) {
            pieces.append(parser.push(&chunk.iter().collect::<String>()));
        }
        pieces.append(parser.finish());
        assert_eq!(pieces, whole, "streamed in pieces of {size}: {text:?}");
    }
    whole
}

#[test]
fn reasoning_is_the_opening_think_block() {
    let p = parse(
        true,
        false,
        "<think>\nLet me see.\n2+2=4.\n</think>\n\nIt is 4.",
    );
    assert_eq!(p.reasoning, "Let me see.\n2+2=4.");
    assert_eq!(p.content, "It is 4.");
    // Thinking off (the template wrote an empty block into the prompt): all content.
    let p = parse(true, false, "It is 4. <think> is a tag.");
    assert_eq!(
        (p.reasoning.as_str(), p.content.as_str()),
        ("", "It is 4. <think> is a tag.")
    );
    // Cut off while thinking: all reasoning so far.
    let p = parse(true, false, "<think>\nStill going\n");
    assert_eq!(
        (p.reasoning.as_str(), p.content.as_str()),
        ("Still going", "")
    );
    // Without the parser, the tags are text.
    let p = parse(false, false, "<think>x</think>y");
    assert_eq!(p.content, "<think>x</think>y");
    // A near-tag at the start is content once it stops matching.
    assert_eq!(parse(true, false, "<thin").content, "<thin");
    assert_eq!(parse(true, false, "<thinking>").content, "<thinking>");
}

#[test]
fn tool_calls_are_read_whole_and_keep_their_arguments_text() {
    let text = "<think>\nNeed weather.\n</think>\n\nChecking both.\n<tool_call>\n\
                {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\", \"n\": [1, 2]}}\n\
                </tool_call>";
    let p = parse(true, true, text);
    assert_eq!(p.reasoning, "Need weather.");
    assert_eq!(p.content, "Checking both.");
    assert_eq!(
        p.calls,
        [
            call(0, "get_weather", r#"{"city": "Paris"}"#),
            call(1, "get_weather", r#"{"city": "Lyon", "n": [1, 2]}"#)
        ]
    );
    // Only calls: no content at all; an unclosed last call whose JSON is whole counts.
    let p = parse(
        false,
        true,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>{\"name\": \"g\"}",
    );
    assert_eq!(p.content, "");
    assert_eq!(p.calls, [call(0, "f", "{}"), call(1, "g", "{}")]);
}

#[test]
fn blocks_that_are_not_calls_stay_text() {
    let p = parse(false, true, "a <tool_call>not json</tool_call> b");
    assert_eq!(p.content, "a <tool_call>not json</tool_call> b");
    assert!(p.calls.is_empty());
    let p = parse(false, true, "x <tool_call>{\"name\": \"f\"");
    assert_eq!(p.content, "x <tool_call>{\"name\": \"f\"");
    // Without tools in the request, a well-formed block is text too.
    let p = parse(false, false, "<tool_call>{\"name\": \"f\"}</tool_call>");
    assert_eq!(p.content, "<tool_call>{\"name\": \"f\"}</tool_call>");
    // White space is kept when no call follows.
    assert_eq!(parse(false, true, "a  \n").content, "a  \n");
    assert_eq!(parse(false, true, "<tool").content, "<tool");
}

#[test]
fn held_text_waits_for_the_piece_that_decides_it() {
    let mut p = AnswerParser::new(true, true);
    assert!(p.push("<thi").is_empty());
    assert!(p.push("nk>Hm").reasoning == "Hm");
    assert!(p.push("</thi").is_empty());
    let out = p.push("nk>Yes <tool_");
    assert_eq!(out.content, "Yes");
    assert!(p.push("call>{\"name\": \"f\", \"argu").is_empty());
    let out = p.push("ments\": {} }");
    assert_eq!(out.calls, [call(0, "f", "{}")]);
    assert!(p.push("</tool_call>").is_empty());
    assert_eq!(p.calls(), 1);
    assert!(p.finish().is_empty());
}

#[test]
fn a_call_streams_its_name_then_its_arguments_as_they_come() {
    let mut p = AnswerParser::new(false, true);
    assert!(p.push("<tool_call>\n{\"name\": \"get_").is_empty());
    let out = p.push("weather\", \"arguments\": {\"ci");
    assert_eq!(out.calls, [call(0, "get_weather", "{\"ci")]);
    let more = |text: &str| ToolCall {
        index: 0,
        name: None,
        arguments: text.into(),
    };
    assert_eq!(p.push("ty\": \"Par").calls, [more("ty\": \"Par")]);
    // A closing tag inside a string is text of the arguments; one that may start outside
    // a string waits.
    assert_eq!(p.push("</tool_call>\"").calls, [more("</tool_call>\"")]);
    assert_eq!(p.push(" </tool_").calls, [more(" ")]);
    assert_eq!(p.push("x}}\n").calls, [more("</tool_x}")]);
    // The call ended with its object: white space and the closing tag are dropped.
    assert!(p.push("</tool_call>\n\nDone.").content == "Done.");
    assert_eq!(p.calls(), 1);
}

#[test]
fn streamed_calls_are_read_as_their_head_and_arguments_say() {
    // The rest of the call's object is dropped; text after it is content again (the
    // call was given out as it streamed, whole or streamed alike).
    let p = parse(
        false,
        true,
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"x\": 2} junk</tool_call> ok",
    );
    assert_eq!(
        (p.calls, p.content.as_str()),
        (vec![call(0, "f", "{\"a\": 1}")], "junk</tool_call> ok")
    );
    // A call without its closing tag: a next call, or prose, still comes through.
    let p = parse(
        false,
        true,
        "<tool_call>{\"name\":\"f\",\"arguments\":{}}\n<tool_call>{\"name\":\"g\",\"arguments\":{}}</tool_call>",
    );
    assert_eq!(p.calls, [call(0, "f", "{}"), call(1, "g", "{}")]);
    let p = parse(
        false,
        true,
        "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":1}} The weather is nice.",
    );
    assert_eq!(p.calls, [call(0, "f", "{\"a\":1}")]);
    assert_eq!(p.content, "The weather is nice.");
    // A closing tag inside the name's string is part of the name.
    let p = parse(
        false,
        true,
        "<tool_call>{\"name\": \"a</tool_call>b\", \"arguments\": {}}</tool_call>",
    );
    assert_eq!(p.calls, [call(0, "a</tool_call>b", "{}")]);
    // Cut off inside the arguments (`length`): the call has what was written.
    let p = parse(
        true,
        true,
        "<think>t</think>Hi<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"x <",
    );
    assert_eq!(p.calls, [call(0, "f", "{\"a\": \"x <")]);
    assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("t", "Hi"));
    // A closing tag outside any string ends the call where it stands.
    let p = parse(
        false,
        true,
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1</tool_call> b <tool_call>\
         {\"name\": \"g\", \"arguments\": {\"s\": \"}\"}}</tool_call>",
    );
    assert_eq!(
        p.calls,
        [call(0, "f", "{\"a\": 1"), call(1, "g", "{\"s\": \"}\"}")]
    );
    assert_eq!(p.content, "b");
    // Other shapes are read whole: the name after the arguments, no arguments.
    let p = parse(
        false,
        true,
        "<tool_call>{\"arguments\": {\"a\": [1]}, \"name\": \"f\"}</tool_call>\
         <tool_call>{\"name\": \"g\"}</tool_call><tool_call>{\"name\": \"h\", \"arguments\": 5}",
    );
    assert_eq!(
        p.calls,
        [
            call(0, "f", "{\"a\": [1]}"),
            call(1, "g", "{}"),
            call(2, "h", "5")
        ]
    );
}
