"""sharpi's engine as Ray Serve replicas (python -m pip install ".[ray]" in the clone): past one machine without a router of our own.

    HTTP (Ray Serve's proxy) ──▶ SharpiIngress: sharpi.serve.app, the same routes, bodies, errors and streams as
                                 `sharpi serve`, on the artifact's tokenizer and settings alone (ModelInfo)
                            ──▶ (deployment handle, PrefixAffinityRouter) ──▶ SharpiEngine replicas: one
                                 ServeEngine each, the artifact loaded once per replica

The ingress tokenizes, so the handle's router sees a request's tokens: PrefixAffinityRouter sends a prompt to the
replica that served its longest page-aligned prefix (a chat's next turn, another question about one document),
else to the replica with the fewest requests in flight. Ray restarts a replica whose process dies; a request
on it that had streamed nothing yet is sent again (to a live replica), one that had ends with a clear error. The
deployment's health check is the engine's own (/health's answer in `sharpi serve`).

Ray 2.54 and later start a gRPC server in every replica on all interfaces ("[::]:0", hard-coded), which a
loopback-only deployment cannot accept, so the extra pins 2.53; and Ray binds its own servers to the node's IP,
which for a local cluster must be 127.0.0.1 (start_local_cluster)."""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import socket
import threading
from dataclasses import dataclass, field

import ray
from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

from ..common.errors import ConfigError, ContextLengthError, ServerBusyError, SharpiError
from ..common.speculative_settings import SpeculativeSettings
from ..runtime.model_info import ModelInfo
from .app import ServerState, create_app
from .http_guard import HttpLimits
from .client import EventStream, LocalEngine, open_local
from .engine import ServeEngine, ServeSettings
from .request import Event, GenerationRequest
from .routing import AffinitySettings, PrefixIndex

log = logging.getLogger("sharpi.serve.ray")
APP_NAME = "sharpi"
ENGINE = "SharpiEngine"
INGRESS = "SharpiIngress"
RETRIES = 2                          # sends of a request whose replica died before it streamed anything
# A replica sends a stream's events in messages of up to 50 ms of them (as Ray Serve LLM batches its streams):
# each message crosses two processes, and one a token took CPU from the kernels on small machines.
STREAM_LINGER_S = 0.05
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
_REFUSALS = {"busy": ServerBusyError, "context": ContextLengthError, "config": ConfigError}


@dataclass(frozen=True)
class ReplicaOptions:
    """How each engine replica loads the artifact and runs its engine (sharpi serve's flags)."""
    artifact: str
    threads: int | None = None
    pool_tokens: int | None = None
    adapter: str | None = None
    expect_sha256: str | None = None
    lock_weights: bool = False
    serve: ServeSettings = ServeSettings()
    snapkv_knobs: dict = field(default_factory=dict)
    speculative: SpeculativeSettings = SpeculativeSettings()    # requests' default (the ingress applies it)


@dataclass(frozen=True)
class RayDeployment:
    """The Ray Serve side: replicas (a fixed count, or autoscaled between min and max), the HTTP proxy's
    address, and each replica's resources."""
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    model_name: str = "sharpi"
    api_key: str | None = None
    health_check_period_s: float = 10.0
    limits: HttpLimits = HttpLimits()     # the ingress's body bounds (Ray's proxy parses the headers)

    def validate(self) -> None:
        if self.min_replicas is None and self.max_replicas is None:
            if self.replicas < 1:
                raise ConfigError(f"--replicas must be at least 1, got {self.replicas}.")
            return
        if self.min_replicas is None or self.max_replicas is None:
            raise ConfigError("Give both --min-replicas and --max-replicas (or --replicas alone).")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(f"Autoscaling needs 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, "
                              f"got {self.min_replicas} and {self.max_replicas}.")

    @property
    def most_replicas(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas

    def scaling(self, parallel: int) -> dict:
        """deployment options: a fixed count, or Ray's autoscaler aiming at half the engine's decode batch in
        flight per replica (a fuller batch decodes faster; a full one makes new requests wait)."""
        if self.min_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": max(1, parallel // 2)}}


# -- the engine replica ------------------------------------------------------------------------------------------
class EngineReplica:
    """One ServeEngine on the artifact, loaded when the replica starts. generate() streams a request's events:
    first an "accepted" event naming this replica, or a "refused" one (the engine's queue is full, or the
    request cannot run here) which the ingress turns back into sharpi's errors; then lists of events."""

    def __init__(self, options: ReplicaOptions):
        import sharpi
        model = sharpi.load(options.artifact, threads=options.threads, adapter=options.adapter,
                            expect_sha256=options.expect_sha256, pool_tokens=options.pool_tokens,
                            lock_weights=options.lock_weights, pool_sequences=options.serve.parallel,
                            state_snapshots=options.serve.parallel)
        model.snapkv_settings(**options.snapkv_knobs)
        self.engine = ServeEngine(model, options.serve).start()
        self.local = LocalEngine(self.engine)          # health as `sharpi serve` reports it
        replica_id = serve.get_replica_context().replica_id.unique_id
        # the process's id too: an operator (or a test) can find the process that serves a request
        self.name = f"{replica_id}@{socket.gethostname()}:{os.getpid()}"
        log.info("replica %s ready on %s", self.name, model.backend)

    async def generate(self, generation: GenerationRequest):
        try:
            stream = open_local(self.engine, generation, self.name)
        except SharpiError as error:
            kind = next((k for k, cls in _REFUSALS.items() if isinstance(error, cls)), None)
            if kind is None:
                raise
            yield Event("refused", finish_reason=kind, message=str(error))
            return
        yield Event("accepted", message=self.name)
        try:
            while True:
                events = await stream.next_batch(STREAM_LINGER_S)
                yield events
                if events[-1].kind == "finish":
                    return
        finally:
            stream.cancel()            # the caller went away (its generator was cancelled): free the pages

    def check_health(self) -> None:
        """Ray's health check, /health's answer in `sharpi serve`: a replica whose engine failed is restarted."""
        reason = self.local.health()
        if reason is not None:
            raise RuntimeError(reason)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(cancel=True, timeout=10)


# -- the ingress's client of the replicas -------------------------------------------------------------------------
class RayEngine:
    """sharpi.serve.client's EngineClient over the engine deployment's handle."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sharpi_replica_requests", "Requests by the engine replica that served them",
                                ["replica"], registry=r)
        self.cached_tokens = Counter("sharpi_replica_prefix_cache_hit_tokens", "Prompt tokens a replica reused "
                                     "from its prefix cache", ["replica"], registry=r)
        self.resent = Counter("sharpi_replica_resent", "Requests sent again after their replica died before "
                              "streaming anything", registry=r)
        self.lost = Counter("sharpi_replica_lost", "Requests ended by their replica's death", registry=r)
        # the relays' tasks: the event loop keeps only weak references to tasks, and a relay whose client has
        # its answer could be collected before it reads its replica's stream to the end
        self.relays: set[asyncio.Task] = set()

    async def open(self, generation: GenerationRequest) -> EventStream:
        relay = _Relay(self, generation)
        await relay.start()
        return relay.stream

    def health(self) -> str | None:
        return None                  # Ray health-checks and restarts the replicas themselves

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


class _Relay:
    """One request's events from its replica's stream into an EventStream; sends the request again while
    nothing has been streamed to the client and its replica dies."""

    def __init__(self, client: RayEngine, generation: GenerationRequest):
        self.client, self.generation = client, generation
        self.stream = EventStream(on_cancel=self._cancel)
        self.response = None
        self.task: asyncio.Task | None = None
        self.streamed = False

    async def start(self) -> None:
        for attempt in range(RETRIES + 1):
            if await self._send():
                self.task = asyncio.get_running_loop().create_task(self._pump(RETRIES - attempt))
                self.client.relays.add(self.task)
                self.task.add_done_callback(self.client.relays.discard)
                return
            self.client.resent.inc()
        raise ServerBusyError("No engine replica could take the request (they are restarting); try again shortly.")

    async def _send(self) -> bool:
        """Send the request: True once a replica accepted it, False if the replica died first; a replica's
        refusal raises the sharpi error it stands for."""
        self.response = self.client.handle.generate.remote(self.generation)
        try:
            first = await self.response.__anext__()
        except _REPLICA_GONE:
            return False
        if first.kind == "refused":
            raise _REFUSALS[first.finish_reason](first.message)
        self.stream.replica = first.message
        self.client.requests.labels(first.message).inc()
        return True

    async def _pump(self, resends: int) -> None:
        while True:
            try:
                async for events in self.response:
                    for event in events:
                        self._deliver(event)
                return
            except asyncio.CancelledError:
                raise
            except _REPLICA_GONE:
                if self.streamed or resends == 0 or not await self._send_again():
                    self.client.lost.inc()
                    self._fail(f"The engine replica serving this request stopped ({self.stream.replica}); the "
                               f"request was not completed: send it again.")
                    return
                resends -= 1
            except Exception as error:     # noqa: BLE001 -- any other failure ends this request, not the ingress
                self._fail(f"The engine replica failed on this request: {type(error).__name__}.")
                return

    async def _send_again(self) -> bool:
        self.client.resent.inc()
        try:
            return await self._send()
        except SharpiError:          # refused by the replica it went to: the request ends as lost
            return False

    def _deliver(self, event: Event) -> None:
        if event.text or event.token_ids:
            self.streamed = True
        if event.kind == "finish" and event.usage and self.stream.replica:
            self.client.cached_tokens.labels(self.stream.replica).inc(event.usage.get("cached_tokens") or 0)
        self.stream.queue.put_nowait(event)

    def _fail(self, message: str) -> None:
        self.stream.queue.put_nowait(Event("finish", finish_reason="error", message=message))

    def _cancel(self) -> None:
        if self.response is not None:
            self.response.cancel()
        if self.task is not None:
            self.task.cancel()


# -- the router ---------------------------------------------------------------------------------------------------
class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request router for the engine deployment (it runs in the ingress, beside the handle): the
    replica that served the prompt's longest prefix first (sharpi.serve.routing), then the others by requests in
    flight, fewest first. It counts those itself, from routing to the end of each stream: Ray's own queue-length
    cache learns a replica's count only when a request is sent to it and keeps it for 10 s, so after a burst it
    would hold a replica busy that is long idle. Requests are routed in arrival order (FIFOMixin); Ray's node
    locality and model multiplexing have no use here."""

    def initialize_state(self, **kwargs):
        self.index = PrefixIndex(AffinitySettings(**kwargs))
        self.in_flight: collections.Counter = collections.Counter()
        self.lock = threading.Lock()          # streams end on Ray's threads, not the router's event loop

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        with self.lock:
            loads = {r.replica_id: self.in_flight[r.replica_id] for r in candidate_replicas}
        ids = _prompt_ids(pending_request)
        chosen = self.index.preferred(ids, loads) if ids else None
        ranked = sorted(candidate_replicas, key=lambda r: (r.replica_id != chosen, loads[r.replica_id],
                                                          random.random()))
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request, replica_id, result):
        ids = _prompt_ids(pending_request)
        if ids:
            self.index.record(ids, replica_id)
        with self.lock:
            self.in_flight[replica_id] += 1
        result.add_done_callback(lambda _: self._done(replica_id))

    def _done(self, replica_id) -> None:
        with self.lock:
            self.in_flight[replica_id] -= 1
            if self.in_flight[replica_id] <= 0:
                del self.in_flight[replica_id]

    def on_replica_actor_died(self, replica_id):
        self.index.forget(replica_id)
        with self.lock:
            self.in_flight.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


def _prompt_ids(pending_request) -> list[int] | None:
    if pending_request is None or not pending_request.args:
        return None
    generation = pending_request.args[0]
    return generation.prompt_ids if isinstance(generation, GenerationRequest) else None


# -- deploying ----------------------------------------------------------------------------------------------------
def _ingress_app(artifact: str, deployment: RayDeployment, snapkv_knobs: dict,
                 speculative: SpeculativeSettings = SpeculativeSettings()):
    """The ingress's ASGI app builder, run in its replica: sharpi.serve.app on the artifact's ModelInfo and a
    RayEngine over the engine deployment's handle (Ray's documented way for an app built on the replica)."""
    def build():
        state = ServerState(deployment.model_name, api_key=deployment.api_key, snapkv_knobs=snapkv_knobs,
                            limits=deployment.limits, speculative=speculative,
                            model=ModelInfo(artifact),
                            engine=RayEngine(serve.get_deployment_handle(ENGINE, app_name=APP_NAME)))
        return create_app(state)
    return build


def build_application(options: ReplicaOptions, deployment: RayDeployment, page_size: int):
    """The Ray Serve application: the ingress bound to the engine deployment."""
    deployment.validate()
    options.serve.validate()
    resources = {"num_cpus": deployment.cpus_per_replica}
    if deployment.gpus_per_replica:
        resources["num_gpus"] = deployment.gpus_per_replica
    router = RequestRouterConfig(request_router_class="sharpi.serve.ray:PrefixAffinityRouter",
                                 request_router_kwargs={"page_size": page_size})
    # The engine queues and refuses (503) itself beyond its own bound; Ray's bound only needs to be above it.
    in_flight = options.serve.parallel + options.serve.max_queue
    engine = serve.deployment(EngineReplica, name=ENGINE, ray_actor_options=resources,
                              max_ongoing_requests=max(in_flight, 1), request_router_config=router,
                              health_check_period_s=deployment.health_check_period_s,
                              **deployment.scaling(options.serve.parallel))
    ingress = serve.deployment(serve.ingress(_ingress_app(options.artifact, deployment, options.snapkv_knobs,
                                                            options.speculative))(),
                               name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    # The engine is an argument so that Ray deploys it with the ingress; the app takes its handle by name.
    return ingress.bind(engine.bind(options))


def start_local_cluster(num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """A Ray cluster of this machine alone, every server of it on loopback: the node's IP is 127.0.0.1, which Ray
    binds its servers to, and the processes it starts read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray's
    single-machine mode), without which its agents look up the machine's own address and listen there. Usage
    statistics stay off, so nothing leaves the machine."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(_node_ip_address="127.0.0.1", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)


def deploy(options: ReplicaOptions, deployment: RayDeployment, page_size: int, address: str | None = None,
           num_cpus: int | None = None) -> str:
    """Start (address None) or join (address "auto" or ray://host:port) a Ray cluster, run the application and
    return its base URL once every replica is up. Ray's failures (a cluster out of reach, replicas that cannot
    load the artifact) come back as one sentence; Ray's log holds the rest."""
    try:
        if address is None:
            start_local_cluster(num_cpus=num_cpus)
        else:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as error:         # noqa: BLE001 -- Ray raises ConnectionError, RuntimeError, ValueError...
        where = f"at {address}" if address else "on this machine"
        raise SharpiError(f"Could not start or join the Ray cluster {where}: {_first_line(error)}") from None
    try:
        serve.start(http_options={"host": deployment.host, "port": deployment.port,
                                  "keep_alive_timeout_s": max(1, round(deployment.limits.idle_timeout))})
        serve.run(build_application(options, deployment, page_size), name=APP_NAME, route_prefix="/")
    except SharpiError:
        raise
    except Exception as error:         # noqa: BLE001 -- Serve's deployment failures are RuntimeErrors of many lines
        shutdown()
        raise SharpiError(f"The Ray Serve deployment failed: {_first_line(error)} (Ray's log has the rest: "
                          f"/tmp/ray/session_latest/logs).") from None
    return f"http://{deployment.host}:{deployment.port}"


def _first_line(error: Exception) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def shutdown(timeout: float = 30.0) -> None:
    """Take the application down, then leave (or stop, if this process started it) the cluster. Bounded: a
    Ctrl-C in a terminal reaches Ray's own processes too, and Serve's shutdown then waits on a raylet that is
    gone."""
    down = threading.Thread(target=serve.shutdown, daemon=True, name="sharpi-serve-shutdown")
    down.start()
    down.join(timeout)
    ray.shutdown()

