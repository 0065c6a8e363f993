"""The front of `qrt serve --replicas N`: one FastAPI app on the user's address that forwards every
/v1 request, streamed answers included, to a replica (affinity.py picks which), and answers
/health and /metrics for the pool as a whole. While the front drains (drain.py: SIGTERM or Ctrl-C)
it refuses new requests with 503 and relays the answers already under way to their end."""

import asyncio
import json
import threading
from contextlib import asynccontextmanager

import anyio
import httpx2 as httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .affinity import PrefixAffinity, prompt_prefix
from .body_limit import BodyLimit
from .chat_page import add_chat_page
from .metrics_sum import summed_metrics
from .protocol import error_body
from .replicas import ReplicaPool

CONNECT_TIMEOUT_S = 5
# The longest a replica may be silent while answering: a whole (not streamed) completion behind a
# long queue sends nothing until it is done.
READ_TIMEOUT_S = 600
METRICS_TIMEOUT_S = 5
RETRY_AFTER_S = 1
# Headers of one hop, which each connection sets for itself.
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-connection", "date", "server"}


class RouterMetrics:
    """The router's own counters, read from the pool and the affinity when scraped."""

    def __init__(self, pool: ReplicaPool, affinity: PrefixAffinity):
        self.pool, self.affinity = pool, affinity
        self.unavailable = 0

    def collect(self):
        yield CounterMetricFamily("qrt_router_affinity_hits", "Requests sent to the replica that last served their "
                                  "prompt's prefix", value=self.affinity.hits)
        yield CounterMetricFamily("qrt_router_affinity_misses", "Requests with a prompt whose prefix had no "
                                  "ready, unhurried last server: sent to the least busy replica",
                                  value=self.affinity.misses)
        yield CounterMetricFamily("qrt_router_unavailable", "Requests refused with 503: no replica was ready",
                                  value=self.unavailable)
        requests = CounterMetricFamily("qrt_router_requests", "Requests forwarded, by replica", labels=["replica"])
        restarts = CounterMetricFamily("qrt_router_replica_restarts", "Replicas started again after they exited",
                                       labels=["replica"])
        for replica in self.pool.replicas:
            requests.add_metric([str(replica.index)], replica.requests)
            restarts.add_metric([str(replica.index)], replica.restarts)
        yield requests
        yield restarts
        yield GaugeMetricFamily("qrt_router_replicas_ready", "Replicas answering", value=len(self.pool.ready()))
        yield GaugeMetricFamily("qrt_router_replicas", "Replicas (--replicas)", value=len(self.pool.replicas))


def create_router(pool: ReplicaPool, affinity: PrefixAffinity, *, prefix_chars: int, max_body_bytes: int,
                  drain_timeout_s: float, draining: threading.Event | None = None) -> FastAPI:
    """The front over `pool`: started with the app, stopped (after its requests finish) with it.
    draining: set when the front starts to drain (DrainingServer sets it)."""
    draining = draining if draining is not None else threading.Event()
    client = httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    router_metrics = RouterMetrics(pool, affinity)

    @asynccontextmanager
    async def lifespan(app):
        pool.start()
        watcher = asyncio.create_task(pool.watch())
        try:
            yield
        finally:
            await pool.stop(drain_timeout_s)
            watcher.cancel()
            await client.aclose()

    app = FastAPI(title="qrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    add_chat_page(app)  # before the catch-all below, which would forward these paths

    @app.get("/health")
    async def health():
        replicas = [r.describe() for r in pool.replicas]
        if draining.is_set():  # a balancer stops sending here
            return JSONResponse({"status": "stopping", "replicas": replicas}, status_code=503)
        # 503 until every replica has loaded once; then 200 while any is ready (one restarting
        # does not take the endpoint out of service: the others answer its share).
        if pool.all_started_once() and pool.ready():
            return {"status": "ok", "replicas": replicas}
        status = "loading" if not pool.all_started_once() else "unavailable"
        return JSONResponse({"status": status, "replicas": replicas}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        async def scrape(replica):
            try:
                return (await client.get(replica.url + "/metrics", timeout=METRICS_TIMEOUT_S)).text
            except httpx.HTTPError:
                return None
        texts = await asyncio.gather(*(scrape(r) for r in pool.ready()))
        page = summed_metrics([t for t in texts if t is not None]) + generate_latest(router_metrics)
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/load_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def runtime_lora():
        # Each replica would have to load the adapter, and a request be routed only to those that did.
        return JSONResponse(error_body("loading LoRA adapters at runtime is not supported with --replicas yet; give "
                                       "them at start with --lora NAME=PATH"), status_code=400)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        if draining.is_set():
            return JSONResponse(error_body("the server is shutting down: it finishes the requests it holds and takes "
                                           "no new ones", "server_error", code="shutting_down"), status_code=503)
        body = await request.body()
        prefix = None
        if request.method == "POST":
            try:
                fields = json.loads(body)
            except ValueError:  # the replica answers it with its 400
                fields = None
            if isinstance(fields, dict):
                prefix = prompt_prefix(fields, prefix_chars)
        url = f"/{path}" + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        tried = set()
        while candidates := [r for r in pool.ready() if r.index not in tried]:
            replica, key, hit = affinity.choose(prefix, candidates)
            upstream = client.build_request(request.method, replica.url + url, content=body, headers=headers)
            replica.in_flight += 1
            try:
                reply = await client.send(upstream, stream=True)
            except httpx.TransportError:
                # Nothing came back: it died or is restarting. Another replica may answer instead.
                replica.in_flight -= 1
                pool.mark_down(replica)
                tried.add(replica.index)
                continue
            replica.requests += 1
            affinity.served(key, replica, hit)
            answer_headers = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS}
            return StreamingResponse(_relay(reply, replica), status_code=reply.status_code, headers=answer_headers)
        router_metrics.unavailable += 1
        return JSONResponse(error_body("no replica is ready to answer: they are starting or restarting; "
                                       "GET /health says when one is", "server_error", code="no_replica_ready"),
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    return app


async def _relay(reply, replica):
    """The replica's answer, byte for byte, as it arrives. A client that goes away closes the
    replica's connection too, which cancels the request there."""
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        pass  # the replica died mid-answer: the stream ends short (no [DONE]), as the replica's own would
    finally:
        replica.in_flight -= 1
        with anyio.CancelScope(shield=True):
            await reply.aclose()
