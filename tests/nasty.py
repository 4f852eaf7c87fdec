"""Prompts that break cross-tokenizer bridges: each one names what it stresses."""

NASTY_PROMPTS: dict[str, str] = {
    "python_deep_indent": (
        "class Tree:\n    def walk(self, node):\n        for child in node.children:\n"
        "            if child.leaf:\n                yield child\n            else:\n"
        "                yield from self.walk(child)\n\n    def depth(self, node):\n        "
    ),
    "prose": "The history of the printing press begins in the fifteenth century, when",
    "unicode_mix": "Café, naïve, façade, Ångström, 😀🎉 and 你好世界 — translate to French:",
    "combining_accents": "cafe\u0301 re\u0301sume\u0301 n\u0303 a\u0308 o\u0302: write three more like these:",
    "cjk": "日本語の文章を書いてください。東京は",
    "emoji_run": "Rate it: ⭐⭐⭐⭐⭐ 🍕🍕🍕 👍🏽👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵 next:",
    "spaces_tabs": "a\t\tb    c      d\t e  \t f\n\t\t\tindented\n        eight spaces then",
    "crlf": "line one\r\nline two\r\n\r\nline four\r\nSo the next line is",
    "long_digits": "pi = 3.14159265358979323846264338327950288419716939937510 and e = 2.71828",
    "phone_numbers": "Call 0044 20 7946 0958 or +1-202-555-0173; the order id is 000000012345678901",
    "repeated_chars": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbbbbbbbbb",
    "repeated_digits": "9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9",
    "alignment_tie": "1 2 3 1 2 3 1 2 3 1 2",
    "byte_fallback": "Rare glyphs: \U00010348 \U0001d54f \u2fd5 \U0001f9ec \u0f3a\u0f3b and then",
    "special_token_text": "<bos> <eos> <|im_start|>user <start_of_turn> </s> are just text here; continue:",
    "json": '{"name": "Ada", "tags": ["x", "y"], "nested": {"k": [1, 2, {"z": null}]}, "next":',
    "markdown_table": "| col a | col b |\n|-------|-------|\n| 1     | 2     |\n| 3     |",
    "javascript": "function debounce(fn, ms) {\n  let t;\n  return (...args) => {\n    clearTimeout(t);\n",
    "rust": 'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", ',
    "sql": "SELECT u.id, COUNT(o.id) AS orders\nFROM users u\nLEFT JOIN orders o ON o.user_id = u.id\n",
    "html": '<ul>\n  <li><a href="/a?x=1&amp;y=2">A</a></li>\n  <li>',
    "math": "Solve for x: 3x + 7 = 22. Step 1:",
    "qa": "Q: What is the boiling point of water at sea level in Fahrenheit?\nA:",
    "story": "Once upon a time, in a village at the edge of a dark forest, there lived",
    "german": "Die Straße war nass, und die Bäume rauschten über uns, als wir",
    "russian": "Москва — столица России. Город расположен",
    "arabic": "مرحبا بالعالم. اللغة العربية",
    "hindi": "नमस्ते दुनिया। भारत एक",
    "latex": "\\begin{equation}\n  E = mc^2 \\quad \\int_0^\\infty e^{-x^2}\\,dx =",
    "urls": "See https://example.com/path?q=a%20b&x=1#frag and ftp://host/file.tar.gz then",
    "single_char": "a",
    "whitespace_only_tail": "The answer is:   \n\n  ",
}
