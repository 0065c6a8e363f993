"""Log-probabilities of tokens, as the OpenAI API reports them: each token's own, and the k most
likely tokens at its position. They come from the model's float32 logits before any temperature,
top-k/top-p or penalty (what vLLM reports too), so they describe the model, not the sampler.
"""

from dataclasses import dataclass

import torch

MAX_TOP = 20  # the most alternatives a request may ask for per token (OpenAI's chat limit)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, log-probability) of the k most likely, most likely first


def scored(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits: [N, V] of N positions; tokens: the N tokens that came next (sampled or in the
    prompt); top: how many alternatives to list (0: none)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()  # [N]
    if top:
        values, ids = logprobs.topk(top, dim=-1)  # [N, top] each, most likely first
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(token, value, alt) for token, value, alt in zip(tokens, chosen, alternatives)]


def check_top(value, what: str) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP):
        raise ValueError(f"{what} must be an integer from 0 to {MAX_TOP} (alternatives per token), got {value!r}")
