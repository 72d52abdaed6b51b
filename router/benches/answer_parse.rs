//! What reading an answer as it streams costs (`cargo bench -p pd-router --bench
//! answer_parse`): the router's answer parsers (`--reasoning-parser qwen3`,
//! `--tool-call-parser hermes` / `qwen3_coder`) fed a long answer four bytes at a time, as
//! tokens arrive, against the same parser reading the whole answer at once, measured in the
//! same run. Two figures to read: `stream/whole`, the streamed parser's cost per byte over
//! the whole-answer parser's (pushing each piece has a fixed cost of its own, so it is above
//! 1), and `growth`, the streamed cost per byte of the long answer over that of the short
//! one: 1 when the streamed parser reads each byte a bounded number of times, about the
//! lengths' ratio (10) when it re-reads what it holds at every piece. Qwen3-Coder writing a
//! file into one parameter is such a long answer (100,000 tokens).
//!
//! Arguments not starting with `-` filter the cases by substring (`cargo bench -p pd-router
//! --bench answer_parse -- coder`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use pd_router::parse::coder::Schemas;
use pd_router::parse::{AnswerParser, Parsed};

/// Answer lengths, in 4-byte pieces.
const PIECES: [usize; 2] = [10_000, 100_000];
/// Each case's best of this many rounds is kept: other work on a shared machine only slows a
/// round down.
const ROUNDS: usize = 7;

/// The answer's body: lines of code-like text.
fn body(pieces: usize) -> Vec<&'static str> {
    (0..pieces)
        .map(|i| if i % 7 == 0 { "\n   " } else { "ab{}" })
        .collect()
}

struct Case {
    name: &'static str,
    parser: fn() -> AnswerParser,
    head: &'static str,
    tail: &'static str,
}

fn coder() -> AnswerParser {
    AnswerParser::qwen3_coder(true, Arc::new(Schemas::new(&[])))
}

fn hermes() -> AnswerParser {
    AnswerParser::new(true, true)
}

const CASES: [Case; 7] = [
    Case {
        name: "content",
        parser: hermes,
        head: "",
        tail: "",
    },
    Case {
        name: "reasoning",
        parser: hermes,
        head: "<think>\n",
        tail: "\n</think>\n\nok",
    },
    Case {
        name: "hermes-arguments",
        parser: hermes,
        head: "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"text\": \"",
        tail: "\"}}\n</tool_call>",
    },
    Case {
        name: "hermes-no-call",
        parser: hermes,
        head: "<tool_call>\n",
        tail: "\n</tool_call>",
    },
    Case {
        name: "qwen3_coder-no-call",
        parser: coder,
        head: "<tool_call>\n",
        tail: "\n</tool_call>",
    },
    Case {
        name: "qwen3_coder-open-head",
        parser: coder,
        head: "<tool_call>\n<function=",
        tail: "\n</tool_call>",
    },
    Case {
        name: "qwen3_coder-value",
        parser: coder,
        head: "<tool_call>\n<function=write>\n<parameter=text>\n",
        tail: "\n</parameter>\n</function>\n</tool_call>",
    },
];

fn streamed(case: &Case, body: &[&str]) -> Parsed {
    let mut parser = (case.parser)();
    let mut out = parser.push(case.head);
    for piece in body {
        out.append(parser.push(piece));
    }
    out.append(parser.push(case.tail));
    out.append(parser.finish());
    out
}

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    println!(
        "{:<20} {:>8} {:>12} {:>12} {:>13} {:>7}",
        "case", "pieces", "whole MB/s", "stream MB/s", "stream/whole", "growth"
    );
    for case in &CASES {
        if !filters.is_empty() && !filters.iter().any(|f| case.name.contains(f.as_str())) {
            continue;
        }
        let mut first_rate = None;
        for pieces in PIECES {
            let body = body(pieces);
            let text = format!("{}{}{}", case.head, body.concat(), case.tail);
            let mb = text.len() as f64 / 1e6;
            let (mut whole_rate, mut stream_rate) = (Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let t = Instant::now();
                let whole = black_box((case.parser)().parse_whole(black_box(&text)));
                let whole_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let pieces_out = black_box(streamed(case, black_box(&body)));
                let stream_s = t.elapsed().as_secs_f64();
                assert_eq!(
                    pieces_out, whole,
                    "{}: streamed and whole differ",
                    case.name
                );
                whole_rate.push(mb / whole_s);
                stream_rate.push(mb / stream_s);
            }
            let (whole, stream) = (best(whole_rate), best(stream_rate));
            let first = *first_rate.get_or_insert(stream);
            println!(
                "{:<20} {:>8} {:>12.0} {:>12.1} {:>13.1} {:>7.2}",
                case.name,
                pieces,
                whole,
                stream,
                whole / stream,
                first / stream
            );
        }
    }
}

fn best(v: Vec<f64>) -> f64 {
    v.into_iter().fold(0.0, f64::max)
}
