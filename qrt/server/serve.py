"""`qrt serve`: load and compile a model on the engine thread while uvicorn already answers
(/health says 503 until the graphs are warm), then serve the OpenAI API until SIGTERM or Ctrl-C,
which refuse new requests with 503 and let the requests in hand finish first (drain.py). With --replicas N,
N such servers run as processes of their own behind a front that routes to them."""

import sys
import threading

from qrt.runtime.engine import DEFAULT_CHUNK


def serve(load, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 64, max_body_bytes: int = 1 << 20, chunk_size: int = DEFAULT_CHUNK,
          max_batch: int = 8, drain_timeout_s: float = 600, prefix_caching: bool = True,
          tool_call_parser: str = "auto", reasoning_parser: str = "auto", allow_runtime_lora: bool = False) -> int:
    """load(): the compiled, warm CompiledModel (called on the engine thread). Returns the exit code."""
    import uvicorn

    from .app import create_app
    from .drain import DrainingServer
    from .engine_loop import EngineLoop
    from .metrics import Metrics

    metrics = Metrics()
    server_box = []

    def on_fatal(message):  # the model did not load, or its ranks can no longer step: nothing to serve
        if loop.fault is None:
            print(f"qrt: error: the model failed to load, shutting down: {message}", file=sys.stderr, flush=True)
        if server_box:
            server_box[0].should_exit = True

    def load_and_announce():
        model = load()
        adapters = f", LoRA adapters {model.lora_names}" if model.lora_names else ""
        print(f"qrt: ready: serving {model_name!r} on http://{host}:{port}/v1 "
              f"({max_batch} slots of {model.max_seq_len} tokens{adapters})", file=sys.stderr, flush=True)
        return model

    loop = EngineLoop(load_and_announce, metrics, chunk_size=chunk_size, prefix_caching=prefix_caching,
                      on_fatal=on_fatal)
    metrics.slots.set(max_batch)
    metrics.watch(loop)
    app = create_app(loop, model_name=model_name, api_key=api_key, max_queue=max_queue,
                     max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout_s, tool_call_parser=tool_call_parser,
                     reasoning_parser=reasoning_parser, allow_runtime_lora=allow_runtime_lora)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_timeout_s)
    server = DrainingServer(config, draining=loop.draining, in_hand=loop.in_hand, timeout_s=drain_timeout_s)
    server_box.append(server)
    print(f"qrt: listening on http://{host}:{port} (GET /health: 503 until the model is compiled)",
          file=sys.stderr, flush=True)
    server.run()
    if loop.load_error is not None or loop.fault is not None:
        return 1
    print("qrt: server stopped", file=sys.stderr, flush=True)
    return 0


def serve_replicas(replica_command, replica_env: dict, replicas: int, *, host: str = "127.0.0.1", port: int = 8000,
                   max_batch: int = 8, max_body_bytes: int = 1 << 20, drain_timeout_s: float = 600,
                   start_timeout_s: float = 1800, prefix_chars: int = 1024) -> int:
    """`qrt serve --replicas N`: N replica processes (replica_command(port): a `qrt serve` argv)
    behind one front on host:port. Returns the exit code."""
    import uvicorn

    from .affinity import PrefixAffinity
    from .drain import DrainingServer
    from .replicas import ReplicaPool
    from .router import create_router

    server_box = []
    failure = []

    def on_fatal(message):  # the model does not load: starting replicas again would not help
        failure.append(message)
        print(f"qrt: error: {message}; shutting down", file=sys.stderr, flush=True)
        if server_box:
            server_box[0].should_exit = True

    pool = ReplicaPool(replicas, replica_command, replica_env, start_timeout_s, on_fatal)
    # A replica with a whole batch more in flight than the least busy one loses its prefixes' requests.
    affinity = PrefixAffinity(slack=max_batch)
    draining = threading.Event()
    app = create_router(pool, affinity, prefix_chars=prefix_chars, max_body_bytes=max_body_bytes,
                        drain_timeout_s=drain_timeout_s, draining=draining)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_timeout_s)
    # SIGTERM drains the front as it drains one server: new requests get 503, the answers being
    # relayed finish; then the app's shutdown stops the replicas, which by then hold nothing.
    server = DrainingServer(config, draining=draining, in_hand=pool.in_flight, timeout_s=drain_timeout_s)
    server_box.append(server)
    print(f"qrt: listening on http://{host}:{port} for {replicas} replicas (GET /health: 503 until every replica "
          f"is ready)", file=sys.stderr, flush=True)
    server.run()
    if failure:
        return 1
    print("qrt: server and replicas stopped", file=sys.stderr, flush=True)
    return 0
