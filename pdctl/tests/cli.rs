//! `pdctl` as a user runs it: the real binary, a real synthetic model written through the
//! real safetensors path, JSON output checked for what a user relies on, and bad input
//! refused with one clear line and a non-zero exit (never a panic).

use std::path::Path;

use pd_test_support::cache;
use std::process::{Command, Output};

fn pdctl(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdctl"))
        .args(args)
        .env("PD_CACHE_DIR", cache)
        .env_remove("PD_MODEL")
        .output()
        .expect("pdctl runs")
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "pdctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

/// A failing run: non-zero exit, no panic, and exactly one line on stderr naming `needle`.
fn assert_refused(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert!(
        !stderr.contains("RUST_BACKTRACE"),
        "backtrace hint: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected, got: {stderr}");
    assert!(
        lines[0].contains(needle),
        "error line {:?} should mention {needle:?}",
        lines[0]
    );
}

#[test]
fn run_json_is_complete_and_greedy_is_deterministic() {
    let args = [
        "run",
        "--model",
        "synthetic:tiny",
        "--prompt",
        "Hello, world",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--logprobs",
        "3",
        "--prompt-logprobs",
        "2",
        "--json",
    ];
    let a = json_of(&pdctl(cache(), &args));
    let b = json_of(&pdctl(cache(), &args));
    assert_eq!(a, b, "greedy generation must be reproducible");
    let ids = a["token_ids"].as_array().unwrap();
    assert_eq!(ids.len(), 5);
    assert_eq!(a["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 5);
    let prompt_tokens = a["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(prompt_tokens >= 3);
    let lps = a["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), 5);
    for (lp, id) in lps.iter().zip(ids) {
        assert_eq!(&lp["token_id"], id);
        let top = lp["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(&top[0]["token_id"], id);
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
    }
    let plp = a["prompt_logprobs"].as_array().unwrap();
    assert_eq!(plp.len(), prompt_tokens - 1);
    assert_eq!(plp[0]["top"].as_array().unwrap().len(), 2);
}

#[test]
fn same_seed_same_sample_and_chat_template_is_applied() {
    let run = |seed: &str| {
        json_of(&pdctl(
            cache(),
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--chat",
                "Tell me a story",
                "--max-tokens",
                "8",
                "--temperature",
                "1.0",
                "--top-p",
                "0.9",
                "--seed",
                seed,
                "--ignore-eos",
                "--json",
            ],
        ))
    };
    let a = run("7");
    assert_eq!(a, run("7"));
    // The template wraps the message: more prompt tokens than the raw text has.
    let raw = json_of(&pdctl(cache(), &["tokenize", "--text", "Tell me a story"]));
    let raw_len = raw["ids"].as_array().unwrap().len() as u64;
    assert!(a["usage"]["prompt_tokens"].as_u64().unwrap() > raw_len + 4);
}

#[test]
fn tokenize_text_and_jsonl() {
    let out = json_of(&pdctl(cache(), &["tokenize", "--text", "Hello world"]));
    assert_eq!(out, serde_json::json!({"ids": [9707, 1879]}));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.jsonl");
    std::fs::write(
        &file,
        "{\"text\": \"Hello world\"}\n{\"text\": \"<|im_start|>\"}\n",
    )
    .unwrap();
    let out = pdctl(cache(), &["tokenize", "--jsonl", file.to_str().unwrap()]);
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["ids"], serde_json::json!([9707, 1879]));
    assert_eq!(lines[1]["ids"], serde_json::json!([151644]));
}

#[test]
fn streams_text_to_stdout() {
    let out = pdctl(
        cache(),
        &[
            "run",
            "--model",
            "synthetic:tiny",
            "--prompt",
            "abc",
            "--max-tokens",
            "4",
            "--ignore-eos",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty());
}

#[test]
fn bad_input_is_refused_with_one_clear_line() {
    let c = cache();
    assert_refused(
        &pdctl(
            c,
            &["run", "--model", "/nonexistent/model", "--prompt", "x"],
        ),
        "does not exist",
    );
    assert_refused(
        &pdctl(c, &["run", "--model", "synthetic:nope", "--prompt", "x"]),
        "synthetic:tiny",
    );
    assert_refused(
        &pdctl(
            c,
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--token-ids",
                "1,999999999",
            ],
        ),
        "outside the vocabulary",
    );
    assert_refused(
        &pdctl(c, &["run", "--model", "synthetic:tiny", "--prompt", ""]),
        "empty",
    );
    assert_refused(
        &pdctl(
            c,
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--prompt",
                "x",
                "--temperature",
                "-1",
            ],
        ),
        "temperature",
    );
    assert_refused(
        &pdctl(
            c,
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--prompt",
                "x",
                "--top-p",
                "1.5",
            ],
        ),
        "top_p",
    );
    assert_refused(
        &pdctl(
            c,
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--prompt",
                "x",
                "--top-p",
                "0",
            ],
        ),
        "top_p",
    );
    let long: String = "hello ".repeat(5000);
    assert_refused(
        &pdctl(c, &["run", "--model", "synthetic:tiny", "--prompt", &long]),
        "context",
    );
}

#[test]
fn broken_model_directories_are_refused_naming_the_problem() {
    let c = cache();
    let src = json_of(&pdctl(c, &["tokenize", "--text", "x"]));
    assert!(src["ids"].is_array());
    // Materialise the tiny model, then copy it and break the copies.
    assert!(
        pdctl(
            c,
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--prompt",
                "x",
                "--max-tokens",
                "1"
            ]
        )
        .status
        .success()
    );
    let tiny = std::fs::read_dir(c.join("synthetic"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("tiny-")
        })
        .expect("tiny model in the cache");
    let copy = |name: &str| {
        let dir = c.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
        ] {
            std::fs::copy(tiny.join(f), dir.join(f)).unwrap();
        }
        dir
    };

    // Corrupt safetensors header.
    let dir = copy("corrupt");
    let mut bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    bytes[8..16].copy_from_slice(b"{garbage");
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    assert_refused(
        &pdctl(
            c,
            &["run", "--model", dir.to_str().unwrap(), "--prompt", "x"],
        ),
        "model.safetensors",
    );

    // A tensor of the wrong shape: claim a bigger hidden size than the weights have.
    let dir = copy("wrong-shape");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = serde_json::json!(200);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_refused(
        &pdctl(
            c,
            &["run", "--model", dir.to_str().unwrap(), "--prompt", "x"],
        ),
        "mlp.gate_proj.weight",
    );

    // A Qwen3-MoE config without its experts' shape.
    let dir = copy("moe");
    cfg["intermediate_size"] = serde_json::json!(192);
    cfg["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
    cfg["model_type"] = serde_json::json!("qwen3_moe");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_refused(
        &pdctl(
            c,
            &["run", "--model", dir.to_str().unwrap(), "--prompt", "x"],
        ),
        "`num_experts`: is missing",
    );

    // An architecture this engine does not implement.
    let dir = copy("llama");
    cfg["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    cfg["model_type"] = serde_json::json!("llama");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_refused(
        &pdctl(
            c,
            &["run", "--model", dir.to_str().unwrap(), "--prompt", "x"],
        ),
        "architectures",
    );
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(
        out.status.success(),
        "pdctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

#[test]
fn prompts_file_shows_the_prefix_cache_at_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.jsonl");
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(4);
    let lines = [
        serde_json::json!({"prompt": text, "max_tokens": 3}),
        serde_json::json!({"prompt": text, "max_tokens": 3}),
        serde_json::json!({"prompt": text, "max_tokens": 3, "cache_salt": "other-tenant"}),
        serde_json::json!({"prompt": text, "max_tokens": 3, "prompt_logprobs": 1}),
        serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": 2}),
    ];
    let body: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&file, body).unwrap();
    let f = file.to_str().unwrap();
    let base = [
        "run",
        "--model",
        "synthetic:tiny",
        "--prompts-file",
        f,
        "--ignore-eos",
        "--json",
    ];
    let out = json_lines(&pdctl(cache(), &base));
    assert_eq!(out.len(), 5, "one result per line, in input order");
    let usage = |i: usize, k: &str| out[i]["usage"][k].as_u64().unwrap();
    let prompt_tokens = usage(0, "prompt_tokens");
    let whole_blocks = (prompt_tokens - 1) / 16 * 16;
    assert_eq!(usage(0, "cached_tokens"), 0, "cold");
    assert_eq!(
        usage(1, "local_cached_tokens"),
        whole_blocks,
        "warm: whole blocks below the last token"
    );
    assert_eq!(usage(1, "cached_tokens"), whole_blocks);
    assert_eq!(usage(1, "external_cached_tokens"), 0);
    assert_eq!(usage(2, "cached_tokens"), 0, "another salt never hits");
    assert_eq!(
        usage(3, "cached_tokens"),
        0,
        "prompt logprobs need every position computed"
    );
    assert_eq!(
        out[3]["prompt_logprobs"].as_array().unwrap().len() as u64,
        prompt_tokens - 1
    );
    assert_eq!(
        out[0]["token_ids"], out[1]["token_ids"],
        "cached KV gives the same tokens"
    );
    assert_eq!(out[4]["usage"]["prompt_tokens"], 3);

    // The same file all at once: the same tokens for every prompt.
    let mut concurrent = base.to_vec();
    concurrent.push("--concurrent");
    let together = json_lines(&pdctl(cache(), &concurrent));
    for (a, b) in out.iter().zip(&together) {
        assert_eq!(a["token_ids"], b["token_ids"]);
    }
    // With the cache off nothing is ever cached.
    let mut off = base.to_vec();
    off.push("--no-enable-prefix-caching");
    for r in json_lines(&pdctl(cache(), &off)) {
        assert_eq!(r["usage"]["cached_tokens"], 0);
    }
    // Bad lines are refused naming the line.
    std::fs::write(&file, "{\"prompt\": \"x\"}\n{\"promt\": \"x\"}\n").unwrap();
    assert_refused(
        &pdctl(cache(), &["run", "--prompts-file", f]),
        "prompts.jsonl:2",
    );
}

#[test]
fn stop_strings_end_the_text_and_the_request() {
    let free = once_upon_a_time(12, &[]);
    let text = free["text"].as_str().unwrap();
    // Stop at a piece of the text the model will produce: the output ends right before it.
    let chars: Vec<char> = text.chars().collect();
    let mid = chars.len() / 2;
    let stop: String = chars[mid..(mid + 2).min(chars.len())].iter().collect();
    let stopped = once_upon_a_time(12, &["--stop", &stop]);
    let got = stopped["text"].as_str().unwrap();
    assert_eq!(stopped["finish_reason"], "stop");
    assert_eq!(stopped["stop_reason"], stop.as_str());
    assert_eq!(free["stop_reason"], serde_json::Value::Null);
    assert!(
        text.starts_with(got) && !got.contains(&stop),
        "{got:?} vs {text:?} stop {stop:?}"
    );
    assert!(stopped["token_ids"].as_array().unwrap().len() <= 12);
}

/// `pdctl run --json` of "Once upon a time" on synthetic:tiny, EOS ignored, with `extra`
/// flags.
fn once_upon_a_time(max_tokens: u32, extra: &[&str]) -> serde_json::Value {
    let max_tokens = max_tokens.to_string();
    let mut args = vec![
        "run",
        "--model",
        "synthetic:tiny",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        &max_tokens,
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    json_of(&pdctl(cache(), &args))
}

#[test]
fn logit_bias_and_allowed_token_ids_steer_every_token() {
    let run = |extra: &[&str]| {
        let v = once_upon_a_time(6, extra);
        v["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect::<Vec<u32>>()
    };
    let free = run(&[]);
    // A +100 bias forces a token the model would not choose.
    let forced = (0..1000).find(|t| !free.contains(t)).unwrap();
    assert_eq!(
        run(&["--logit-bias", &format!("{forced}:100")]),
        vec![forced; 6]
    );
    // Banning the free run's first token changes the first choice.
    let banned = run(&["--logit-bias", &format!("{}:-100", free[0])]);
    assert_ne!(banned[0], free[0]);
    let allowed = run(&["--allowed-token-ids", "11,22,33", "--temperature", "1"]);
    assert!(
        allowed.iter().all(|t| [11, 22, 33].contains(t)),
        "{allowed:?}"
    );
    let c = cache();
    let base = ["run", "--model", "synthetic:tiny", "--prompt", "x"];
    let refused = |extra: &[&str], needle: &str| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        assert_refused(&pdctl(c, &args), needle);
    };
    refused(
        &["--logit-bias", "5:200"],
        "logit_bias[5] must be in [-100, 100]",
    );
    // clap's own refusal (two lines: the error and where to find help).
    let out = pdctl(c, &[&base[..], &["--logit-bias", "5"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`5` is not ID:BIAS"));
    refused(
        &["--allowed-token-ids", "1,999999999"],
        "allowed_token_ids[1]",
    );
    refused(&["--presence-penalty", "3"], "presence_penalty");
    refused(&["--max-tokens", "2", "--min-tokens", "3"], "min_tokens");
}

#[test]
fn truncate_prompt_tokens_keeps_the_prompts_tail() {
    let run = |extra: &[&str]| {
        let base = [
            "run",
            "--model",
            "synthetic:tiny",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
        ];
        json_of(&pdctl(cache(), &[&base[..], extra].concat()))
    };
    let cut = run(&[
        "--token-ids",
        "5,6,7,8,9,10",
        "--truncate-prompt-tokens",
        "3",
    ]);
    let tail = run(&["--token-ids", "8,9,10"]);
    assert_eq!(cut["token_ids"], tail["token_ids"]);
    assert_eq!(cut["usage"]["prompt_tokens"], 3);
    assert_refused(
        &pdctl(
            cache(),
            &[
                "run",
                "--model",
                "synthetic:tiny",
                "--prompt",
                "x",
                "--truncate-prompt-tokens",
                "0",
            ],
        ),
        "truncate_prompt_tokens must be between 1 and",
    );
}

#[test]
fn chat_tools_are_rendered_into_the_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let tools = dir.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]"#,
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let base = [
            "run",
            "--model",
            "synthetic:tiny",
            "--chat",
            "Weather in Paris?",
            "--max-tokens",
            "1",
            "--json",
        ];
        json_of(&pdctl(cache(), &[&base[..], extra].concat()))
    };
    let plain = run(&[])["usage"]["prompt_tokens"].as_u64().unwrap();
    let with_tools = run(&["--tools", tools.to_str().unwrap()])["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(with_tools > plain + 20, "{with_tools} vs {plain}");
    std::fs::write(&tools, r#"{"not": "an array"}"#).unwrap();
    let out = pdctl(
        cache(),
        &[
            "run",
            "--model",
            "synthetic:tiny",
            "--chat",
            "x",
            "--tools",
            tools.to_str().unwrap(),
        ],
    );
    assert_refused(&out, "not a JSON array of tools");
}

#[test]
fn structured_outputs_shape_every_sample() {
    let c = cache();
    let run = |seed: u32, extra: &[&str]| {
        let seed = seed.to_string();
        let mut args = vec![
            "run",
            "--model",
            "synthetic:tiny",
            "--prompt",
            "Answer:",
            "--temperature",
            "1",
            "--seed",
            &seed,
            "--max-tokens",
            "40",
        ];
        args.extend_from_slice(extra);
        args.push("--json");
        json_of(&pdctl(c, &args))
    };
    let text = |v: &serde_json::Value| v["text"].as_str().unwrap().to_string();
    for seed in 0..3 {
        // The random model would write anything; the regex decides, and where it ends.
        let v = run(seed, &["--regex", "[0-9]{3}"]);
        let digits = text(&v);
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{v}"
        );
        assert_eq!(v["finish_reason"], "stop", "{v}");

        let v = run(
            seed,
            &["--choice", "yes", "--choice", "no", "--choice", "maybe so"],
        );
        assert!(
            ["yes", "no", "maybe so"].contains(&text(&v).as_str()),
            "{v}"
        );

        let schema = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}}, "required": ["name", "age"]}"#;
        let v = run(seed, &["--json-schema", schema]);
        if v["finish_reason"] == "stop" {
            let doc: serde_json::Value = serde_json::from_str(&text(&v)).expect("JSON");
            assert!(doc["name"].as_str().unwrap().chars().count() <= 6, "{v}");
            assert!(doc["age"].is_i64(), "{v}");
        } else {
            // Cut by max_tokens: still a prefix of such a document.
            assert!(text(&v).starts_with("{\"name\":"), "{v}");
        }
    }

    let base = ["run", "--model", "synthetic:tiny", "--prompt", "x"];
    let refused = |extra: &[&str], needle: &str| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        assert_refused(&pdctl(c, &args), needle);
    };
    refused(&["--regex", "[0-9"], "invalid regex");
    refused(&["--json-schema", "{\"type\": "], "invalid JSON schema");
    refused(
        &["--regex", "a", "--ignore-eos"],
        "cannot be combined with ignore_eos",
    );
    // Only one kind per request (clap's refusal).
    let out = pdctl(c, &[&base[..], &["--regex", "a", "--choice", "b"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}
