"""What one request may ask of the server, checked before any of it is queued, from the server's
own settings: its choices within the room the server has (slots + queue places), its
log-probabilities within a budget, its seeds within what a generator takes. A request over a
budget is refused whole with a 400 that names the field; one that fits the budgets but not the
room left now is a 503 (EngineLoop.in_hand counts what is in hand)."""

from qrt.runtime.logprobs import MAX_TOP

from .api_errors import ApiError

RETRY_AFTER_S = 1
_SEED_LOW, _SEED_HIGH = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes


class Budgets:
    def __init__(self, max_seq_len: int, slots: int, max_queue: int):
        """slots: --max-batch; max_queue: --max-queue."""
        self.room = slots + max_queue
        # Log-probability entries of one request (a scored token with k alternatives is k + 1):
        # as many as every slot's tokens, each with the most alternatives the API allows. So any
        # request of one choice that fits a slot fits the budget, and only many choices with
        # many alternatives go over it. An entry costs about 120 bytes held in Python and about
        # as much again in the answer's JSON.
        self.logprob_entries = slots * max_seq_len * (MAX_TOP + 1)

    def check_choices(self, prompts: int, n: int) -> None:
        """A request of `prompts` × n choices must fit the room at once: the server never queues
        part of a request, and one larger than the room could never be taken."""
        if prompts * n > self.room:
            raise ApiError(400, f"this request asks for {prompts * n} sequences ({prompts} prompts × n={n}); this "
                                f"server holds at most {self.room} at once (--max-batch + --max-queue)",
                           param="n" if n > 1 else "prompt")

    def check_room(self, in_hand: int, choices: int) -> None:
        """503 when the request's choices do not fit beside the `in_hand` requests now."""
        if in_hand + choices > self.room:
            raise ApiError(503, f"the queue is full ({in_hand} requests in hand, {self.room} at most: --max-batch "
                                f"running + --max-queue waiting); retry shortly", "server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def check_logprobs(self, choices: list[tuple[int, int]], generated: int | None, prompt: int | None,
                       param: str) -> None:
        """choices: (prompt tokens, max new tokens) of each; generated / prompt: the alternatives
        asked for the new tokens / the prompt's (None: not scored)."""
        entries = 0
        for prompt_tokens, tokens in choices:
            entries += 0 if generated is None else tokens * (generated + 1)
            entries += 0 if prompt is None else prompt_tokens * (prompt + 1)
        if entries > self.logprob_entries:
            raise ApiError(400, f"this request asks for {entries} log-probability entries (choices × tokens × "
                                f"(alternatives + 1)); this server's limit is {self.logprob_entries} per request "
                                f"(--max-batch × max_seq_len × {MAX_TOP + 1}); ask for fewer choices, tokens or "
                                f"alternatives", param=param)

    @staticmethod
    def check_seed(seed: int | None, n: int) -> None:
        """Choice j samples with seed + j: every one must be a generator's seed."""
        if seed is not None and not (_SEED_LOW <= seed and seed + n - 1 <= _SEED_HIGH):
            raise ApiError(400, f"seed must be from {_SEED_LOW} to {_SEED_HIGH - (n - 1)} (with n={n}, choice j "
                                f"samples with seed + j), got {seed}", param="seed")
