"""`speccomp bench` on a tiny random Llama with token-id prompts: rows, identity flags, JSON schema, plot.

No timing assertions: performance numbers come only from `speccomp bench` runs, never from unit tests.
"""
import json

import pytest
import torch

import speccomp
from speccomp.tuning import bench
from speccomp.cli import build_parser, main
from speccomp.prompts import Prompt
from tiny_models import tiny_llama

MAX_NEW = 12


def _prompts():
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 96, (1, n), generator=gen) for n in (9, 14, 11)]
    # a repeated span gives prompt lookup something to find
    ids[2] = torch.cat([ids[2], ids[2][:, :6]], dim=1)
    cats = ["alpha", "beta", "alpha"]
    return [bench.BenchPrompt(f"p{i}", c, x) for i, (c, x) in enumerate(zip(cats, ids))]


@pytest.fixture(scope="module")
def result():
    model = tiny_llama()
    drafter = "layer_skip" if "layer_skip" in speccomp.available_drafters() else speccomp.available_drafters()[0]
    rows = ["hf_prompt_lookup", "plain", drafter]
    return bench.run_bench(model, _prompts(), rows, MAX_NEW, eos_token_id=None, warmup=1, progress=False, header={"note": "test"})


ROW_KEYS = {
    "drafter", "kind", "speedup", "tau", "identical", "tokens_per_second", "acceptance_by_depth", "per_category",
    "per_prompt", "new_tokens", "seconds", "prompts", "error", "mismatched_prompts", "backend", "tree", "compile_seconds",
    "kv_cache", "kv_mode", "lossless", "kv_bytes", "drafting",
}


def test_rows_and_identity(result):
    rows = result.row_dicts()
    names = [r["drafter"] for r in rows]
    assert names[0] == bench.BASELINE and names[1:3] == ["hf_prompt_lookup", "plain"] and len(names) == 4
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["identical"] is True and r["mismatched_prompts"] == []
        assert r["prompts"] == 3 and r["new_tokens"] == rows[0]["new_tokens"]
        assert r["speedup"] > 0 and r["tokens_per_second"] > 0
    base, pld, plain, drafted = rows
    assert base["speedup"] == pytest.approx(1.0) and base["tau"] == pytest.approx(1.0)
    assert plain["tau"] == pytest.approx(1.0) and plain["acceptance_by_depth"] == []
    # drafts were accepted (measured: HF prompt lookup tau 1.17; layer_skip tau 1.71, depth-1 acceptance 1.0)
    assert pld["tau"] > 1.0 and pld["kind"] == "hf" and plain["kind"] == "speccomp"
    assert drafted["tau"] > 1.2 and drafted["acceptance_by_depth"][0] > 0.5
    assert all(0.0 <= a <= 1.0 for a in drafted["acceptance_by_depth"])
    assert result.all_identical(("speccomp", "hf"))


def test_per_category(result):
    for r in result.row_dicts():
        assert set(r["per_category"]) == {"alpha", "beta"}
        assert r["per_category"]["alpha"]["prompts"] == 2 and r["per_category"]["beta"]["prompts"] == 1
        for c in r["per_category"].values():
            assert set(c) >= {"speedup", "tau", "tokens_per_second", "new_tokens", "seconds", "prompts"}
        assert [p["id"] for p in r["per_prompt"]] == ["p0", "p1", "p2"]


def test_json_schema(result, tmp_path):
    out = tmp_path / "sub" / "r.json"
    result.write_json(out)
    data = json.loads(out.read_text())
    assert set(data) == {"header", "rows"}
    h = data["header"]
    for key in ("cpu_count", "torch_threads", "torch_version", "date", "max_new_tokens", "n_prompts", "rows"):
        assert key in h, key
    assert h["note"] == "test" and h["max_new_tokens"] == MAX_NEW and h["n_prompts"] == 3
    assert h["torch_version"] == torch.__version__
    for row in data["rows"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert isinstance(row["identical"], bool) and isinstance(row["acceptance_by_depth"], list)
    # whether the compiled model drafts (tree="auto" compiles plain decoding where autotune found that no tree paid)
    assert [r["drafting"] for r in data["rows"]] == [None, None, False, True]  # hf, hf_prompt_lookup, plain, drafter


def test_markdown_and_plot(result, tmp_path):
    md = result.markdown()
    assert "| row |" in md and "speedup / tau per category" in md
    for r in result.row_dicts():
        assert f"| {r['drafter']} |" in md
    png = tmp_path / "r.png"
    result.plot(png)
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failed_row_is_reported_not_fatal():
    model = tiny_llama()
    spec = bench.RowSpec("broken", "speccomp", drafter="no_such_drafter")
    res = bench.run_bench(model, [torch.arange(3, 10)], [spec], 6, warmup=0, progress=False)
    base, broken = res.row_dicts()
    assert base["identical"] and not broken["identical"] and "no_such_drafter" in broken["error"]
    assert broken["prompts"] == 0 and broken["speedup"] is None
    assert not res.all_identical() and "ERROR" in res.markdown()


def test_prompts_with_repeated_ids_are_kept_apart():
    """Prompt files number their prompts from 0 each, so prompts from two files repeat ids. Each result must
    still be compared with the baseline on its own prompt: the baseline's speedup is exactly 1 and a row's is
    its own ratio of summed seconds, prompt by prompt."""
    model = tiny_llama()
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 96, (1, n), generator=gen) for n in (6, 15, 9, 12)]
    prompts = [bench.BenchPrompt(pid, cat, x) for pid, cat, x in zip(["0", "1", "0", "1"], ["a", "a", "b", "b"], ids)]
    assert [p.id for p in bench.prepare_prompts(prompts)] == ["0", "1", "0#2", "1#2"]
    tricky = [bench.BenchPrompt(pid, "a", ids[0]) for pid in ("0", "0", "0#2")]  # a suffix that is taken already
    assert len({p.id for p in bench.prepare_prompts(tricky)}) == 3
    res = bench.run_bench(model, prompts, ["plain"], 8, eos_token_id=None, warmup=0, progress=False)
    base, plain = res.row_dicts()
    assert base["speedup"] == 1.0 and all(c["speedup"] == 1.0 for c in base["per_category"].values())
    assert [m["id"] for m in plain["per_prompt"]] == ["0", "1", "0#2", "1#2"]
    by_pos = sum(m["seconds"] for m in base["per_prompt"]) / sum(m["seconds"] for m in plain["per_prompt"])
    assert plain["speedup"] == pytest.approx(by_pos)


def test_bad_inputs():
    model = tiny_llama()
    with pytest.raises(ValueError, match="baseline"):
        bench.run_bench(model, [torch.arange(3, 8)], ["hf_greedy"], 4, progress=False)
    with pytest.raises(ValueError, match="duplicate"):
        bench.run_bench(model, [torch.arange(3, 8)], ["plain", "none"], 4, progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        bench.prepare_prompts([Prompt("1", "c", "hello")])
    with pytest.raises(ValueError, match="max_new_tokens"):
        bench.run_bench(model, [torch.arange(3, 8)], [], 0, progress=False)


def test_default_rows_follow_registry():
    rows = bench.default_rows()
    assert [r.name for r in rows] == ["hf_prompt_lookup", "plain"] + speccomp.available_drafters()
    assert [r.name for r in bench.default_rows(["x"], hf_prompt_lookup=False)] == ["plain", "x"]


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(sub.choices)


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in _subcommands()])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: speccomp" in capsys.readouterr().out


def test_bench_subcommand_listed():
    assert "bench" in _subcommands()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--drafters", "nope"], "unknown drafter"),
        (["bench", "--drafters", "hydra+nope"], "merged with '+'"),
        (["bench", "--drafters", "hydra+eagle"], "at most one drafter that reads the model"),
        (["bench", "--drafters", "hydra+ngram", "--drafter-options", 'hydra+ngram={"heads": "x"}'], "go per drafter"),
        (["bench", "--drafters", "hydra", "--drafter-options", "eagle={}"], "one of the --drafters rows"),
        (["bench", "--drafters", "hydra", "--drafter-options", "hydra={bad"], "must be a JSON object"),
        (["bench", "--drafters", "hydra", "--drafter-options", "hydra=[1]"], "must be a JSON object"),
        (["bench", "--limit", "0"], "--limit"),
        (["bench", "--max-new-tokens", "0"], "max-new-tokens"),
        (["bench", "--prompts", "/nonexistent/p.jsonl"], "does not exist"),
        (["bench", "--kv", "sink:0"], "budget"),
        (["bench", "--kv", "kivi3"], "KIVI bits must be one of"),
    ],
)
def test_cli_bad_args_fail_before_loading(argv, words, capsys):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_kv_rows_report_bytes_and_label_lossy():
    """`speccomp bench --kv`: lossless draft rows match HF and hold fewer KV bytes; LOSSY target rows are
    labelled and do not fail the run's identity verdict."""
    model = tiny_llama()
    rows = ["plain"] + bench.kv_rows("sink:12:2") + bench.kv_rows("sink:12:2", "target")
    res = bench.run_bench(model, _prompts(), rows, 24, eos_token_id=None, warmup=0, progress=False)
    by_name = {r["drafter"]: r for r in res.row_dicts()}
    draft, target = by_name["kv-draft sink:12:2"], by_name["kv-target sink:12:2 (LOSSY)"]
    assert draft["error"] is None and target["error"] is None, (draft["error"], target["error"])
    assert draft["lossless"] and draft["identical"] and draft["kv_mode"] == "draft"
    assert not target["lossless"] and target["kv_mode"] == "target"
    for r in (draft, target):  # 30+ tokens of context, 12 kept
        assert r["kv_bytes"]["compressed"] < r["kv_bytes"]["full"] and r["kv_bytes"]["ratio"] > 1.5
    assert by_name["plain"]["kv_bytes"] is None
    md = res.markdown()
    assert "KV cache held" in md and "target (LOSSY)" in md and "draft (lossless)" in md
    assert res.all_identical(("speccomp",))  # the lossy row is left out of the verdict, by design


def test_kv_rows_bad_mode():
    with pytest.raises(ValueError, match="unknown --kv-mode"):
        bench.kv_rows("sink:8", "both")


def test_a_plot_flag_names_the_file_matplotlib_writes():
    """matplotlib adds .png to a name without a suffix: --plot / --report report (and check) that file."""
    from speccomp.cli import check_plot_flag

    assert check_plot_flag("plot", "out/speed") == "out/speed.png"
    assert check_plot_flag("plot", "speed.svg") == "speed.svg" and check_plot_flag("report", None) is None


def test_draft_model_rows_by_path_and_suffix_rows(tmp_path):
    """The rows benchmarks/draft_models.py measures: draft models named by path (one row per directory, a Hugging Face
    checkpoint of the model itself here) beside suffix; every row identical to HF greedy, the draft's drafts accepted."""
    model = tiny_llama(initializer_range=0.2)
    model.save_pretrained(tmp_path / "draft")  # the model as its own draft: its drafts are all accepted
    rows = [bench.RowSpec("draft_model itself", "speccomp", drafter="draft_model", tree=3,
                          drafter_options={"path": str(tmp_path / "draft")}), "suffix"]
    result = bench.run_bench(model, _prompts(), rows, MAX_NEW, eos_token_id=None, warmup=0, progress=False)
    base, drafted, suffix = result.row_dicts()
    assert [r["error"] for r in (drafted, suffix)] == [None, None]
    assert drafted["drafter"] == "draft_model itself" and drafted["drafter_options"] == {"path": str(tmp_path / "draft")}
    assert result.all_identical() and drafted["tau"] > 2 and drafted["acceptance_by_depth"][0] == 1.0


def test_host_ops_benchmark_times_each_operation_both_ways(tmp_path):
    """benchmarks/host_ops.py (without its model rows) runs and writes every operation's before and now."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "host_ops.py"
    spec = importlib.util.spec_from_file_location("host_ops_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        assert module.main(["--no-model", "--json", str(tmp_path / "ops.json")]) == 0
    finally:
        torch.set_num_threads(threads)  # the script runs torch on one thread
    rows = json.loads((tmp_path / "ops.json").read_text())["rows"]
    assert set(rows) == {"argmax_5", "argmax_20", "gather_8_of_20", "tree_21_nodes", "top_k_5", "top_k_20", "top_logp_4"}
    assert all(v > 0 for row in rows.values() for v in row.values())
    assert set(rows["argmax_20"]) == {"torch", "numpy"} and set(rows["gather_8_of_20"]) == {"list_index", "index_select"}
    assert set(rows["tree_21_nodes"]) == {"torch_writes", "from_parents"}


def test_backends_benchmark_selects_prompts_as_hf_alone_does(smollm):
    """benchmarks/backends.py's prompt selection (shared with hf_alone.py, so its HF-alone baseline times the very
    prompts of a run): --skip checked at parse time, the 0-based indices left out of every file; per-file cells."""
    import argparse
    import importlib.util
    from pathlib import Path

    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "backends.py"
    spec = importlib.util.spec_from_file_location("backends_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.skip_indices("2,3") == "2,3" and module.skip_indices("") == ""
    with pytest.raises(argparse.ArgumentTypeError, match=r"'2,x' is not comma-separated.*--skip 2,3"):
        module.skip_indices("2,x")
    _, tok = smollm
    chosen = module.select_prompts(tok, "gsm8k,vicuna_bench", 4, "0,2")
    assert [f for f, _ in chosen] == ["gsm8k", "gsm8k", "vicuna_bench", "vicuna_bench"]
    kept = [chat_ids(tok, p.text) for f in ("gsm8k", "vicuna_bench") for i, p in enumerate(load_prompts(f, limit=4))
            if i in (1, 3)]
    assert all(torch.equal(ids, want) for (_, ids), want in zip(chosen, kept))
    assert module.by_file({"geomean_by_file": {"gsm8k": 2.0, "vicuna_bench": 1.234}}) == "2.00x / 1.23x"


def test_floor_pairs_blocks_of_steps_and_drops_each_blocks_first_call(monkeypatch):
    """benchmarks/floor.py's paired ratio: each round times a block of plain steps and a block of tree steps back to
    back (order alternating round by round) and compares the blocks' medians without their first call (a session's
    first call after another shape pays for the switch). A fake clock: no timing in the test."""
    import importlib.util
    import time
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))
    spec = importlib.util.spec_from_file_location("floor_benchmark", bench_dir / "floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    clock, calls = [0.0], []

    def step(name, cost):
        def run():
            first = not calls or calls[-1] != name  # the first call of a block (the shape switched)
            calls.append(name)
            clock[0] += cost + (5.0 if first else 0.0)  # a switch costs the same to both shapes
        return run

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    ratios = module.paired_ratios(step("plain", 1.0), step("tree", 1.3), rounds=4, block=2)
    assert ratios == pytest.approx([1.3] * 4)  # the switch's cost left out of every block (kept, they would read 3.8 / 3.5)
    blocks = [calls[i] for i in range(2, len(calls), 2)]  # after the two warm-up calls, one name per block of 2
    assert blocks == ["plain", "tree", "tree", "plain", "plain", "tree", "tree", "plain"]


def test_score_gemm_benchmark_runs_and_writes_every_row(tmp_path):
    """benchmarks/score_gemm.py (the attention scores' cost per query row) on a short cache: a row per M, in order."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "score_gemm_benchmark", Path(__file__).resolve().parent.parent / "benchmarks" / "score_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "scores.json"
    assert module.main(["--keys", "64", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["gemm"], r["rows"]) for r in report["rows"]] == [(g, m) for g in ("Q.K^T", "K.Q^T (operands swapped)", "P.V")
                                                                 for m in (1, 2, 3, 5)]
    assert all(r["ms"] > 0 for r in report["rows"])
    assert report["command"].endswith("--json " + str(out))
    with pytest.raises(SystemExit):  # argparse: "--keys: ... 0 ..."; nothing timed or written
        module.main(["--keys", "0", "--json", str(tmp_path / "never.json")])
    assert not (tmp_path / "never.json").exists()
