"""Which replica a request goes to. Each replica's engine reuses the KV-cache of prompt chunks a
free slot still holds, so a request goes to the replica that last served its prompt's first
characters, unless that replica is busier than the least busy one by a whole batch or more (then
waiting for it would cost more than prefilling again). Requests without that history go to the
least busy replica."""

import hashlib
import json
from collections import OrderedDict

# About 256 tokens of English text: the engine's prefill chunk, the least it reuses.
DEFAULT_PREFIX_CHARS = 1024
REMEMBERED_PREFIXES = 4096


def prompt_prefix(body: dict, chars: int) -> str | None:
    """The first `chars` characters of a request's prompt (chat messages as their JSON), or None
    for a request without one."""
    if "messages" in body:
        text = json.dumps(body["messages"], ensure_ascii=False, sort_keys=True)
    elif "prompt" in body:
        prompt = body["prompt"]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    else:
        return None
    return text[:chars]


class PrefixAffinity:
    """slack: how many more requests in flight than the least busy replica the last server of a
    prefix may have and still get it."""

    def __init__(self, slack: int):
        self.slack = slack
        self.hits = self.misses = 0
        self._owners: OrderedDict[bytes, int] = OrderedDict()  # prefix digest -> replica index, oldest first

    def choose(self, prefix: str | None, candidates: list) -> tuple[object, bytes | None, bool]:
        """(replica, the prefix's key, whether it is the prefix's last server) among `candidates`
        (Replicas that are ready); call served() once it has answered."""
        least = min(candidates, key=lambda r: (r.in_flight, r.requests))
        if prefix is None:
            return least, None, False
        key = hashlib.blake2b(prefix.encode(), digest_size=16).digest()
        owner = next((r for r in candidates if r.index == self._owners.get(key)), None)
        if owner is not None and owner.in_flight < least.in_flight + self.slack:
            return owner, key, True
        return least, key, False

    def served(self, key: bytes | None, replica, hit: bool) -> None:
        if key is None:
            return
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self._owners[key] = replica.index
        self._owners.move_to_end(key)
        if len(self._owners) > REMEMBERED_PREFIXES:
            self._owners.popitem(last=False)
