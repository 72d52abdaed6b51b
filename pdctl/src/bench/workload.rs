//! What a benchmark sends: sessions of requests (one request for single-turn workloads, one
//! per user turn for conversations) and the generated workloads (`random`,
//! `prefix-repetition`). Everything is drawn from one seeded generator, so a seed names one
//! exact list of requests.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::args::{LenRange, PromptFormat};

/// A chat message's author.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatRole {
    System,
    User,
    Assistant,
}

impl ChatRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: ChatRole,
    pub content: String,
}

/// A prompt as the router takes it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    TokenIds(Vec<u32>),
    Text(String),
    /// Rendered through the model's chat template by the router.
    Chat(Vec<Message>),
}

/// How many tokens a request asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputLen {
    Tokens(u32),
    /// As many tokens as this reference reply has (datasets; resolved with the router's
    /// tokenizer before the run).
    LikeReply(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    pub prompt: Prompt,
    pub output: OutputLen,
}

/// Requests sent one after another, each after the previous one finished.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub turns: Vec<BenchRequest>,
}

impl Session {
    pub fn single(request: BenchRequest) -> Self {
        Self {
            turns: vec![request],
        }
    }
}

/// What the served model accepts (from the router's ListModels).
#[derive(Debug, Clone, Copy)]
pub struct ModelLimits {
    pub vocab_size: u32,
    pub max_model_len: u32,
}

impl ModelLimits {
    /// Random token ids stay below Qwen3's special tokens (151643 and up), so a prompt never
    /// contains an end-of-text or chat-control token by chance.
    fn token_id_bound(&self) -> u32 {
        self.vocab_size.clamp(2, 151_643)
    }
}

/// Words random text prompts are made of (common English words, mostly one token each).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "water", "light",
    "river", "stone", "house", "music", "paper", "garden", "window", "number", "city", "road",
];

fn draw_len(rng: &mut ChaCha8Rng, range: LenRange) -> u32 {
    rng.random_range(range.min..=range.max)
}

fn random_tokens(rng: &mut ChaCha8Rng, limits: &ModelLimits, len: u32) -> Vec<u32> {
    let bound = limits.token_id_bound();
    (0..len).map(|_| rng.random_range(0..bound)).collect()
}

fn random_text(rng: &mut ChaCha8Rng, words: u32) -> String {
    let mut text = String::new();
    for i in 0..words {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    text
}

fn prompt_of(rng: &mut ChaCha8Rng, limits: &ModelLimits, format: PromptFormat, len: u32) -> Prompt {
    match format {
        PromptFormat::Tokens => Prompt::TokenIds(random_tokens(rng, limits, len)),
        PromptFormat::Text => Prompt::Text(random_text(rng, len)),
    }
}

/// `count` random prompts.
pub fn random(
    seed: u64,
    count: usize,
    limits: &ModelLimits,
    format: PromptFormat,
    input: LenRange,
    output: LenRange,
) -> Vec<Session> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let len = draw_len(&mut rng, input);
            let out = draw_len(&mut rng, output);
            Session::single(BenchRequest {
                prompt: prompt_of(&mut rng, limits, format, len),
                output: OutputLen::Tokens(out),
            })
        })
        .collect()
}

/// The shape of a prefix-repetition workload.
#[derive(Debug, Clone, Copy)]
pub struct PrefixRepetition {
    pub num_prefixes: u32,
    pub prefix_len: u32,
    pub suffix_len: u32,
}

/// `count` prompts, each one of the shared prefixes (in a seeded random order, every prefix
/// used about equally) followed by its own random suffix.
pub fn prefix_repetition(
    seed: u64,
    count: usize,
    limits: &ModelLimits,
    format: PromptFormat,
    shape: PrefixRepetition,
    output: LenRange,
) -> Vec<Session> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let prefixes: Vec<Prompt> = (0..shape.num_prefixes)
        .map(|_| prompt_of(&mut rng, limits, format, shape.prefix_len))
        .collect();
    // Round-robin over the prefixes, then shuffled: equal use, unpredictable order.
    let mut order: Vec<usize> = (0..count).map(|i| i % prefixes.len()).collect();
    rand::seq::SliceRandom::shuffle(order.as_mut_slice(), &mut rng);
    order
        .into_iter()
        .map(|p| {
            let suffix = prompt_of(&mut rng, limits, format, shape.suffix_len);
            let prompt = match (&prefixes[p], suffix) {
                (Prompt::TokenIds(prefix), Prompt::TokenIds(suffix)) => {
                    Prompt::TokenIds([prefix.as_slice(), suffix.as_slice()].concat())
                }
                (Prompt::Text(prefix), Prompt::Text(suffix)) => {
                    Prompt::Text(format!("{prefix} {suffix}"))
                }
                _ => unreachable!("prefix and suffix are written in the same format"),
            };
            Session::single(BenchRequest {
                prompt,
                output: OutputLen::Tokens(draw_len(&mut rng, output)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ModelLimits = ModelLimits {
        vocab_size: 151_936,
        max_model_len: 4096,
    };

    #[test]
    fn a_seed_names_one_workload() {
        let range = LenRange { min: 8, max: 64 };
        let a = random(7, 20, &LIMITS, PromptFormat::Tokens, range, range);
        assert_eq!(
            a,
            random(7, 20, &LIMITS, PromptFormat::Tokens, range, range)
        );
        assert_ne!(
            a,
            random(8, 20, &LIMITS, PromptFormat::Tokens, range, range)
        );
        for s in &a {
            let Prompt::TokenIds(ids) = &s.turns[0].prompt else {
                panic!("token prompt")
            };
            assert!((8..=64).contains(&(ids.len() as u32)));
            assert!(ids.iter().all(|&t| t < 151_643));
        }
    }

    #[test]
    fn prefix_repetition_shares_exact_prefixes() {
        let shape = PrefixRepetition {
            num_prefixes: 3,
            prefix_len: 32,
            suffix_len: 5,
        };
        let out = LenRange { min: 4, max: 4 };
        let w = prefix_repetition(1, 12, &LIMITS, PromptFormat::Tokens, shape, out);
        assert_eq!(
            w,
            prefix_repetition(1, 12, &LIMITS, PromptFormat::Tokens, shape, out)
        );
        let mut prefixes = std::collections::HashMap::new();
        for s in &w {
            let Prompt::TokenIds(ids) = &s.turns[0].prompt else {
                panic!("token prompt")
            };
            assert_eq!(ids.len(), 37);
            *prefixes.entry(ids[..32].to_vec()).or_insert(0) += 1;
        }
        // Three distinct prefixes, each used by exactly a third of the prompts.
        assert_eq!(prefixes.len(), 3);
        assert!(prefixes.values().all(|&n| n == 4));
    }

    #[test]
    fn text_prompts_have_the_asked_number_of_words() {
        let range = LenRange { min: 10, max: 10 };
        let w = random(3, 2, &LIMITS, PromptFormat::Text, range, range);
        let Prompt::Text(text) = &w[0].turns[0].prompt else {
            panic!("text prompt")
        };
        assert_eq!(text.split(' ').count(), 10);
    }
}
