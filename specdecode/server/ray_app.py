"""`specdecode serve --replicas N`: N copies of the server behind one OpenAI-compatible endpoint, on Ray Serve.

Each replica is a Ray actor that loads the models and builds the same FastAPI app `specdecode serve` runs (its own
engine, scheduler and /metrics, labelled with the replica's id); Ray Serve's proxy spreads requests over the
replicas, health-checks each (a replica whose engine stopped is restarted) and keeps serving with the rest when
one dies. `ray` is an optional extra: `pip install "specdecode[ray]"`. On one machine replicas share its cores,
so each gets `cpus` of them (torch threads included); across machines, start Ray on each (docs/server.md).
"""

from __future__ import annotations

import os
import sys

from specdecode.errors import SpecdecodeError
from specdecode.server.settings import ServerSettings

HEALTH_PERIOD_S, HEALTH_TIMEOUT_S = 10.0, 30.0


def import_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecdecodeError('--replicas needs Ray Serve: pip install "specdecode[ray]"') from None
    return ray, serve


def build(decoder_kwargs: dict, settings: ServerSettings, replicas: int, cpus: float):
    """The Ray Serve application: `replicas` copies, each loading SpecDecoder.load(**decoder_kwargs)."""
    _, serve = import_ray()

    @serve.ingress()
    class SpecdecodeReplica:
        def __init__(self, decoder_kwargs: dict, settings: ServerSettings, cpus: float) -> None:
            import dataclasses

            import torch

            from specdecode.api import SpecDecoder
            from specdecode.compute import ComputeThread
            from specdecode.server.app import create_app

            torch.set_num_threads(max(1, int(cpus)))  # replicas on one machine must not fight over its cores
            compute = ComputeThread()  # the models load, and the engine runs, on one thread (compute.py)
            replica = serve.get_replica_context().replica_tag
            settings = dataclasses.replace(settings, replica=replica)
            self.asgi = create_app(compute.run(SpecDecoder.load, **decoder_kwargs), settings, compute)

        def __serve_build_asgi_app__(self):
            return self.asgi

        def check_health(self) -> None:
            scheduler = self.asgi.state.scheduler
            if scheduler.started and not scheduler.alive:  # Ray restarts a replica whose engine stopped
                raise RuntimeError("the engine worker stopped")

    deployment = serve.deployment(
        SpecdecodeReplica, name="specdecode", num_replicas=replicas, ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=settings.max_running + settings.max_waiting,
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S)
    return deployment.bind(decoder_kwargs, settings, cpus)


def start(decoder_kwargs: dict, settings: ServerSettings, replicas: int, host: str, port: int,
          address: str | None = None, cpus: float | None = None) -> str:
    """Connect to (or start) Ray, deploy the replicas and return the endpoint's URL once they are up."""
    ray, serve = import_ray()
    if cpus is None:  # a local cluster splits this machine; a cluster's workers bring their own cores
        cpus = max(1.0, (os.cpu_count() or 1) // replicas) if address is None else 1.0
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 **({} if address else {"num_cpus": max(os.cpu_count() or 1, int(cpus * replicas))}))
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(decoder_kwargs, settings, replicas, cpus), name="specdecode", route_prefix="/")
    return f"http://{host}:{port}"


def stop() -> None:
    ray, serve = import_ray()
    serve.shutdown()
    ray.shutdown()


def serve_forever(decoder_kwargs: dict, settings: ServerSettings, replicas: int, host: str, port: int,
                  address: str | None, cpus: float | None) -> int:
    import time

    url = start(decoder_kwargs, settings, replicas, host, port, address, cpus)
    print(f"specdecode: {replicas} replicas of '{settings.model_name}' on Ray Serve at {url}/v1 (Ctrl-C stops)",
          file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 130
    finally:
        stop()
