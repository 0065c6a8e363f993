"""POST /v1/embeddings: an embedding model's vectors (qrt/runtime/embedding.py) in OpenAI's shape.

The inputs are checked and tokenized here, on the HTTP side, as the completions routes do theirs.
The model runs on the engine thread (EngineLoop.call), never beside it: every torch call of the
server does, because a step's compiled graphs, the weights they read and the CPU's thread pool
are in use while it runs, and Dynamo's compiling is not thread-safe. The encode graph reads no KV
cache, so it may run between any two steps without disturbing the requests in the slots; each of
a request's encode calls (embedding.batches) is a call of its own, so a large request holds the
engine thread one bounded call at a time while streams go on between them."""

import asyncio
import base64
import functools

import torch

from qrt.runtime import embedding

from .api_errors import ApiError

RETRY_AFTER_S = 1


class Embeddings:
    """The route's logic, over the app's Service (authorization and the model are the route's)."""

    def __init__(self, service):
        self.service = service
        self.in_flight = 0  # embedding requests taken and not yet answered: their share of the queue

    async def answer(self, body, model) -> dict:
        """The reply to EmbeddingRequest `body` on the served `model` (ApiError where it is refused)."""
        service = self.service
        if model.pooling is None:
            raise ApiError(400, f"the model {service.model_name!r} is not an embedding model (its checkpoint has no "
                                f"sentence-transformers pooling); it serves /v1/completions and /v1/chat/completions",
                           param="model")
        if model.parallel.sharded:
            raise ApiError(400, "embeddings are not served under tensor parallelism (--tp); serve the model on one "
                                "device", param="model")
        try:
            model.pooling.check_dimensions(body.dimensions, model.model.config.hidden_size)
        except ValueError as err:
            raise ApiError(400, str(err), param="dimensions") from None
        try:
            rows = [model.encode(item) if isinstance(item, str) else list(item) for item in body.inputs()]
            embedding.check_rows(model, rows)
        except ValueError as err:
            raise ApiError(400, f"input: {err}", param="input") from None
        # An embedding request waits for the engine thread as a queued request waits for a slot.
        if self.in_flight + service.loop.queue_depth() >= service.max_queue:
            raise ApiError(503, f"the queue is full ({service.max_queue} requests waiting); retry shortly",
                           "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        service.loop.metrics.prompt_tokens.inc(sum(len(row) for row in rows))
        self.in_flight += 1
        try:
            vectors = await self._run(model, rows)
        finally:
            self.in_flight -= 1
        vectors = model.pooling.shorten(vectors, body.dimensions)  # [N, dimensions or D]
        tokens = sum(len(row) for row in rows)
        return {"object": "list", "model": service.model_name,
                "data": [{"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)}
                         for index, vector in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _run(self, model, rows: list[list[int]]) -> torch.Tensor:
        """float32 vectors [N, D] of the rows, one engine-thread call per encode call."""
        loop = asyncio.get_running_loop()
        calls = embedding.batches([len(row) for row in rows])
        futures = [self.service.loop.call(functools.partial(embedding.encode_rows, model, [rows[i] for i in call]),
                                          loop) for call in calls]
        try:
            results = await asyncio.gather(*futures)
        except Exception as err:  # noqa: BLE001  (the model failed: the client hears why)
            raise ApiError(500, f"the embedding failed: {type(err).__name__}: {err}", "server_error") from None
        vectors = [None] * len(rows)
        for call, result in zip(calls, results):
            for index, vector in zip(call, result):
                vectors[index] = vector
        return torch.stack(vectors)


def _encoded(vector: torch.Tensor, encoding_format: str):
    """One vector [D] as OpenAI sends it: a list of floats, or base64 of its float32 values,
    little-endian."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
