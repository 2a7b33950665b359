"""`speccomp serve --replicas N` (speccomp/serve_ray.py): the OpenAI-compatible app as two Ray Serve replicas on a
local Ray cluster of this machine (loopback only). Concurrent requests are spread over both replica processes and
each gets its prompt's own HF greedy text."""
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_serve import EOS, engine_path, model  # noqa: F401 - the same tiny model and engine fixtures
from test_speculative import hf_greedy

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def replicas(engine_path):
    import ray
    from ray import serve

    from speccomp.serve_ray import application, no_telemetry

    no_telemetry()  # before ray.init: the cluster's processes read it
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a local cluster of this machine: no dashboard, workers see this test's sys.path (tiny models are not needed
    # there, but speccomp must import the same way)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(engine_path, replicas=2, max_batch=4, kv_slots=1024, threads=1, cpus_per_replica=0.5),
                  name="speccomp", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_and_each_answer_is_hf_greedy(replicas, model):
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 9, 14, 20, 7, 11, 6, 16)]

    def ask(prompt):
        r = httpx.post(f"{replicas}/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0},
                       timeout=120)
        return r.status_code, r.headers.get("x-speccomp-server"), r.json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts + prompts))  # each prompt twice
    for prompt, (status, _, answer) in zip(prompts + prompts, answers):
        assert status == 200, answer
        want = hf_greedy(model, torch.tensor([prompt]), 20, eos=EOS)[0, len(prompt):].tolist()
        assert answer["choices"][0]["token_ids"] == (want[: want.index(EOS) + 1] if EOS in want else want)
    servers = {server for _, server, _ in answers}
    assert len(servers) == 2, servers  # both replica processes answered
    health = httpx.get(f"{replicas}/health", timeout=30)
    assert health.json() == {"status": "ok"}


def test_bad_request_through_the_proxy_is_still_a_400(replicas):
    r = httpx.post(f"{replicas}/v1/completions", json={"prompt": [5, 6], "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("options, words", [
    ({"replicas": 0}, "replicas=0: must be a positive int"),
    ({"max_batch": "8"}, "max_batch='8': must be a positive int"),
    ({"kv_slots": 0}, "kv_slots=0: must be a positive int"),
    ({"threads": True}, "threads=True: must be a positive int"),
    ({"cpus_per_replica": -1}, "cpus_per_replica=-1: must be a number >= 0"),
])
def test_replica_options_are_checked_in_the_callers_process(options, words):
    from speccomp.errors import OptionError
    from speccomp.serve_ray import application

    with pytest.raises(OptionError, match=words):
        application("unused", **options)


def test_a_bad_engine_directory_fails_before_ray_starts(tmp_path):
    """The directory is checked in the calling process, with the engine's own message, before a cluster or a replica
    exists (no ONNX Runtime session is built there)."""
    from speccomp.engine.runtime import EngineError
    from speccomp.serve_ray import serve_replicas

    with pytest.raises(EngineError, match="no engine directory"):
        serve_replicas(tmp_path / "missing", replicas=2)
    with pytest.raises(EngineError, match="is not a speccomp engine"):
        serve_replicas(tmp_path, replicas=2)


def test_sizes_and_batching_are_checked_before_ray_starts(engine_path, model, tmp_path):
    """--kv-slots too small for one request and an engine whose drafter cannot batch failed inside every replica
    (pages of Ray tracebacks); now in the calling process, with the message `speccomp serve` gives."""
    import speccomp
    from speccomp.engine.runtime import EngineError
    from speccomp.errors import OptionError
    from speccomp.serve_ray import application, serve_replicas

    with pytest.raises(OptionError, match="^kv_slots=3: must be an int >= "):
        serve_replicas(engine_path, replicas=2, kv_slots=3)
    with pytest.raises(OptionError, match="^kv_slots=10: must be an int >= "):  # Python's path: Ray said "failed"
        application(engine_path, kv_slots=10)
    with pytest.raises(OptionError, match="^max_batch=0: must be a positive int"):
        serve_replicas(engine_path, replicas=2, max_batch=0)
    path = tmp_path / "early_exit"
    speccomp.compile(model, drafter="early_exit", drafter_options={"exit_layer": 1}, backend="onnxruntime").export(path)
    with pytest.raises(EngineError, match="--no-draft"):
        serve_replicas(path, replicas=2)
    with pytest.raises(EngineError, match="--no-draft"):
        application(path)
