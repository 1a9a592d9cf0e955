"""The tiny models' tokenizers, trained here on an embedded corpus: a byte-level BPE for the text models (the
architecture's real special tokens, exactly ``vocab_size`` tokens) and a lower-casing WordPiece for the encoders,
with the ``tokenizer_config.json`` and ``special_tokens_map.json`` that go beside a BPE one.

Training is deterministic: the corpus and the pseudo-words that pad it (:func:`pseudo_text`) depend on nothing
but the requested size, never on ``spec.seed``.
"""

from __future__ import annotations

import random
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from runtime.tiny.archs import ArchInfo
from runtime.tiny.spec import TinySpec

# Varied text so common English, code, JSON and non-ASCII pieces get merges.
CORPUS = r"""
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was a bright cold day in April, and the clocks were striking thirteen. The weather today is sunny
with a high of 23 degrees and a light breeze from the west. Please remember to bring an umbrella tomorrow.
Hello, world! How are you doing today? I'm fine, thanks for asking. What's the plan for the weekend?
We'll meet at the café near the station at 10:30 and then walk to the museum. Don't forget the tickets.
The committee reviewed the proposal and agreed that the budget should be increased by 15% next year.
Machine learning models learn patterns from data; large language models predict the next token.
The assistant answered the user's question politely, explained the reasoning, and cited its sources.
You are a helpful assistant. Answer the question concisely. If you don't know the answer, say so.
System: be brief. User: what is the capital of France? Assistant: The capital of France is Paris.
Once upon a time there was a little robot who wanted to learn how to paint the ocean at sunset.
She opened the window, listened to the rain, and wrote three pages before the kettle began to whistle.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -17 1e-6 0.02
Dates and times: 2024-07-26, 12/31/1999, 09:15:00 UTC, Monday, Tuesday, Wednesday, January, February.
Money and units: $19.99, €5.50, £3, ¥1200, 5 km, 12 kg, 37.5 °C, 60 mph, 8 GB of RAM, 2.4 GHz.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self) -> None:
        self.items: list[int] = []

    def push(self, item: int) -> None:
        self.items.append(item)

    def pop(self) -> int:
        return self.items.pop()

for i in range(10):
    print(f"value = {i * i}")

import json
with open("config.json", "r", encoding="utf-8") as f:
    config = json.load(f)

function add(a, b) { return a + b; }
const result = await fetch("https://example.com/api/v1/items?limit=10");
if (result.status !== 200) { throw new Error("request failed"); }
SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;
#include <stdio.h>
int main(void) { printf("hello\n"); return 0; }
fn main() { let v: Vec<u32> = (0..10).collect(); println!("{:?}", v); }

{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
{"id": 7, "tags": ["alpha", "beta"], "score": 0.875, "ok": true, "next": null}
[1, 2, 3, {"key": "value"}, "text", false]
<tool_call>
{"name": "lookup", "arguments": {"id": 42}}
</tool_call>
<think>
The user wants a short answer, so I should keep it to one sentence.
</think>

Café, naïve, résumé, façade, jalapeño, München, Zürich, São Paulo, Kraków, Ελληνικά, русский язык.
日本語のテキストも少し含めます。東京は日本の首都です。こんにちは、世界！
中文：你好，世界。今天天气很好。我们去公园散步吧。
한국어: 안녕하세요, 만나서 반갑습니다.
العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
Emoji: 🎉 😀 🚀 ❤️ 👍 🔥 ✨ 🌍 🤖 ☕ — “quotes”, ‘single’, ellipsis… and bullets • here.
Math: ∑ x² + √y ≤ ∞, α β γ δ π λ, 3 × 4 = 12, 10 ÷ 2 = 5, ±1, ≠, ≈.
"""

# Llama 3's split regex: words, 1-3 digit number groups, punctuation runs, whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_ONSETS = ("", *"b c d f g h k l m n p r s t v w z st tr ch sh pl gr".split())
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ng", "ck")


def pseudo_text(n_words: int) -> list[str]:
    """Deterministic word-like filler so BPE has enough distinct pairs to merge."""
    rng = random.Random(0x71A7)  # fixed: the tokenizer must not depend on spec.seed
    lines: list[str] = []
    words: list[str] = []
    for _ in range(n_words):
        syllables = rng.randint(1, 4)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if rng.random() < 0.15:
            word = word.capitalize()
        words.append(word)
        if len(words) == 12:
            lines.append(" ".join(words) + rng.choice((".", ",", "!", "?", ";", ":")))
            words = []
    if words:
        lines.append(" ".join(words))
    return lines


def train_tokenizer(info: ArchInfo, vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly ``vocab_size`` tokens and the arch's specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(info.added),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in info.special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = CORPUS.splitlines() + pseudo_text(n_words=vocab_size * 3)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in info.added])
    shortfall = vocab_size - tok.get_vocab_size()
    if shortfall > 0:
        tok.add_special_tokens(
            [AddedToken(info.reserved_fmt.format(i), special=True, normalized=False) for i in range(shortfall)]
        )
    if info.prepend_bos:
        assert info.bos is not None
        bos_id = tok.token_to_id(info.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{info.bos} $A", pair=f"{info.bos} $A {info.bos}:1 $B:1", special_tokens=[(info.bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def _token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def tokenizer_config(info: ArchInfo, tok: Tokenizer, spec: TinySpec) -> dict[str, Any]:
    decoder = {
        str(i): {**_token_entry(t.content), "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": info.bos,
        "eos_token": info.eos,
        "pad_token": info.pad,
        "unk_token": info.unk,
        "chat_template": ([{"name": name, "template": text} for name, text in info.named_templates]
                          if info.named_templates else info.chat_template),
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "split_special_tokens": False,
        # The generic fast class loads tokenizer.json as-is, offline, on any transformers.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map(info: ArchInfo) -> dict[str, Any]:
    roles = {"bos_token": info.bos, "eos_token": info.eos, "pad_token": info.pad, "unk_token": info.unk}
    return {role: _token_entry(t) for role, t in roles.items() if t is not None}


_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def wordpiece_tokenizer(spec: TinySpec) -> Tokenizer:
    """A lower-casing WordPiece tokenizer as BERT-family checkpoints ship it: ``[CLS] a [SEP]``, and
    ``[CLS] a [SEP] b [SEP]`` for pairs."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=spec.vocab_size, special_tokens=list(_BERT_SPECIALS))
    tok.train_from_iterator([CORPUS, *pseudo_text(20000)], trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok
