"""Tokenizers: a local HF directory matches transformers' AutoTokenizer; the char tokenizer round-trips."""

import json

import pytest

from arealjax.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

# Qwen2.5's ChatML template, shortened: system default, roles, generation prompt.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = ["What is 12 + 30? Think step by step.", "The answer is \\boxed{42}.", "héllo wörld 🙂 tabs\tand\nlines"]
MESSAGES = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 4+4?"}]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE trained on a few lines, saved by transformers with a chat template and specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                  "<｜end▁of▁sentence｜>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20 + ["system user assistant helpful"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return path


def test_hf_tokenizer_matches_transformers(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    ours = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(ours, HFTokenizer)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    for gen in (True, False):
        text = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    prompt_ids = ours.encode(ours.apply_chat_template(MESSAGES))
    assert prompt_ids[0] == ref.convert_tokens_to_ids("<|im_start|>")
    assert ours.vocab_size == len(ref)
    assert ours.pad_id == ref.pad_token_id == 0
    assert set(ours.eos_ids) == {0, 2}  # generation_config.json eos ids plus the tokenizer eos


def test_token_bytes_are_the_bytes_each_token_stands_for(hf_tokenizer_dir):
    """A token may hold part of a UTF-8 character (this small BPE splits 🙂 and é into bytes; decode gives U+FFFD
    for such a token alone): the tokens' bytes, concatenated, are the text's UTF-8 (OpenAI's logprobs `bytes`)."""
    ours = load_tokenizer(hf_tokenizer_dir)
    for text in TEXTS + ["<|im_start|>user\n日本語<|im_end|>", "done<｜end▁of▁sentence｜>"]:
        ids = ours.encode(text)
        assert b"".join(ours.token_bytes(t) for t in ids) == text.encode()
    assert any("\ufffd" in ours.decode([t]) for t in ours.encode(TEXTS[2]))  # split characters are there
    char = CharTokenizer("ab🙂")
    assert b"".join(char.token_bytes(t) for t in char.encode("a🙂b")) == "a🙂b".encode()


def test_char_tokenizer_roundtrip_and_template(tmp_path):
    tok = CharTokenizer("0123456789+=? abc")
    ids = tok.encode("12+30=?")
    assert all(i >= 3 for i in ids) and tok.decode(ids) == "12+30=?"
    assert tok.encode("1", add_special_tokens=True) == [tok.bos_id, tok.encode("1")[0]]
    assert tok.decode([tok.bos_id, *ids, tok.eos_ids[0]], skip_special_tokens=False) == "<bos>12+30=?<eos>"
    assert tok.apply_chat_template([{"role": "user", "content": "1+1=?"}]) == "u:1+1=?\na:"
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.encode("abc") == tok.encode("abc")
    assert again.vocab_size == tok.vocab_size == 3 + 17


def test_tokenizer_errors(tmp_path, hf_tokenizer_dir):
    with pytest.raises(ValueError, match=r"character 'x' in '1x' is not in the character tokenizer's alphabet '0123' "
                                         r"\(config key tokenizer\.alphabet\)"):
        CharTokenizer("0123").encode("1x")
    with pytest.raises(ValueError, match="repeated characters"):
        CharTokenizer("aa")
    with pytest.raises(FileNotFoundError, match="no tokenizer in it \\(expected tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text((hf_tokenizer_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text('{\n  "eos_token": oops}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: invalid JSON at line 2"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES)
