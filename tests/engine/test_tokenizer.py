"""The GGUF tokenizer and chat template against Hugging Face's conversion of the same file."""

import pytest

TEXTS = [
    "Hello, world!",
    "  leading spaces\n\nand\ttabs",
    "Über café naïve — 日本語 テスト 🙂",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nHi<|im_end|>\n",
    "1234567890 3.14159 -42",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_hf(smollm, hf_tokenizer, text):
    ids = smollm.tokenizer.encode(text)
    assert ids == hf_tokenizer(text).input_ids
    assert smollm.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_renders_like_hf(smollm, hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    ours = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == theirs
