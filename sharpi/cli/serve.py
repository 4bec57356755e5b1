"""sharpi serve: an OpenAI-compatible HTTP server for one compiled artifact (sharpi.serve)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

from ..common.config import ModelConfig
from ..common.errors import ConfigError, SharpiError
from ..common.manifest import Manifest
from ..common.settings import parse_int, parse_positive_int
from ..common.speculative_settings import check_model_can_speculate
from ..runtime.engine import kv_slot_bytes
from .common import (MODEL_HELP, add_device_flags, add_snapkv_flags, already_checked, resolve_model_arg,
                     snapkv_knobs)

DEFAULT_PORT = 8080


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over HTTP (OpenAI's API: completions, chat completions)")
    s.add_argument("artifact", metavar="MODEL", help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free one)")
    s.add_argument("--model-name", default=None, help="the model's id in the API (default: the GGUF's file name)")
    s.add_argument("--parallel", type=int, default=16, help="sequences generated at once (default 16)")
    memory = s.add_mutually_exclusive_group()
    memory.add_argument("--kv-memory", type=int, default=None, metavar="MIB",
                        help="KV page pool size in MiB, which all requests share")
    memory.add_argument("--pool-tokens", type=int, default=None, metavar="N",
                        help="KV page pool size in token slots a layer (llama-server's -c)")
    s.add_argument("--max-queue", type=int, default=256, help="requests waiting for admission before 503 (256)")
    s.add_argument("--prefill-budget", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens computed between two decode steps (default: the artifact's prefill chunk)")
    s.add_argument("--prefill-share", type=float, default=0.5, metavar="X",
                   help="while requests are generating, a step computes only the prompt tokens that take about X "
                        "decode steps, so a long prompt's admission slows their tokens about 1 + X times, and is "
                        "itself slower (default 0.5; 0: the token budget alone, the prompt first)")
    s.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt in full")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: SHARPI_API_KEY)")
    s.add_argument("--drain-seconds", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, how long in-flight requests may finish before they are cancelled (10)")
    http = s.add_argument_group("HTTP limits")
    http.add_argument("--max-body-mib", type=float, default=16.0,
                      help="largest request body in MiB, counted as it arrives (16)")
    http.add_argument("--header-timeout", type=float, default=10.0,
                      help="seconds a connection has to send a request's headers (10; not under --ray, whose "
                           "proxy is Ray's)")
    http.add_argument("--body-timeout", type=float, default=60.0,
                      help="seconds a request's body has to arrive once its headers did (60)")
    ray = s.add_argument_group("replicas on Ray Serve (python -m pip install \".[ray]\" in the sharpi clone)")
    ray.add_argument("--ray", action="store_true",
                     help="serve from engine replicas on a Ray cluster (one model load each) behind Ray Serve's "
                          "HTTP proxy, a conversation's requests kept on the replica that holds its pages")
    count = ray.add_mutually_exclusive_group()
    count.add_argument("--replicas", type=int, default=None, metavar="N", help="engine replicas (default 1)")
    count.add_argument("--min-replicas", type=int, default=None, metavar="A",
                       help="autoscale between A and --max-replicas B by requests in flight")
    ray.add_argument("--max-replicas", type=int, default=None, metavar="B")
    ray.add_argument("--address", default=None,
                     help="the Ray cluster to join: 'auto' (one started with `ray start` on this machine) or "
                          "ray://HOST:10001; default: a cluster of this machine alone, on loopback")
    ray.add_argument("--gpus-per-replica", type=float, default=None,
                     help="GPUs each replica reserves (default: 1 for a cuda or vulkan artifact, else 0)")
    s.add_argument("--speculative", default=None, choices=["off", "lookup"],
                   help="speculative decoding for requests that do not say (their \"speculative\" field): lookup "
                        "drafts from the prompt and answer, verified in one forward while few requests run; the "
                        "output is plain decoding's (default off)")
    s.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help="the most drafted tokens one forward verifies (default 16)")
    add_snapkv_flags(s)
    add_device_flags(s)


def _prefill_share(args) -> float | None:
    if not 0 <= args.prefill_share <= 1000:
        raise ConfigError(f"--prefill-share must be in [0, 1000], got {args.prefill_share}.")
    return args.prefill_share or None


def _speculative(args):
    """The server's default speculative settings from --speculative and --draft-max."""
    from ..common.speculative_settings import MAX_DRAFT, SpeculativeSettings
    settings = SpeculativeSettings(method=args.speculative or "off")
    if args.draft_max is not None:
        settings = replace(settings, max_draft=parse_int(args.draft_max, "--draft-max", 1, MAX_DRAFT))
    return settings.validate()


def cmd_serve(args) -> int:
    # Imported when serving, so the other commands never load the HTTP stack.
    try:
        from ..serve.app import ServerState
        from ..serve.server import bind, serve
    except ImportError as error:
        raise ConfigError(f"sharpi serve needs {error.name}, which is missing: run python -m pip install . in the "
                          f"sharpi clone again.") from None
    parallel = parse_positive_int(args.parallel, "--parallel", highest=1024)
    parse_positive_int(args.max_queue, "--max-queue", allow_zero=True, highest=1 << 20)
    if args.prefill_budget is not None:
        parse_positive_int(args.prefill_budget, "--prefill-budget", highest=1 << 20)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}.")
    if not (args.drain_seconds >= 0):
        raise ConfigError(f"--drain-seconds must be >= 0, got {args.drain_seconds}.")
    limits = _http_limits(args)
    _speculative(args)
    _prefill_share(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SHARPI_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty.")
    resolve_model_arg(args)                   # a GGUF or a name: its cached compile (compiled now)
    manifest = Manifest.read(Path(args.artifact), verify_digest=False)       # a bad directory fails here, fast
    name = args.model_name or Path(manifest.source.get("name", Path(args.artifact).name)).stem
    pool_tokens = _pool_tokens(args, manifest)
    check_model_can_speculate(_speculative(args), ModelConfig.from_dict(manifest.config))
    if args.ray:
        return _serve_on_ray(args, manifest, name, api_key, parallel, pool_tokens, limits)
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None \
            or args.address is not None or args.gpus_per_replica is not None:
        raise ConfigError("--replicas, --min-replicas, --max-replicas, --address and --gpus-per-replica go with "
                          "--ray.")
    sock = bind(args.host, args.port)
    state = ServerState(name, api_key=api_key, snapkv_knobs=snapkv_knobs(args), limits=limits,
                        speculative=_speculative(args))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = sock.getsockname()[:2]
    print(f"sharpi serve: http://{host}:{port}/v1 serves '{name}' (loading {args.artifact})", flush=True)
    loader = threading.Thread(target=_load, args=(state, args, parallel, pool_tokens), daemon=True,
                              name="sharpi-load")
    loader.start()
    try:
        serve(state, sock, drain_seconds=args.drain_seconds)
    finally:
        loader.join(timeout=60)
        if state.engine is not None:
            engine = state.engine.engine
            engine.shutdown(cancel=True, timeout=30)
            pool = engine.pool_summary()
            print(f"sharpi serve: stopped; {pool['used']} of {pool['pages']} KV pages still held", flush=True)
    return 0 if state.load_error is None else 2


def _http_limits(args):
    """The HTTP flags as HttpLimits, each checked under its flag's name."""
    from ..serve.http_guard import HttpLimits, check_seconds
    if not 0 < args.max_body_mib <= 1 << 14:
        raise ConfigError(f"--max-body-mib must be in (0, 16384], got {args.max_body_mib}.")
    return HttpLimits(max_body_bytes=max(1, int(args.max_body_mib * (1 << 20))),
                      header_timeout=check_seconds(args.header_timeout, "--header-timeout"),
                      body_timeout=check_seconds(args.body_timeout, "--body-timeout"))


def _serve_on_ray(args, manifest: Manifest, name: str, api_key: str | None, parallel: int,
                  pool_tokens: int | None, limits) -> int:
    """Deploy on Ray Serve, then wait for SIGINT/SIGTERM and take the deployment down (a cluster this command
    started goes with it)."""
    try:
        from ..serve import ray as on_ray
    except ImportError as error:
        raise ConfigError(f"sharpi serve --ray needs the ray extra ({error.name} is missing): "
                          f"python -m pip install \".[ray]\" in the sharpi clone.") from None
    from ..serve.engine import ServeSettings
    gpu = manifest.target.get("kind") in ("cuda", "vulkan")
    deployment = on_ray.RayDeployment(
        replicas=args.replicas if args.replicas is not None else 1, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, host=args.host, port=args.port or _free_port(args.host),
        gpus_per_replica=args.gpus_per_replica if args.gpus_per_replica is not None else float(gpu),
        model_name=name, api_key=api_key, limits=limits)
    deployment.validate()
    # each replica's kernels get their share of this machine's cores unless --threads says otherwise
    threads = args.threads or max(1, (os.cpu_count() or 1) // deployment.most_replicas)
    deployment = replace(deployment, cpus_per_replica=threads)
    options = on_ray.ReplicaOptions(
        str(Path(args.artifact).resolve()), threads=threads, pool_tokens=pool_tokens, adapter=args.adapter,
        expect_sha256=args.expect_sha256, lock_weights=args.mlock, snapkv_knobs=snapkv_knobs(args),
        speculative=_speculative(args),
        serve=ServeSettings(parallel=parallel, max_queue=args.max_queue, prefill_budget=args.prefill_budget,
                            prefix_cache=not args.no_prefix_cache, prefill_share=_prefill_share(args)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    try:
        # a cluster of this machine alone gets room for every replica (Ray's CPUs are logical: past this
        # machine's count, replicas share cores)
        cpus = max(os.cpu_count() or 1, deployment.most_replicas * threads) if args.address is None else None
        url = on_ray.deploy(options, deployment, manifest.page_size, address=args.address, num_cpus=cpus)
        # after ray.init, which installs handlers of its own: ours take the deployment down in order
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"sharpi serve: {url}/v1 serves '{name}' from Ray Serve ({_replicas_text(deployment)} of "
              f"{args.artifact})", flush=True)
        stop.wait()
    finally:
        on_ray.shutdown()
    print("sharpi serve: the Ray deployment is down", flush=True)
    return 0


def _free_port(host: str) -> int:
    """A port free on `host` now (Ray Serve's proxy takes a number, not 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _replicas_text(deployment) -> str:
    if deployment.min_replicas is None:
        return f"{deployment.replicas} replica{'s' if deployment.replicas != 1 else ''}"
    return f"{deployment.min_replicas} to {deployment.max_replicas} replicas"


def _pool_tokens(args, manifest: Manifest) -> int | None:
    """--pool-tokens, or the slots a layer --kv-memory MiB holds (None: the runtime's default pool)."""
    if args.pool_tokens is not None:
        return parse_positive_int(args.pool_tokens, "--pool-tokens", highest=1 << 26)
    if args.kv_memory is None:
        return None
    mib = parse_positive_int(args.kv_memory, "--kv-memory", highest=1 << 24)
    tokens = mib * 2**20 // kv_slot_bytes(manifest, ModelConfig.from_dict(manifest.config))
    if tokens < manifest.page_size:
        raise ConfigError(f"--kv-memory {mib} MiB holds less than one page ({manifest.page_size} tokens) of this "
                          f"model's KV cache.")
    return tokens


def _load(state, args, parallel: int, pool_tokens: int | None) -> None:
    """Load the model and start the engine (the server answers /health with 503 meanwhile)."""
    import sharpi
    from ..serve.client import LocalEngine
    from ..serve.engine import ServeEngine, ServeSettings
    try:
        # a hybrid model's recurrent-state slots: one per sequence, and as many prefix-cache snapshots
        model = sharpi.load(args.artifact, threads=args.threads, adapter=args.adapter, pool_sequences=parallel,
                            state_snapshots=parallel, expect_sha256=args.expect_sha256, pool_tokens=pool_tokens,
                            lock_weights=args.mlock, **already_checked(args))
        model.snapkv_settings(**state.snapkv_knobs)                           # bad SnapKV flags fail here
        engine = ServeEngine(model, ServeSettings(parallel=parallel, max_queue=args.max_queue,
                                                  prefill_budget=args.prefill_budget,
                                                  prefix_cache=not args.no_prefix_cache,
                                                  prefill_share=_prefill_share(args))).start()
    except SharpiError as error:
        state.load_error = str(error)
        print(f"error: {error}", file=sys.stderr, flush=True)
        _stop_server()
        return
    state.model, state.engine = model, LocalEngine(engine)
    pool = engine.pool_summary()
    slots = pool["pages"] // model.config.kv_layers * model.manifest.page_size
    print(f"sharpi serve: ready on {model.backend}; KV pool {slots} tokens a layer "
          f"({pool['pages'] * engine.pool.page_bytes / 2**20:.0f} MiB), {parallel} sequences at once", flush=True)


def _stop_server() -> None:
    """A load that failed ends the process as SIGINT would (the server then exits with status 2)."""
    os.kill(os.getpid(), signal.SIGINT)
