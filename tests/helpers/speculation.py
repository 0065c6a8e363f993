"""What the speculative-decoding tests share: running requests through an engine, an engine that
checks every guess, the chi-square test of sampled tokens against the model's distribution, and
a verify call set beside the decode steps it stands for."""

import random
from dataclasses import replace

import torch

from qrt.runtime.engine import Engine
from qrt.runtime.sampling import SamplingParams, probabilities

P_VALUE_FLOOR = 1e-3  # a correct sampler fails one run in a thousand; a biased one fails every run


def run_requests(engine, requests, arrivals=None):
    """Submit requests (at the given steps; default: all at once), step until all are done."""
    arrivals = arrivals or [0] * len(requests)
    sequences, step = [None] * len(requests), 0
    while any(s is None or not s.done for s in sequences):
        for i, at in enumerate(arrivals):
            if at == step:
                sequences[i] = engine.submit(requests[i])
        engine.step()
        step += 1
    for seq in sequences:
        assert seq.error is None, seq.error
    return [seq.tokens for seq in sequences]


def always_checking(engine: Engine) -> Engine:
    """The engine with every guess checked, whatever its timings say a check is worth
    (speculative.CheckCosts, tested on its own): for tests of the checking itself."""
    engine.speculator.costs.pays = lambda *args: True
    return engine


def looping_prompt(seed: int, length: int) -> list[int]:
    """A prompt that repeats a short phrase with changes, so that lookups find guesses."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, 300) for _ in range(6)]
    prompt = []
    while len(prompt) < length:
        prompt += [t if rng.random() > 0.15 else rng.randrange(3, 300) for t in phrase]
    return prompt[:length]


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of observed counts against expected ones (cells expected below 5 lumped)."""
    small = expected < 5
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def two_sampled_tokens_p_value(model, engine, prompt: list[int], params: SamplingParams, draws: int) -> float:
    """Sample three tokens after `prompt` through `engine` `draws` times (seeds 0..), so that the
    second can be a checked guess, and test the first two's joint frequencies against
    p(t1) · p(t2 | t1) from the model's full-sequence graph: the chi-square p-value."""

    def distribution(ids):
        return probabilities(model(torch.tensor([ids]))[0, -1][None], params)[0]

    first = distribution(prompt)
    following = {a: distribution(prompt + [a]) for a in first.nonzero().flatten().tolist()}
    pairs = [tuple(run_requests(engine, [model.request(prompt, 3, replace(params, seed=seed), stop_at_eos=False)])[0][:2])
             for seed in range(draws)]
    cells = [(a, b) for a, p in following.items() for b in p.nonzero().flatten().tolist()]
    expected = torch.tensor([float(first[a] * following[a][b]) for a, b in cells], dtype=torch.float64)
    observed = torch.tensor([float(sum(pair == cell for pair in pairs)) for cell in cells], dtype=torch.float64)
    assert observed.sum() == draws  # no draw outside the cells the model allows
    return chi_square_p(observed, expected * draws)


def verify_beside_decode(model, prompt: list[int], slot: int, k: int):
    """Prefill `prompt` into `slot`, decode k + 1 greedy tokens one step at a time, then feed the
    same tokens in one verify call: (its logits [k + 1, V], the decode steps' [k + 1 each], the
    tokens fed, the positions)."""
    fed, decoded = [int(model.prefill_chunk(prompt, 0, slot).argmax())], []
    for place in range(k + 1):
        tokens, positions = model.idle_decode_rows()
        tokens[slot], positions[slot] = fed[-1], len(prompt) + place
        decoded.append(model.decode_step(tokens, positions, len(prompt) + place + 1)[slot])
        fed.append(int(decoded[-1].argmax()))
    tokens, positions = model.idle_rows(k + 1)
    tokens[slot], positions[slot] = torch.tensor(fed[:k + 1]), torch.arange(len(prompt), len(prompt) + k + 1)
    verified = model.verify_step(tokens, positions, len(prompt) + k + 1)[slot]  # [k + 1, V]
    return verified, decoded, tokens[slot], positions[slot]
