"""GGUF import (arealjax.models.gguf): dequantization against llama.cpp's own `gguf` package, round trips of tiny
transformers models written as llama.cpp writes them (weights, config, tokenizer, chat template), the Llama q/k
un-permutation and tied embeddings, and clear errors on bad files."""

import contextlib
import json
import signal

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hf_models import hf_logits, make_hf_model

from arealjax.models import load_pretrained
from arealjax.models.gguf import GGUFFile, convert, dequantize, main, tokenizer_files
from arealjax.tiny import CHATML
from arealjax.tokenizer import load_tokenizer, render_chat

TOL = 1e-4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = CHATML.replace("SYSTEM", "You are a helpful assistant.")
CHAT = [{"role": "user", "content": "What is 12345 + 678?"}, {"role": "assistant", "content": "13023, naïve 🙂"}]
TEXTS = ["12345 apples and 6789 pears", "héllo wörld — 日本語 🙂", "a  b\t\tc\n\n\n  d   ", "I'M here, you'LL see",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # square"]
CORPUS = TEXTS * 3 + [TEMPLATE] * 3 + ["Natalia sold clips to 48 of her friends in April, and then she sold half "
                                       "as many clips in May. How many clips did Natalia sell in April and May?"] * 4
# Pre-tokenizers as the models' own tokenizer.json files spell them (GPT-2, SmolLM2, Qwen2.5, Llama 3): the
# reference the converter's `tokenizer.ggml.pre` table must reproduce.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}  # what convert_hf_to_gguf.py writes per family


def reference_tokenizer(pre: str, vocab_size: int = 512):
    """A byte-level BPE trained on CORPUS, with the pre-tokenizer (and, for Llama 3, `ignore_merges`) of the model
    family whose GGUFs carry `tokenizer.ggml.pre` = `pre`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = lambda regex: [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),  # noqa: E731
                           pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    steps = {"gpt2": [byte_level], "smollm": [pre_tokenizers.Digits(individual_digits=True), byte_level],
             "qwen2": split(QWEN2_REGEX), "llama-bpe": split(LLAMA3_REGEX)}[pre]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # see below
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    # Merges learned across every boundary (digit runs, spaces before words and numbers, whitespace runs): only the
    # pre-tokenizer, set now, stops them, so a converted tokenizer with another one encodes differently.
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.model.ignore_merges = pre == "llama-bpe"
    return tok


def tokenizer_metadata(tok, pre: str) -> dict:
    """`tok` as llama.cpp's GGUF tokenizer keys (ids in order; specials are control tokens, type 3)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
            "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"], "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
            "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"], "tokenizer.chat_template": TEMPLATE}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF's two RoPE halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def write_gguf(path, model, tok, *, quantize: dict | None = None, arch: str | None = None):
    """`model` (transformers) and `tok` (tokenizers) written to `path` as llama.cpp's converter writes them: its
    tensor names (the gguf package's own HF -> GGUF name map), Llama's q/k rows permuted, no `output.weight` when the
    embeddings are tied, `{arch}.*` hyper-parameters and the tokenizer keys. Tensors in F32 except the GGUF names in
    `quantize` (name -> type); `arch` overrides the architecture written in the metadata."""
    cfg, family = model.config, model.config.model_type
    arch = arch or family
    names = gguf.get_tensor_name_map({"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                                      "qwen3": gguf.MODEL_ARCH.QWEN3}[family], cfg.num_hidden_layers)
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv),
                       ("attention.key_length", dim), ("attention.value_length", dim),
                       ("rope.dimension_count", dim), ("vocab_size", cfg.vocab_size)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    for key, value in tokenizer_metadata(tok, PRE[family]).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = permute(data, heads if "attn_q" in name else kv)
        kind = (quantize or {}).get(name, Q.F32)
        w.add_tensor(name, gguf.quants.quantize(data, kind) if kind != Q.F32 else data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(family: str, tok, **overrides):
    """conftest's tiny model of `family` with `tok`'s vocabulary (and no Llama 3 RoPE scaling: llama.cpp keeps
    that in a `rope_freqs` tensor, which the converter refuses)."""
    if family == "llama":
        overrides.setdefault("rope_scaling", None)
    return make_hf_model(family, vocab_size=tok.get_vocab_size(), **overrides)


def tokens_for(model) -> np.ndarray:
    return np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 37)).astype(np.int32)


def our_logits(path, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(load_pretrained(path)(tokens))


def transformers_gguf(directory, file: str, config_dir):
    """transformers' own GGUF loader's model of `directory/file` (fp32, eval), with the config.json in `config_dir`
    (its GGUF config mapping drops `attention.key_length`: Qwen3's head_dim != hidden / heads would not load)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, config=config)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model.eval()


def state(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


def safetensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(path / "model.safetensors")


@contextlib.contextmanager
def deadline(seconds: int):
    """Fails the test, instead of hanging it, if the block runs longer than `seconds`."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    """A Llama GGUF (GQA 4:1, untied), its tokenizer and the torch model it was written from."""
    tok = reference_tokenizer("llama-bpe")
    model = tiny_model("llama", tok)
    return write_gguf(tmp_path_factory.mktemp("llama") / "m.gguf", model, tok), tok, model


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda k: k.name)
def test_dequantize_equals_gguf_package(kind):
    """Each supported type decodes bit for bit as llama.cpp's Python package decodes it (exact equality: both
    compute d * q (+ m) in float32), over several rows of several blocks."""
    x = (np.random.default_rng(0).standard_normal((3, 4, 96)) * [[[0.01]], [[1.0]], [[50.0]]]).astype(np.float32)
    raw = gguf.quants.quantize(x, kind)
    ours = dequantize(raw.view(np.uint8).reshape(-1), int(kind), x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, kind))


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    """A Q4_K tensor (type 12; k-quants are not decoded) fails the conversion with the tensor's name and the type
    in the message, not with garbage weights."""
    tok = reference_tokenizer("qwen2")
    model = tiny_model("qwen3", tok)
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    with pytest.raises(ValueError, match=r"tensor 'x'.*type 12 \(Q4_K\) is not supported"):
        dequantize(np.zeros(144, np.uint8), int(Q.Q4_K), (256,), where="tensor 'x'")
    f = GGUFFile(path)
    assert f.tensors["blk.0.ffn_up.weight"].type == Q.F32
    raw = path.read_bytes()
    # rewrite that tensor's type field (name, u32 n_dims, u64 dims, then u32 type) as Q4_K: a well-formed header
    at = raw.index(b"blk.0.ffn_up.weight") + len("blk.0.ffn_up.weight") + 4 + 8 * 2
    assert int.from_bytes(raw[at: at + 4], "little") == Q.F32
    (tmp_path / "k.gguf").write_bytes(raw[:at] + int(Q.Q4_K).to_bytes(4, "little") + raw[at + 4:])
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_up\.weight'.*type 12 \(Q4_K\) is not supported"):
        convert(tmp_path / "k.gguf", tmp_path / "out")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_roundtrip_matches_torch_and_transformers(tmp_path, family):
    """A tiny model written as llama.cpp writes it converts to a directory whose logits are the torch model's
    (fp32), whose weights are the ones transformers' own GGUF loader reads, whose config keeps the family's
    features (Qwen2 bias + tied embeddings, Qwen3 q/k norm with head_dim != hidden/heads, Llama GQA 4:1), and
    whose tokenizer encodes like the original with the chat template kept."""
    tok = reference_tokenizer(PRE[family])
    model = tiny_model(family, tok)
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    out = convert(path, tmp_path / "hf")
    tokens = tokens_for(model)
    np.testing.assert_allclose(our_logits(out, tokens), hf_logits(model, tokens), atol=TOL, rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] == (family == "qwen2")
    assert config["head_dim"] == head_dim(model.config) and config["vocab_size"] == tok.get_vocab_size()
    ours, theirs = safetensors(out), state(transformers_gguf(tmp_path, "m.gguf", out))
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    for name, w in ours.items():
        np.testing.assert_array_equal(w, theirs[name], err_msg=name)
    converted = load_tokenizer(out)
    for text in TEXTS + [render_chat(TEMPLATE, CHAT, True)]:
        assert converted.encode(text) == tok.encode(text).ids, text
    assert converted.chat_template == TEMPLATE
    assert converted.apply_chat_template(CHAT) == render_chat(TEMPLATE, CHAT, True)
    assert converted.eos_ids[0] == tok.token_to_id("<|im_end|>")


def test_q8_0_weights_read_as_llama_cpp_stores_them(tmp_path, llama_file):
    """With the (permuted) q projection and an MLP matrix stored in Q8_0, the converted weights are exactly what
    transformers' GGUF loader (the gguf package's dequantization, its own un-permutation) reads, the quantized ones
    differ from the originals by Q8_0's rounding only, and the logits match transformers' model of the same file."""
    _, tok, model = llama_file
    quantize = {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q8_0}
    write_gguf(tmp_path / "q.gguf", model, tok, quantize=quantize)
    out = convert(tmp_path / "q.gguf", tmp_path / "hf")
    hf = transformers_gguf(tmp_path, "q.gguf", out)
    ours, theirs = safetensors(out), state(hf)
    for name, w in ours.items():
        np.testing.assert_array_equal(w, theirs[name], err_msg=name)
    original = state(model)
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]:
        err = np.abs(ours[name] - original[name]).max()
        assert 0 < err < 0.01 * np.abs(original[name]).max(), name
    tokens = tokens_for(model)
    np.testing.assert_allclose(our_logits(out, tokens), hf_logits(hf, tokens), atol=TOL, rtol=0)


def test_llama_qk_unpermutation_is_needed(tmp_path, llama_file, monkeypatch):
    """Without undoing llama.cpp's q/k row permutation the Llama logits are far off the torch model's: the
    round-trip parity really depends on it (q with 4 heads, k with 1 KV head)."""
    path, _, model = llama_file
    tokens = tokens_for(model)
    np.testing.assert_allclose(our_logits(convert(path, tmp_path / "ok"), tokens), hf_logits(model, tokens),
                               atol=TOL, rtol=0)
    monkeypatch.setattr("arealjax.models.gguf.unpermute", lambda w, heads: w)
    broken = our_logits(convert(path, tmp_path / "broken"), tokens)
    assert np.abs(broken - hf_logits(model, tokens)).max() > 100 * TOL


def test_missing_output_tensor_means_tied_embeddings(tmp_path):
    """A Llama GGUF without `output.weight` (llama.cpp drops it when the embeddings are tied) converts to a tied
    model: `tie_word_embeddings` true, no lm_head tensor, logits equal to the tied torch model's."""
    tok = reference_tokenizer("llama-bpe")
    model = tiny_model("llama", tok, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    assert "output.weight" not in GGUFFile(path).tensors
    out = convert(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in safetensors(out)
    tokens = tokens_for(model)
    np.testing.assert_allclose(our_logits(out, tokens), hf_logits(model, tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_tokenizer_matches_original(tmp_path, pre):
    """For each supported `tokenizer.ggml.pre`, the tokenizer built from the GGUF keys encodes digits (one by one,
    in threes, or in runs, per family), unicode, whitespace runs, contractions, code and a rendered chat (specials
    as single ids) to the ids of the original, and decodes them back, specials skipped or kept, alike."""
    tok = reference_tokenizer(pre)
    files = tokenizer_files({"general.architecture": "llama", **tokenizer_metadata(tok, pre)})
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    converted = load_tokenizer(tmp_path)
    assert converted.vocab_size == tok.get_vocab_size()
    for text in TEXTS + [render_chat(TEMPLATE, CHAT, True)]:
        ids = tok.encode(text).ids
        assert converted.encode(text) == ids, text
        assert converted.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
        assert converted.decode(ids) == tok.decode(ids)
    assert converted.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]


def test_llama_bpe_takes_whole_words_from_the_vocabulary(tmp_path):
    """llama.cpp (`ignore_merges` for pre 'llama-bpe') and Llama 3's tokenizer.json (`"ignore_merges": true`) emit
    a pre-tokenized word that is itself a token as that token, even where the merges would split it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet) + ["ab", "abc"]  # no merge builds "abc"
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}
    (tmp_path / "tokenizer.json").write_text(tokenizer_files(meta)["tokenizer.json"])
    ref = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [("a", "b")], ignore_merges=True))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # splits "abc abcd" as Llama 3's regex
    ref.decoder = decoders.ByteLevel()
    assert ref.encode("abc abcd").ids == [tokens.index(t) for t in ["abc", "Ġ", "ab", "c", "d"]]
    assert load_tokenizer(tmp_path).encode("abc abcd") == ref.encode("abc abcd").ids


def test_bad_files_fail_fast_with_clear_errors(tmp_path, llama_file):
    """Not a GGUF, empty, cut anywhere (in the header or in the tensor data), missing, or of an unsupported
    architecture: each fails within seconds with an error naming the problem."""
    path, tok, model = llama_file
    raw = path.read_bytes()
    cases = {"zip.gguf": (b"PK\x03\x04" + bytes(60), ValueError, "not a GGUF file"),
             "empty.gguf": (b"", ValueError, "empty.gguf: not a GGUF file"),
             "header.gguf": (raw[:40], ValueError, "truncated"),
             "half.gguf": (raw[: len(raw) // 2], ValueError, "truncated")}
    for name, (data, error, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with deadline(10), pytest.raises(error, match=message):
            convert(tmp_path / name, tmp_path / "out")
    with deadline(10), pytest.raises(FileNotFoundError, match="no such file"):
        convert(tmp_path / "missing.gguf", tmp_path / "out")
    write_gguf(tmp_path / "falcon.gguf", model, tok, arch="falcon")
    with deadline(10), pytest.raises(ValueError, match="architecture 'falcon' is not supported"):
        convert(tmp_path / "falcon.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_bad_file_exits_2_with_one_line_error(tmp_path, capsys):
    """`python -m arealjax.models.gguf` on a file that is not GGUF: exit code 2 and one `error: ...` line naming
    the file, no traceback."""
    (tmp_path / "x.gguf").write_text("hello")
    with deadline(10):
        assert main([f"--gguf={tmp_path / 'x.gguf'}", f"--out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "x.gguf: not a GGUF file" in err and err.count("\n") == 1
