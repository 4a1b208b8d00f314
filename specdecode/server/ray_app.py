"""`specdecode serve --replicas N`: N copies of the server behind one OpenAI-compatible endpoint, on Ray Serve.

Each replica is a Ray actor that loads the models and builds the same FastAPI app `specdecode serve` runs (its own
engine, scheduler and /metrics, labelled with the replica's id); Ray Serve's proxy spreads requests over the
replicas, health-checks each (a replica whose engine stopped is restarted) and keeps serving with the rest when
one dies. `ray` is an optional extra: `pip install "specdecode[ray]"`. On one machine replicas share its cores,
so each gets `cpus` of them (torch threads included); across machines, start Ray on each (docs/server.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

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


def build(decoder_kwargs: dict, settings: ServerSettings, replicas: int, cpus: float, drain_timeout: float = 30.0):
    """The Ray Serve application: `replicas` copies, each loading SpecDecoder.load(**decoder_kwargs)."""
    _, serve = import_ray()

    @serve.ingress()
    class SpecdecodeReplica:
        def __init__(self, decoder_kwargs: dict, settings: ServerSettings, cpus: float) -> None:
            import dataclasses

            import torch

            from specdecode.api import SpecDecoder
            from specdecode.server.app import create_app
            from specdecode.server.compute import ComputeThread

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
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S,
        graceful_shutdown_timeout_s=drain_timeout)  # requests in flight finish for this long on shutdown
    return deployment.bind(decoder_kwargs, settings, cpus)


def replica_cpus(replicas: int, address: str | None, cpus: float | None) -> float:
    if cpus is not None:
        return cpus
    # a local cluster splits this machine; a cluster's workers bring their own cores
    return max(1.0, (os.cpu_count() or 1) // replicas) if address is None else 1.0


def connect(replicas: int, address: str | None = None, cpus: float | None = None) -> None:
    """Join the cluster at `address`, or start a local one sized for the replicas (once per process)."""
    ray, _ = import_ray()
    if not ray.is_initialized():
        cpus = replica_cpus(replicas, address, cpus)
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 **({} if address else {"num_cpus": max(os.cpu_count() or 1, int(cpus * replicas))}))


def start(decoder_kwargs: dict, settings: ServerSettings, replicas: int, host: str, port: int,
          address: str | None = None, cpus: float | None = None, drain_timeout: float = 30.0) -> str:
    """Connect to (or start) Ray, deploy the replicas and return the endpoint's URL once they are up."""
    _, serve = import_ray()
    connect(replicas, address, cpus)
    cpus = replica_cpus(replicas, address, cpus)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(decoder_kwargs, settings, replicas, cpus, drain_timeout), name="specdecode", route_prefix="/")
    return f"http://{host}:{port}"


def stop() -> None:
    ray, serve = import_ray()
    serve.shutdown()
    ray.shutdown()


def serve_forever(decoder_kwargs: dict, settings: ServerSettings, replicas: int, host: str, port: int,
                  address: str | None, cpus: float | None, drain_timeout: float = 30.0) -> int:
    """Serve until SIGTERM or Ctrl-C, then shut Serve and Ray down. Python's default SIGTERM would end this process
    without that, leaving the local Ray cluster's processes running with nobody to stop them."""
    stopping, serving = threading.Event(), threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        stopping.set()
        if not serving.is_set():  # still deploying: give up on it (the finally below stops what started)
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        connect(replicas, address, cpus)
        for sig in previous:  # ray.init put its own handlers in (SIGTERM: a logged abort): ours again
            signal.signal(sig, on_signal)
        url = start(decoder_kwargs, settings, replicas, host, port, address, cpus, drain_timeout)
        serving.set()
        print(f"specdecode: {replicas} replicas of '{settings.model_name}' on Ray Serve at {url}/v1 (Ctrl-C stops)",
              file=sys.stderr)
        while not stopping.wait(1.0):
            pass
        print(f"specdecode: draining the replicas (up to {drain_timeout:g} s), then stopping Ray", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if serving.is_set() and received:
        return 0  # drained as asked, as the one-process server exits after its drain
    return 128 + received[0] if received else 130  # stopped while deploying: as that signal stops a process
