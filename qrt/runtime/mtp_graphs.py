"""The compiled graphs of a model's multi-token-prediction layer (models/mtp.py), the draft of
speculative method "mtp": one that catches a cache slot up on the model's hidden states (a prompt
chunk, or the tokens a step kept), and one that chains a guess further in every slot at once.

Both run the layer and the model's lm_head only, with the layer's KV cache beside the model's, in
the same slots. They are traced through Dynamo on first use (warmup compiles them) and are not kept
in qrt's compile cache: the layer is one decoder layer, and torch's own caches serve a later
start's compile."""

import itertools

import torch

from qrt.passes.backend import QrtBackend

from .graph_runner import own_copy

_numbers = itertools.count()


def _catch_up(model, input_ids, hidden, positions, keys, slots, logits_at):
    return model.predict(input_ids, hidden, positions, keys, slots, logits_at)


def _chain(model, input_ids, hidden, positions, keys):
    return model.predict(input_ids, hidden, positions, keys)


class PredictionGraphs:
    ROLES = ("catch_up", "chain")

    def __init__(self, runner):
        """runner: the model's GraphRunner (its model holds `mtp`; its slots and cache length)."""
        self.runner = runner
        self.model = runner.model
        self.backends = {role: QrtBackend(f"mtp_{role}") for role in self.ROLES}
        functions = {"catch_up": _catch_up, "chain": _chain}
        if runner.compiles:
            number = next(_numbers)
            functions = {role: torch.compile(own_copy(fn, f"qrt_mtp_{role}_{number}"), backend=self.backends[role],
                                             fullgraph=True)
                         for role, fn in functions.items()}
        self.functions = functions

    def catch_up(self, slot: int, tokens: list[int], hidden: torch.Tensor, start: int):
        """Feed the pairs (hidden[j], tokens[j]) at positions start + j of cache slot `slot`:
        hidden [n, D] the model's final hidden states there, tokens the n tokens after them.
        Returns the float32 logits [V] of the token after the last, and the layer's output [D]
        there (to chain from)."""
        # The model's prefill inputs for these tokens (a lone one padded with a filler pair at
        # start + 1, which the next pair fed to this slot overwrites before anything attends it).
        ids, positions, keys, slots, logits_at = self.runner.prefill_inputs(tokens, start, slot)  # [1, T] ...
        padding = torch.zeros(ids.shape[1] - len(hidden), hidden.shape[-1], dtype=hidden.dtype)
        hidden = torch.cat([hidden, padding])[None].to(self.runner.device).contiguous()  # [1, T, D]
        if self.runner.compiles:
            for tensor, dim in ((ids, 1), (hidden, 1), (positions, 1), (keys, 0)):
                torch._dynamo.mark_dynamic(tensor, dim, min=2, max=self.runner.max_seq_len - 1)
        logits, out = self._run("catch_up", ids, hidden, positions, keys, slots, logits_at)
        return logits[0, 0], out[0, 0]

    def chain(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attended: int):
        """One pair per cache slot: tokens, positions [slots] (idle rows as the model's decode
        step has them), hidden [slots, D]; attention over the first `attended` entries. Returns
        float32 logits [slots, V] and the layer's outputs [slots, D]."""
        ids, positions, keys = self.runner.step_tensors(tokens.view(-1, 1), positions.view(-1, 1), attended)
        if self.runner.compiles:
            torch._dynamo.mark_dynamic(keys, 0, min=2, max=self.runner.max_seq_len - 1)
        logits, out = self._run("chain", ids, hidden[:, None].to(self.runner.device).contiguous(), positions, keys)
        return logits[:, 0], out[:, 0]

    def _run(self, role: str, *inputs):
        with torch.no_grad():
            return self.functions[role](self.model, *inputs)

    def warmup(self) -> None:
        """Compile both graphs on filler pairs in slot 0, at positions the engine rewrites before
        reading (the chunk at an offset, so that its length and the attended length are two sizes)."""
        width = self.model.config.hidden_size
        filler = torch.zeros(2, width, dtype=self.model.dtype)
        tokens, positions = self.runner.idle_decode_rows()
        positions[0] = 2
        steps = {"catch_up": lambda: self.catch_up(0, [0, 0], filler, 1),
                 "chain": lambda: self.chain(tokens, torch.zeros(len(tokens), width, dtype=self.model.dtype),
                                             positions, 3)}
        for role, step in steps.items():
            self.runner.compile_timed(f"mtp_{role}", step, say=True)

    def compile_report(self) -> dict:
        """Per graph: how many graphs Dynamo produced (1: no graph breaks, no recompiles)."""
        return {role: len(backend.log.graphs) for role, backend in self.backends.items()}
