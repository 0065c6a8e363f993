"""Log-probabilities in the OpenAI API's two shapes: the completions endpoint's legacy one (parallel
lists `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` list.

A token's text is what the tokenizer decodes it to alone. `text_offset` is where each token
starts in the choice's text, measured by decoding the tokens before it (so a token that ends in
the middle of a multi-byte character still gets an offset). Alternatives are listed most likely
first; in the legacy shape they are a {token text: logprob} dict, as OpenAI's is.
"""

from qrt.runtime.logprobs import TokenLogprob


class LogprobShapes:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def legacy(self, ids: list[int], scores: list[TokenLogprob | None], before: list[int]) -> dict:
        """ids and their scores (None: not scored, the prompt's first token); `before`: the ids
        of the choice's text that precede them (for text_offset)."""
        offsets, seen = [], list(before)
        for token in ids:
            offsets.append(len(self.tokenizer.decode(seen)) if seen else 0)
            seen.append(token)
        return {
            "tokens": [self.piece(token) for token in ids],
            "token_logprobs": [None if s is None else s.logprob for s in scores],
            "top_logprobs": [None if s is None else {self.piece(t): lp for t, lp in s.top} for s in scores],
            "text_offset": offsets,
        }

    def chat(self, scores: list[TokenLogprob], top: bool) -> dict:
        """Chat's {"content": [...]}: each token, its logprob and UTF-8 bytes, and with `top`
        its alternatives in the same form."""
        def entry(token: int, logprob: float) -> dict:
            text = self.piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(s.token, s.logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in s.top] if top else []} for s in scores]}
