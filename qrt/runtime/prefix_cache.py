"""Prompt prefixes kept in the KV cache's free slots, for the next request that starts with them.

A request that ends leaves its keys and values in its slot. The engine prefills every prompt in
the same chunks, counted from position 0 in steps of its chunk size, and a chunk's keys and
values depend only on its own tokens and those before it. So a later prompt that starts with
the same whole chunks can skip them and prefill from the first chunk that differs, and what it
computes is bit for bit what a cold prefill computes: caching changes how long a request waits,
never its tokens or log-probabilities. Reuse goes by whole chunks of the same size: a request's
last partial chunk and the tokens it generated are not kept.

One PrefixCache belongs to a model's KV cache (GraphRunner.prefix_cache), whichever engines
use it: every write into the cache (`overwritten`) drops what it covers, and only an engine's
whole chunks (`extend`) add to what a slot holds.

The slot a request is given is the free one holding the longest reusable prefix of its prompt;
where none holds any, the one freed longest ago, so that recent prefixes stay longest.
"""

from dataclasses import dataclass


@dataclass
class SlotContent:
    tokens: tuple = ()  # the whole chunks, from position 0, whose keys and values the slot holds exactly
    chunk_size: int = 0  # of those chunks
    freed_at: int = 0  # when the slot last became free, on the cache's own clock
    tag: object = None  # what else the keys and values depend on: the LoRA adapter they were made with


class PrefixCache:
    def __init__(self, slots: int):
        self.content = [SlotContent() for _ in range(slots)]
        self._clock = 0
        self.reused_tokens = 0  # prompt tokens not prefilled because a slot held them

    def reusable(self, slot: int, prompt, starts: list[int], chunk_size: int, tag=None) -> int:
        """How many of `prompt`'s first tokens `slot` holds, as a chunk start of the prompt's
        plan (`starts`, ascending, in chunks of `chunk_size`) that leaves its last chunk to
        prefill, for a request whose keys and values depend on `tag` as well."""
        held = self.content[slot]
        if held.chunk_size != chunk_size or held.tag != tag:
            return 0
        best = 0
        for start in starts[1:]:  # the first start is 0; the last chunk always runs
            if (start % chunk_size or start > len(held.tokens)
                    or tuple(prompt[start - chunk_size:start]) != held.tokens[start - chunk_size:start]):
                break
            best = start
        return best

    def choose(self, free: list[int], prompt, starts: list[int], chunk_size: int, tag=None) -> tuple[int, int]:
        """(The free slot to give a request for `prompt` (with `tag`, see reusable), how many
        prompt tokens it holds already)."""
        reuse = {slot: self.reusable(slot, prompt, starts, chunk_size, tag) for slot in free}
        slot = max(free, key=lambda s: (reuse[s], -self.content[s].freed_at))
        self.reused_tokens += reuse[slot]
        if not reuse[slot]:  # what the slot held is written over from position 0
            self.content[slot].tokens = ()
        self.content[slot].tag = tag
        return slot, reuse[slot]

    def overwritten(self, slot: int, position: int) -> None:
        """Keys and values are being written into `slot` from `position` on."""
        held = self.content[slot]
        if position < len(held.tokens):
            held.tokens = held.tokens[:position]

    def extend(self, slot: int, start: int, tokens, chunk_size: int) -> None:
        """An engine prefilled `tokens` into `slot` from `start`, one chunk of its plan: a whole
        chunk that continues what the slot holds extends it."""
        held = self.content[slot]
        if start == 0:
            held.tokens, held.chunk_size = (), chunk_size
        if held.chunk_size == chunk_size and start == len(held.tokens) and len(tokens) == chunk_size:
            held.tokens += tuple(tokens)

    def clear(self) -> None:
        """Hold nothing: the next prompts are prefilled whole."""
        for held in self.content:
            held.tokens = ()

    def freed(self, slot: int) -> None:
        self._clock += 1
        self.content[slot].freed_at = self._clock
