//! Seeded random answers through the parser: parsed whole and streamed in random pieces
//! alike, well-formed calls keeping their arguments' text, and `call::head` deciding nothing
//! that more text would change. `SEED=n` runs other cases, `CASES=n` more of them.
use std::panic::AssertUnwindSafe;

use super::call::{self, Head};
use super::coder;
use super::*;

/// `SEED`, else `default`.
fn seed(default: u64) -> u64 {
    std::env::var("SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// `CASES`, else `default`.
fn cases(default: usize) -> usize {
    std::env::var("CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
    fn chance(&mut self, p: u32) -> bool {
        self.below(100) < p as usize
    }
}

fn ws(r: &mut Rng) -> String {
    let n = if r.chance(50) { 0 } else { r.below(3) };
    (0..n).map(|_| r.pick(&[" ", "\n", "\t", "\r"])).collect()
}

fn json_string(r: &mut Rng) -> String {
    let mut s = String::from("\"");
    for _ in 0..r.below(6) {
        s.push_str(r.pick(&[
            "a",
            "é",
            "日本",
            "😀",
            " ",
            "\\\"",
            "\\\\",
            "\\n",
            "\\u00e9",
            "\\ud83d\\ude00",
            "\\/",
            "}",
            "]",
            "{",
            "<",
            "</tool_call>",
            "<tool_call>",
            "</think>",
            ",",
            ":",
            "'",
        ]));
    }
    s.push('"');
    s
}

fn json_value(r: &mut Rng, depth: u32) -> String {
    match if depth > 2 { r.below(4) } else { r.below(6) } {
        0 => json_string(r),
        1 => r
            .pick(&["1", "-2.5e3", "true", "false", "null", "0"])
            .into(),
        2 | 3 => json_string(r),
        4 => {
            let items: Vec<String> = (0..r.below(3))
                .map(|_| format!("{}{}{}", ws(r), json_value(r, depth + 1), ws(r)))
                .collect();
            format!("[{}]", items.join(","))
        }
        _ => json_object(r, depth + 1),
    }
}

fn json_object(r: &mut Rng, depth: u32) -> String {
    let items: Vec<String> = (0..r.below(4))
        .map(|_| {
            format!(
                "{}{}{}:{}{}{}",
                ws(r),
                json_string(r),
                ws(r),
                ws(r),
                json_value(r, depth),
                ws(r)
            )
        })
        .collect();
    if items.is_empty() {
        format!("{{{}}}", ws(r))
    } else {
        format!("{{{}}}", items.join(","))
    }
}

/// A well-formed streamed call block: (text, name, arguments text).
fn good_call(r: &mut Rng) -> (String, String, String) {
    let mut name_json = json_string(r);
    while name_json.contains("</tool_call>") {
        name_json = json_string(r);
    }
    let name: String = serde_json::from_str(&name_json).unwrap();
    let args = json_object(r, 0);
    let text = format!(
        "<tool_call>{}{{{}\"name\"{}:{}{}{},{}\"arguments\"{}:{}{}{}}}{}</tool_call>",
        ws(r),
        ws(r),
        ws(r),
        ws(r),
        name_json,
        ws(r),
        ws(r),
        ws(r),
        ws(r),
        args,
        ws(r),
        ws(r)
    );
    (text, name, args)
}

fn noise(r: &mut Rng) -> String {
    (0..1 + r.below(4))
        .map(|_| {
            r.pick(&[
                "a",
                "b c",
                "é",
                "日本",
                "😀",
                " ",
                "\n",
                "\n\n",
                "\t",
                "<",
                ">",
                "/",
                "<tool",
                "</tool_",
                "<tool_call",
                "<think",
                "</thi",
                "x}",
                "{",
                "}",
                "\"",
                "\\",
                ":",
                ",",
                "\"name\"",
                "\"arguments\"",
                "\"f\"",
                "null",
                "[",
                "]",
                "\u{a0}",
                "\u{3000}",
            ])
        })
        .collect()
}

/// A random char boundary of `s` (its end among them when `end`).
fn boundary(r: &mut Rng, s: &str, end: bool) -> usize {
    let cut: Vec<usize> = s
        .char_indices()
        .map(|(i, _)| i)
        .chain(end.then_some(s.len()))
        .collect();
    cut[r.below(cut.len())]
}

/// An answer's start: often a think block opened by one of `opens` (and mostly closed).
fn think(r: &mut Rng, opens: &[&str]) -> String {
    let mut s = String::new();
    if r.chance(40) {
        s.push_str(r.pick(opens));
        s.push_str(&noise(r));
        if r.chance(80) {
            s.push_str(r.pick(&["</think>", "\n</think>\n\n"]));
        }
    }
    s
}

fn answer(r: &mut Rng) -> String {
    let mut s = think(r, &["<think>", "<think>\n", "<thi", "\n<think>"]);
    for _ in 0..r.below(5) {
        match r.below(9) {
            0 | 1 => s.push_str(&noise(r)),
            2 | 3 => s.push_str(&good_call(r).0),
            4 => s.push_str(&format!(
                "<tool_call>{}{}{}</tool_call>",
                ws(r),
                r.pick(&[
                    "{\"arguments\": {\"a\": 1}, \"name\": \"f\"}",
                    "{\"name\": \"g\"}",
                    "{\"name\": \"h\", \"arguments\": null}",
                    "{\"name\": \"h\", \"arguments\": [1, \"</tool_call>\"]}",
                    "not json",
                    "[{\"name\": \"f\", \"arguments\": {}}]",
                    "{\"name\": \"a</tool_call>b\", \"arguments\": {}}",
                    "{\"n\\u0061me\": \"f\", \"arguments\": {}}",
                    "{\"name\": \"f\", \"arguments\": {\"a\": \"x</tool_call>\"}, \"x\": 2} junk",
                    "{\"name\": \"f\", \"arguments\": {\"a\": 1</tool_call>",
                    "{\"name\": \"f\", \"arguments\": {}} <tool_call>{\"name\":\"g\",\"arguments\":{}}",
                    "",
                ]),
                ws(r)
            )),
            5 => s.push_str(r.pick(&["<tool_call>", "</tool_call>", "<think>", "</think>"])),
            6 => s.push_str(&ws(r)),
            7 => s.push_str(&json_object(r, 0)),
            _ => {
                // a call block with random garbage mixed into its body
                let (t, _, _) = good_call(r);
                let at = boundary(r, &t, false);
                s.push_str(&t[..at]);
                s.push_str(&noise(r));
                s.push_str(&t[at..]);
            }
        }
    }
    if r.chance(30) {
        let at = boundary(r, &s, true);
        s.truncate(at);
    }
    s
}

fn streamed(reasoning: bool, tools: bool, pieces: &[&str]) -> (Parsed, Vec<Parsed>) {
    streamed_by(AnswerParser::new(reasoning, tools), pieces)
}

/// `parser` fed `pieces`: everything it gave out, and each push's (and the finish's) part.
fn streamed_by(mut parser: AnswerParser, pieces: &[&str]) -> (Parsed, Vec<Parsed>) {
    let mut all = Parsed::default();
    let mut parts = Vec::new();
    for p in pieces {
        let out = parser.push(p);
        parts.push(out.clone());
        all.append(out);
    }
    let out = parser.finish();
    parts.push(out.clone());
    all.append(out);
    (all, parts)
}

/// Streamed parts as run.rs sends them: each call index's first part has the name, later
/// ones none; indices go 0, 1, 2 … in order.
fn check_parts(parts: &[Parsed], text: &str) {
    let mut seen = 0usize;
    for p in parts {
        for c in &p.calls {
            if c.index == seen {
                assert!(
                    c.name.is_some(),
                    "first part without name {text:?} {parts:?}"
                );
                seen += 1;
            } else {
                assert_eq!(c.index + 1, seen, "index order {text:?} {parts:?}");
                assert!(c.name.is_none(), "name twice {text:?} {parts:?}");
            }
        }
    }
}

fn chunkings(r: &mut Rng, text: &str) -> Vec<Vec<String>> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = vec![chars.iter().map(|c| c.to_string()).collect()];
    for _ in 0..6 {
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let m = if r.chance(50) { 3 } else { 15 };
            let n = 1 + r.below(m);
            let end = (i + n).min(chars.len());
            pieces.push(chars[i..end].iter().collect());
            if r.chance(10) {
                pieces.push(String::new());
            }
            i = end;
        }
        out.push(pieces);
    }
    out
}

/// `text` parsed whole by `parser()` and streamed over several chunkings: panics and
/// disagreements go to `fails` (`label` says which parser); the whole answer's result unless
/// it panicked.
fn whole_and_streamed(
    r: &mut Rng,
    case: usize,
    label: &str,
    text: &str,
    parser: &dyn Fn() -> AnswerParser,
    fails: &mut Vec<String>,
) -> Option<Parsed> {
    let whole = std::panic::catch_unwind(AssertUnwindSafe(|| parser().parse_whole(text)));
    let Ok(whole) = whole else {
        fails.push(format!("PANIC whole {case}: {text:?}"));
        return None;
    };
    for pieces in chunkings(r, text) {
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        match std::panic::catch_unwind(AssertUnwindSafe(|| streamed_by(parser(), &refs))) {
            Err(_) => fails.push(format!("PANIC stream {case}: {text:?} {pieces:?}")),
            Ok((all, parts)) => {
                if all != whole {
                    fails.push(format!(
                        "DIFF {case} {label}: {text:?}\n pieces {pieces:?}\n whole {whole:?}\n streamed {all:?}"
                    ));
                    break;
                }
                check_parts(&parts, text);
            }
        }
    }
    Some(whole)
}

#[test]
fn fuzz_whole_equals_streamed() {
    let mut r = Rng(seed(0x5eed));
    let mut fails = Vec::new();
    for case in 0..cases(6_000) {
        let text = answer(&mut r);
        let (reasoning, tools) = (r.chance(70), r.chance(85));
        let label = format!("r={reasoning} t={tools}");
        let parser = || AnswerParser::new(reasoning, tools);
        whole_and_streamed(&mut r, case, &label, &text, &parser, &mut fails);
        if fails.len() > 5 {
            break;
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n\n"));
}

/// One to three well-formed calls made by `call` (its text, name and arguments), some with
/// a few words before them: the answer, and each call's name and arguments.
fn calls_text<T>(
    r: &mut Rng,
    call: fn(&mut Rng) -> (String, String, T),
) -> (String, Vec<(String, T)>) {
    let mut text = String::new();
    let mut want = Vec::new();
    for _ in 0..1 + r.below(3) {
        if r.chance(50) {
            text.push_str(r.pick(&["Sure.", "a b", "日本 ", "\n"]));
        }
        let (t, name, args) = call(r);
        text.push_str(&t);
        want.push((name, args));
    }
    (text, want)
}

#[test]
fn fuzz_well_formed_calls_keep_their_arguments_text() {
    let mut r = Rng(seed(7));
    for _ in 0..cases(3_000) {
        let (text, want) = calls_text(&mut r, good_call);
        let whole = parse_stream_checked(&mut r, &text);
        let got: Vec<(String, String)> = whole
            .calls
            .iter()
            .map(|c| (c.name.clone().unwrap(), c.arguments.clone()))
            .collect();
        assert_eq!(got, want, "{text:?}");
        assert!(whole.calls.iter().enumerate().all(|(i, c)| c.index == i));
    }
}

fn parse_stream_checked(r: &mut Rng, text: &str) -> Parsed {
    let whole = AnswerParser::parse_all(false, true, text);
    for pieces in chunkings(r, text) {
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(streamed(false, true, &refs).0, whole, "{text:?} {pieces:?}");
    }
    whole
}

#[test]
fn fuzz_head_is_prefix_stable() {
    let mut r = Rng(seed(99));
    for _ in 0..cases(4_000) {
        let body = if r.chance(50) {
            let (t, name, _) = good_call(&mut r);
            {
                let body = &t["<tool_call>".len()..t.len() - "</tool_call>".len()];
                match call::head(body) {
                    Head::Call { name: n, args } => {
                        assert_eq!(n, name, "{body:?}");
                        for end in (0..=args).filter(|&e| body.is_char_boundary(e)) {
                            assert_eq!(call::head(&body[..end]), Head::More, "{:?}", &body[..end]);
                        }
                    }
                    h => panic!("valid head not a call: {h:?} {body:?}"),
                }
            }
            let t = &t["<tool_call>".len()..t.len() - "</tool_call>".len()];
            let mut t = t.to_string();
            if r.chance(50) {
                let at = boundary(&mut r, &t, false);
                t.insert_str(at, &noise(&mut r));
            }
            t
        } else {
            format!(
                "{}{{{}{}{}:{}{}{},{}{}:{}{}",
                ws(&mut r),
                ws(&mut r),
                r.pick(&["\"name\"", "\"nam\"", "\"name", "\"arguments\""]),
                ws(&mut r),
                ws(&mut r),
                json_value(&mut r, 1),
                ws(&mut r),
                ws(&mut r),
                r.pick(&["\"arguments\"", "\"args\"", "\"name\""]),
                ws(&mut r),
                json_value(&mut r, 0)
            )
        };
        let full = call::head(&body);
        for end in (0..=body.len()).filter(|&e| body.is_char_boundary(e)) {
            let p = call::head(&body[..end]);
            match &p {
                Head::More => {}
                _ => assert_eq!(&p, &full, "prefix {:?} of {body:?}", &body[..end]),
            }
        }
    }
}

// Qwen3-Coder's calls (`--tool-call-parser qwen3_coder`).

fn coder_tools() -> std::sync::Arc<coder::Schemas> {
    let tool = serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
        "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array"}, "x": {"type": "any"}}}}});
    std::sync::Arc::new(coder::Schemas::new(&[tool]))
}

/// Parameter names and value texts: each name with values of its type and others.
const CODER_PARAMS: &[&str] = &["s", "i", "n", "b", "o", "a", "x", "unknown", "é名"];
const CODER_VALUES: &[&str] = &[
    "Paris",
    "3",
    "-2.50",
    "1e-7",
    "true",
    "False",
    "null",
    "{\"k\": [1, 2.5, \"v\"], \"t\": true}",
    "[1, {\"a\": null}]",
    "line 1\nline 2",
    "\n",
    "",
    " 42 ",
    "\"quoted\" \\ back",
    "日本 😀",
    "a < b > c",
    "<tool_call>",
    "</think>",
    "x}",
];

/// A well-formed Qwen3-Coder call block: (text, name, expected arguments as JSON).
fn coder_call(r: &mut Rng) -> (String, String, serde_json::Value) {
    let name = r.pick(&["f", "g", "get_weather", "日本"]).to_string();
    let tools = coder_tools();
    let mut text = format!("<tool_call>{}<function={name}>{}", ws(r), ws(r));
    let mut args = serde_json::Map::new();
    for _ in 0..r.below(4) {
        let param = r.pick(CODER_PARAMS);
        let value = r.pick(CODER_VALUES);
        text.push_str(&format!(
            "<parameter={param}>\n{value}\n</parameter>{}",
            ws(r)
        ));
        let converted = tools.convert(&name, param, value);
        args.insert(param.into(), serde_json::from_str(&converted).unwrap());
    }
    text.push_str(r.pick(&[
        "</function>\n</tool_call>",
        "</function></tool_call>",
        "</tool_call>",
    ]));
    (text, name, serde_json::Value::Object(args))
}

fn coder_answer(r: &mut Rng) -> String {
    let mut s = think(r, &["<think>", "<think>\n"]);
    for _ in 0..r.below(5) {
        match r.below(8) {
            0 | 1 => s.push_str(&noise(r)),
            2 | 3 => s.push_str(&coder_call(r).0),
            4 => s.push_str(r.pick(&[
                "<tool_call>",
                "</tool_call>",
                "<function=",
                "</function>",
                "<parameter=",
                "</parameter>",
                ">",
                "<function=f>",
                "<parameter=i>",
                "\n",
            ])),
            5 => s.push_str(&good_call(r).0),
            _ => {
                // A call block with pieces of tags or noise mixed in.
                let (t, _, _) = coder_call(r);
                let at = boundary(r, &t, false);
                s.push_str(&t[..at]);
                s.push_str(r.pick(&["<parameter=", "</function>", "</tool_call>", ">", "\n"]));
                s.push_str(&noise(r));
                s.push_str(&t[at..]);
            }
        }
    }
    if r.chance(30) {
        let at = boundary(r, &s, true);
        s.truncate(at);
    }
    s
}

#[test]
fn fuzz_coder_whole_equals_streamed() {
    let mut r = Rng(seed(0xc0de));
    let mut fails = Vec::new();
    for case in 0..cases(6_000) {
        let text = coder_answer(&mut r);
        let reasoning = r.chance(70);
        let parser = || AnswerParser::qwen3_coder(reasoning, coder_tools());
        let label = format!("r={reasoning}");
        let Some(whole) = whole_and_streamed(&mut r, case, &label, &text, &parser, &mut fails)
        else {
            continue;
        };
        // Every call's arguments are a JSON object.
        for call in &whole.calls {
            let v: Result<serde_json::Value, _> = serde_json::from_str(&call.arguments);
            if !v.is_ok_and(|v| v.is_object()) {
                fails.push(format!("NOT AN OBJECT {case}: {text:?} {call:?}"));
            }
        }
        if fails.len() > 5 {
            break;
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n\n"));
}

#[test]
fn fuzz_coder_well_formed_calls_keep_their_values() {
    let mut r = Rng(seed(11));
    for _ in 0..cases(3_000) {
        let (text, want) = calls_text(&mut r, coder_call);
        let whole = AnswerParser::qwen3_coder(false, coder_tools()).parse_whole(&text);
        for pieces in chunkings(&mut r, &text) {
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let parser = AnswerParser::qwen3_coder(false, coder_tools());
            assert_eq!(streamed_by(parser, &refs).0, whole, "{text:?} {pieces:?}");
        }
        let got: Vec<(String, serde_json::Value)> = whole
            .calls
            .iter()
            .map(|c| {
                let args = serde_json::from_str(&c.arguments).expect(&c.arguments);
                (c.name.clone().unwrap(), args)
            })
            .collect();
        assert_eq!(got, want, "{text:?}");
        assert!(whole.calls.iter().enumerate().all(|(i, c)| c.index == i));
    }
}
