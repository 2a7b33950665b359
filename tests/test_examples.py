"""Every script in examples/ runs with --tiny (a tiny random Llama built in the script) and says its check passed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = {  # script -> a line its output must hold
    "compile_and_generate.py": "identical: True",
    "watch_the_passes.py": "tree_mask is a graph input now: True",
    "custom_pass_and_drafter.py": "identical: True",
    "engine_without_torch.py": "identical: True",
    "autotune_tree.py": "identical: True",
    "train_heads.py": "identical: True",
    "batch_and_serve.py": "identical: True",
}


def test_every_example_is_tested():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLES)


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_tiny(script, tmp_path):
    # one thread (as the rest of the suite); the user cache and temporary files point into tmp_path
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECCOMP_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    env.pop("SPECCOMP_DEBUG", None)
    run = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert EXAMPLES[script] in run.stdout.splitlines(), run.stdout[-3000:]
    assert not (tmp_path / "cache").exists()  # the user's cache is left alone
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own cache
    assert left == [], left  # the examples' temporary files are removed at exit


def test_watch_the_passes_reads_this_runs_dumps_from_a_folder_that_holds_files(tmp_path):
    """--out into a folder that already holds files (a user's, or the dumps of the documented command run before):
    speccomp writes into a fresh run-N folder there, and the example read the folder's top instead (no dumps:
    StopIteration; or the earlier run's dumps, reported as this run's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECCOMP_CACHE": str(tmp_path / "cache")}
    env.pop("SPECCOMP_DEBUG", None)
    out = tmp_path / "dumps"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for run_n in (1, 2):
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "watch_the_passes.py"), "--tiny", "--out",
                              str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"graph dumps in {out / f'run-{run_n}'}:" in run.stdout, run.stdout[-2000:]
    assert (out / "notes.txt").read_text() == "mine"
