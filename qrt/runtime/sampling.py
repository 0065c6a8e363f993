"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling, after the
request's own adjustments (logit bias, a minimum length, repetition penalties)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    # OpenAI's penalties on tokens already generated: minus presence_penalty once a token has
    # appeared, minus frequency_penalty per appearance.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (after the CTRL paper): a token seen in the prompt or the output has its logit
    # divided by this when positive, multiplied when negative. 1: off.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_tokens: int = 0  # the stop tokens (and EOS) cannot come before this many new tokens

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

        for name, value, low, high in (("presence_penalty", self.presence_penalty, -2, 2),
                                       ("frequency_penalty", self.frequency_penalty, -2, 2)):
            if not (isinstance(value, (int, float)) and low <= value <= high):
                raise ValueError(f"{name} must be a number from {low} to {high}, got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        if not (isinstance(self.min_tokens, int) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether `adjusted` changes anything for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def adjusted(logits: torch.Tensor, params: SamplingParams, prompt: tuple[int, ...], output: list[int],
             stop_ids) -> torch.Tensor:
    """logits [V] float32 with the request's adjustments, in vLLM's order: logit bias and the
    minimum length first, then the repetition, frequency and presence penalties."""
    logits = logits.clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    if len(output) < params.min_tokens and stop_ids:
        logits[torch.tensor(sorted(stop_ids))] = float("-inf")
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)  # [S]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[-1]).to(logits.dtype)  # [V]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [B, V] float32 -> the distribution a sampling request draws from ([B, V]): the
    temperature applied, then top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k is not None:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the tokens before it already cover top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] float32 -> next token ids [B] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)


def check_guess(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                guess: int, proposal: torch.Tensor | None = None) -> tuple[int, bool]:
    """The token at a position where `guess` was proposed (logits [V] float32), and whether it is
    the guess. Greedy: the argmax. Sampling, with p the distribution the request samples from:
    the guess is kept with probability min(1, p(guess) / q(guess)), q being `proposal` [V], the
    distribution the guess was drawn from (None: proposed with certainty, q(guess) = 1);
    otherwise a token is drawn from max(0, p - q), renormalized (for a certain guess: p without
    the guess). Either way the token is distributed as p."""
    if params.greedy:
        token = int(logits.argmax())
        return token, token == guess
    probs = probabilities(logits[None], params)[0]  # [V]
    proposed = 1.0 if proposal is None else float(proposal[guess])  # q(guess)
    if float(torch.rand((), generator=generator)) * proposed < float(probs[guess]):  # u < p / q
        return guess, True
    if proposal is None:
        rest = probs.clone()
        rest[guess] = 0
    else:
        # p(guess) < q(guess) here, so p has mass where q has less; only rounding could leave none.
        rest = (probs - proposal).clamp_(min=0)
        if not float(rest.sum()) > 0:
            rest = probs
    return int(torch.multinomial(rest, 1, generator=generator)), False
