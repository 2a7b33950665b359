"""`speccomp serve ENGINE_DIR --replicas N`: the OpenAI-compatible server of speccomp/serve.py as N Ray Serve replicas.

    pip install 'speccomp[ray]'
    speccomp serve engine/ --replicas 2 --port 8000        # starts a local Ray cluster, or joins RAY_ADDRESS's

Each replica is a Ray actor (a process of its own, on any node of the cluster) that loads the engine and builds the
same FastAPI app as `speccomp serve` (`make_app`): its own scheduler thread and continuous batch. Ray Serve's proxy
takes the HTTP requests and spreads them over the replicas; a replica that dies is restarted by Ray. There is no
cluster code here: `ray.init` starts or joins the cluster, `serve.run` deploys, Ray does the rest. Every response
carries `x-speccomp-server: host:pid`, so a client (and the tests) can see which replica answered.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from speccomp.errors import OptionError

INSTALL = "pip install 'speccomp[ray]'"


def _ray():
    """(ray, ray.serve), or an ImportError naming the install."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ImportError(f"--replicas needs Ray Serve ({exc}): {INSTALL}") from None
    return ray, serve


def application(engine_dir, replicas: int = 2, max_batch: int = 8, kv_slots: int = 8192, provider: str = "cpu",
                threads: int | None = None, cpus_per_replica: float = 1.0, draft: bool = True):
    """The Ray Serve application (`serve.run(application(...))`): `replicas` copies of the engine's app.

    Everything is checked here, in the caller's process, before Ray is involved: inside a replica a bad value, a bad
    directory or an engine that cannot batch would only show as Ray's "Deploying application speccomp failed", with
    the reason in its logs. No ONNX Runtime session is built in this process (each replica builds its own)."""
    from speccomp.engine.runtime import check_batchable, check_provider, read_manifest
    from speccomp.serve import check_sizes

    for name, value in (("replicas", replicas), ("max_batch", max_batch), ("kv_slots", kv_slots), ("threads", threads)):
        if (value is not None or name != "threads") and (not isinstance(value, int) or isinstance(value, bool)
                                                         or value < 1):
            raise OptionError(name, value, "must be a positive int", f"e.g. {name}=2")
    if isinstance(cpus_per_replica, bool) or not isinstance(cpus_per_replica, (int, float)) or cpus_per_replica < 0:
        raise OptionError("cpus_per_replica", cpus_per_replica, "must be a number >= 0", "e.g. cpus_per_replica=1")
    manifest = read_manifest(engine_dir, verify=False)  # the engine's own message for a bad directory
    check_provider(provider)
    check_sizes(max_batch, kv_slots, manifest["max_tree"])
    check_batchable(manifest, max(max_batch, 2), draft)
    _, serve = _ray()
    engine_dir = str(Path(engine_dir).resolve())  # replicas may start in another working directory

    def build():  # runs in each replica's process (cloudpickled there): its own engine and scheduler
        from speccomp.engine.runtime import load
        from speccomp.serve import make_app

        return make_app(load(engine_dir, provider=provider, threads=threads, draft=draft), max_batch, kv_slots)

    deployment = serve.deployment(serve.ingress(build)(), name="speccomp", num_replicas=replicas,
                                  max_ongoing_requests=4 * max_batch,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    return deployment.bind()


def no_telemetry() -> None:
    """Ray reports usage statistics to its makers over the network unless told not to; speccomp sends nothing
    anywhere, so it tells Ray not to (before `ray.init`; a user's own RAY_USAGE_STATS_ENABLED is kept)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def serve_replicas(engine_dir, host: str = "127.0.0.1", port: int = 8000, replicas: int = 2, max_batch: int = 8,
                   kv_slots: int = 8192, provider: str = "cpu", threads: int | None = None, draft: bool = True) -> None:
    """Deploy `replicas` copies on the Ray cluster (a local one unless RAY_ADDRESS names another) and serve until
    interrupted."""
    app = application(engine_dir, replicas, max_batch, kv_slots, provider, threads, draft=draft)  # checks, first
    ray, serve = _ray()

    def interrupted(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # a plain kill also stops the replicas and the local cluster
    no_telemetry()
    ray.init(ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name="speccomp", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
