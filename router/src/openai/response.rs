//! OpenAI's response objects, built from the generations' `pd.v1.GenerateResponse` chunks:
//! whole responses (`text_completion`, `chat.completion`) and stream chunks
//! (`text_completion`, `chat.completion.chunk`), their logprobs and usage.
//!
//! Logprobs keep OpenAI's two shapes: completions' parallel lists (`tokens`,
//! `token_logprobs`, `top_logprobs` as maps, `text_offset`) and chat's per-token objects with
//! UTF-8 `bytes`. A token's text is its own decoding, special tokens included, so a token
//! split inside a UTF-8 character shows U+FFFD while its `bytes` are exact. A logprob of
//! minus infinity (a banned token) is written as -9999.0, as vLLM does: JSON has no infinity.

use pd_engine::tokenizer::Tokenizer;
use pd_proto::pb;
use serde_json::{Map, Value, json};

use super::request::Endpoint;

/// What JSON can carry in place of minus infinity.
const MIN_LOGPROB: f32 = -9999.0;

fn logprob_value(lp: f32) -> f64 {
    let lp = if lp.is_finite() { lp } else { MIN_LOGPROB };
    f64::from(lp)
}

/// A token's text for logprobs (special tokens included).
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// A token's bytes as the tokenizer holds them (exact even inside a UTF-8 character).
fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    tokenizer
        .bytes_of(id)
        .map(<[u8]>::to_vec)
        .unwrap_or_default()
}

/// `finish_reason` and vLLM's `stop_reason` of a last chunk.
pub fn finish(chunk: &pb::GenerateResponse) -> Option<(&'static str, Value)> {
    let reason = match chunk.finish_reason() {
        pb::FinishReason::Unspecified => return None,
        pb::FinishReason::Stop => "stop",
        pb::FinishReason::Length => "length",
        pb::FinishReason::Abort => "abort",
    };
    let stop_reason = match &chunk.stop_reason {
        Some(pb::generate_response::StopReason::StopTokenId(id)) => json!(id),
        Some(pb::generate_response::StopReason::StopString(s)) => json!(s),
        None => Value::Null,
    };
    Some((reason, stop_reason))
}

/// One entry of a completions logprobs list: a prompt's first token has no logprob.
#[derive(Debug, Clone, Copy)]
pub enum Scored<'a> {
    Unscored(u32),
    Scored(&'a pb::Logprob),
}

/// Completions' logprobs of `entries`, their `text_offset`s counted in characters from
/// `offset`; returns the object and the offset after the last token.
pub fn completion_logprobs(
    tokenizer: &Tokenizer,
    entries: &[Scored<'_>],
    mut offset: usize,
) -> (Value, usize) {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top_logprobs = Vec::with_capacity(entries.len());
    let mut text_offset = Vec::with_capacity(entries.len());
    for entry in entries {
        let (id, scored) = match entry {
            Scored::Unscored(id) => (*id, None),
            Scored::Scored(lp) => (lp.token_id, Some(*lp)),
        };
        let text = token_text(tokenizer, id);
        text_offset.push(offset);
        offset += text.chars().count();
        match scored {
            None => {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            }
            Some(lp) => {
                token_logprobs.push(json!(logprob_value(lp.logprob)));
                let mut top = Map::new();
                // The chosen token is always among them, as in vLLM.
                top.insert(text.clone(), json!(logprob_value(lp.logprob)));
                for t in &lp.top {
                    top.entry(token_text(tokenizer, t.token_id))
                        .or_insert_with(|| json!(logprob_value(t.logprob)));
                }
                top_logprobs.push(Value::Object(top));
            }
        }
        tokens.push(Value::String(text));
    }
    let value = json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    });
    (value, offset)
}

/// Chat's logprobs content list of `entries`.
pub fn chat_logprobs(tokenizer: &Tokenizer, entries: &[pb::Logprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        json!({
            "token": token_text(tokenizer, id),
            "logprob": logprob_value(lp),
            "bytes": token_bytes(tokenizer, id),
        })
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|lp| {
            let mut e = entry(lp.token_id, lp.logprob);
            e["top_logprobs"] = lp
                .top
                .iter()
                .map(|t| entry(t.token_id, t.logprob))
                .collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// vLLM's `prompt_logprobs` of a choice: null for the first position, then per position a
/// map from token id (as a string) to its logprob, rank and decoded text. The prompt's own
/// token ranks where it is among the top ones, else its rank is null (not computed).
pub fn prompt_logprobs(tokenizer: &Tokenizer, entries: &[pb::Logprob]) -> Value {
    let mut out = vec![Value::Null];
    for lp in entries {
        let mut map = Map::new();
        let rank = lp.top.iter().position(|t| t.token_id == lp.token_id);
        map.insert(
            lp.token_id.to_string(),
            json!({
                "logprob": logprob_value(lp.logprob),
                "rank": rank.map(|r| r + 1),
                "decoded_token": token_text(tokenizer, lp.token_id),
            }),
        );
        for (rank, t) in lp.top.iter().enumerate() {
            map.entry(t.token_id.to_string()).or_insert_with(|| {
                json!({
                    "logprob": logprob_value(t.logprob),
                    "rank": rank + 1,
                    "decoded_token": token_text(tokenizer, t.token_id),
                })
            });
        }
        out.push(Value::Object(map));
    }
    Value::Array(out)
}

/// Token counts of a response: each prompt counted once (with the cache hits of its first
/// choice), every choice's completion tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageSum {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub local_cached_tokens: u64,
    pub external_cached_tokens: u64,
    /// `external_cached_tokens` by source: the node's host-memory tier, another node.
    pub external_host_cached_tokens: u64,
    pub external_peer_cached_tokens: u64,
}

impl UsageSum {
    /// Adds choice `choice`'s usage; `first_of_prompt` says whether its prompt counts.
    pub fn add(&mut self, usage: &pb::Usage, first_of_prompt: bool) {
        if first_of_prompt {
            self.prompt_tokens += u64::from(usage.prompt_tokens);
            self.cached_tokens += u64::from(usage.cached_tokens);
            self.local_cached_tokens += u64::from(usage.local_cached_tokens);
            self.external_cached_tokens += u64::from(usage.external_cached_tokens);
            self.external_host_cached_tokens += u64::from(usage.external_host_cached_tokens);
            self.external_peer_cached_tokens += u64::from(usage.external_peer_cached_tokens);
        }
        self.completion_tokens += u64::from(usage.completion_tokens);
    }

    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "local_cached_tokens": self.local_cached_tokens,
                "external_cached_tokens": self.external_cached_tokens,
                "external_host_cached_tokens": self.external_host_cached_tokens,
                "external_peer_cached_tokens": self.external_peer_cached_tokens,
            },
        })
    }
}

/// A stream chunk's usage with `stream_options.continuous_usage_stats`: its choice's prompt
/// and the tokens that choice generated so far (vLLM's shape: no details).
pub fn running_usage(prompt_tokens: u32, completion_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": u64::from(prompt_tokens) + u64::from(completion_tokens),
    })
}

/// The fields every response object and chunk starts with.
#[derive(Debug, Clone)]
pub struct Header {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl Header {
    fn object(&self, kind: &str, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A whole (non-streamed) response.
    pub fn response(&self, choices: Vec<Value>, usage: UsageSum) -> Value {
        let kind = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::ChatCompletions => "chat.completion",
        };
        let mut value = self.object(kind, choices);
        value["usage"] = usage.to_json();
        value
    }

    /// A stream chunk.
    pub fn chunk(&self, choices: Vec<Value>) -> Value {
        let kind = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::ChatCompletions => "chat.completion.chunk",
        };
        self.object(kind, choices)
    }

    /// The stream's last chunk with `stream_options.include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, usage: UsageSum) -> Value {
        let mut value = self.chunk(Vec::new());
        value["usage"] = usage.to_json();
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::qwen3().unwrap()
    }

    fn lp(id: u32, logprob: f32, top: &[(u32, f32)]) -> pb::Logprob {
        pb::Logprob {
            token_id: id,
            logprob,
            top: top
                .iter()
                .map(|&(token_id, logprob)| pb::TokenLogprob { token_id, logprob })
                .collect(),
        }
    }

    #[test]
    fn completion_logprobs_are_parallel_lists_with_offsets_in_characters() {
        let t = tok();
        let ids = t.encode("Hello world").unwrap();
        assert_eq!(ids.len(), 2);
        let second = lp(ids[1], -0.5, &[(ids[1], -0.5), (ids[0], -1.5)]);
        let entries = [Scored::Unscored(ids[0]), Scored::Scored(&second)];
        let (v, end) = completion_logprobs(&t, &entries, 3);
        assert_eq!(v["tokens"], json!(["Hello", " world"]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1], json!({" world": -0.5, "Hello": -1.5}));
        assert_eq!(v["text_offset"], json!([3, 8]));
        assert_eq!(end, 14);
    }

    #[test]
    fn banned_tokens_get_a_finite_logprob_and_chat_entries_carry_bytes() {
        let t = tok();
        let id = t.encode("é").unwrap()[0];
        let v = chat_logprobs(&t, &[lp(id, f32::NEG_INFINITY, &[(id, -2.0)])]);
        let e = &v["content"][0];
        assert_eq!(e["token"], "é");
        assert_eq!(e["logprob"], json!(-9999.0));
        assert_eq!(e["bytes"], json!("é".as_bytes()));
        assert_eq!(e["top_logprobs"][0]["logprob"], json!(-2.0));
    }

    #[test]
    fn prompt_logprobs_rank_every_entry() {
        let t = tok();
        let v = prompt_logprobs(
            &t,
            &[
                lp(5, -1.0, &[(7, -0.5), (5, -1.0)]),
                lp(9, -3.0, &[(7, -0.1)]),
            ],
        );
        assert_eq!(v[0], Value::Null);
        assert_eq!(v[1]["5"]["rank"], 2);
        assert_eq!(v[1]["7"]["rank"], 1);
        assert_eq!(
            v[2]["9"]["rank"],
            Value::Null,
            "outside the top: not computed"
        );
        assert_eq!(v[2]["9"]["logprob"], json!(-3.0));
    }

    #[test]
    fn usage_counts_each_prompt_once_and_every_completion() {
        let mut sum = UsageSum::default();
        let u = pb::Usage {
            prompt_tokens: 10,
            completion_tokens: 4,
            cached_tokens: 8,
            local_cached_tokens: 8,
            external_cached_tokens: 0,
            ..Default::default()
        };
        sum.add(&u, true);
        sum.add(&u, false);
        let v = sum.to_json();
        assert_eq!(v["prompt_tokens"], 10);
        assert_eq!(v["completion_tokens"], 8);
        assert_eq!(v["total_tokens"], 18);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 8);
    }

    #[test]
    fn usage_details_split_external_hits_by_source() {
        let mut sum = UsageSum::default();
        let u = pb::Usage {
            prompt_tokens: 100,
            completion_tokens: 1,
            cached_tokens: 80,
            local_cached_tokens: 32,
            external_cached_tokens: 48,
            external_host_cached_tokens: 16,
            external_peer_cached_tokens: 32,
        };
        sum.add(&u, true);
        sum.add(&u, false);
        let d = &sum.to_json()["prompt_tokens_details"];
        assert_eq!(
            (
                &d["external_host_cached_tokens"],
                &d["external_peer_cached_tokens"]
            ),
            (&json!(16), &json!(32))
        );
        assert_eq!(
            d["local_cached_tokens"].as_u64().unwrap()
                + d["external_host_cached_tokens"].as_u64().unwrap()
                + d["external_peer_cached_tokens"].as_u64().unwrap(),
            d["cached_tokens"].as_u64().unwrap()
        );
    }

    #[test]
    fn finish_reasons_and_stop_reasons() {
        let mut c = pb::GenerateResponse::default();
        assert_eq!(finish(&c), None);
        c.set_finish_reason(pb::FinishReason::Stop);
        c.stop_reason = Some(pb::generate_response::StopReason::StopString("###".into()));
        assert_eq!(finish(&c), Some(("stop", json!("###"))));
        c.set_finish_reason(pb::FinishReason::Length);
        c.stop_reason = None;
        assert_eq!(finish(&c), Some(("length", Value::Null)));
    }
}
