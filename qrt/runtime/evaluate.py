"""Perplexity of a compiled model over a text longer than its context, scored with a sliding window.

Windows of `window` tokens start every `stride` tokens, and the last one is moved back to end at
the last token, so every window has the same length (one compiled graph serves them all). Each
token after the first is scored exactly once, in the first window that holds it together with the
token before it; it then sees at least `window - stride` tokens of left context (all of them in
the first window). Log-probabilities are taken in float32 and summed in float64.
"""

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

DEFAULT_WINDOW = 512
DEFAULT_TEXT = Path(__file__).parent / "data" / "eval_text.txt"


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) go through the model; those in [first_scored, end) are scored."""

    begin: int
    end: int
    first_scored: int


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    nll: float  # total negative log-likelihood of the scored tokens, in nats
    scored_tokens: int
    tokens: int  # token ids in the sequence, the unscored first one (BOS or not) included
    window: int
    stride: int
    windows: int
    seconds: float  # scoring only; includes compiling the forward graph on its first call
    bits_per_byte: float | None = None  # None when scored from token ids, without a text
    text_bytes: int | None = None
    bos_added: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def plan_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows that score tokens 1 … n_tokens-1 once each (token 0 has nothing to predict it)."""
    check_window(window, stride)
    if n_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens (one to predict from, one to score), "
                         f"got {n_tokens}")
    if n_tokens <= window:
        return [Window(0, n_tokens, 1)]
    begins = list(range(0, n_tokens - window, stride)) + [n_tokens - window]
    windows, scored_up_to = [], 1
    for begin in begins:
        windows.append(Window(begin, begin + window, scored_up_to))
        scored_up_to = begin + window
    return windows


def check_window(window: int, stride: int, max_seq_len: int | None = None) -> None:
    if window < 2:
        raise ValueError(f"the window must hold at least 2 tokens, got {window}")
    if max_seq_len is not None and window > max_seq_len:
        raise ValueError(f"a window of {window} tokens exceeds the model's max_seq_len of {max_seq_len}; "
                         f"use a window of at most {max_seq_len} tokens")
    # A stride of `window` would leave the first token of each window without the token before it.
    if not 1 <= stride < window:
        raise ValueError(f"the stride must be between 1 and window - 1 = {window - 1}, got {stride}")


def perplexity_of_ids(model, ids, *, window: int = DEFAULT_WINDOW, stride: int | None = None) -> Perplexity:
    """Sliding-window perplexity of one token sequence (list or 1-D tensor of ids).

    model: a CompiledModel, or any callable mapping LongTensor [1, T] to logits [1, T, vocab].
    stride: how far each window moves (default window // 2).
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)  # [1, N]
    stride = window // 2 if stride is None else stride
    check_window(window, stride, getattr(model, "max_seq_len", None))
    windows = plan_windows(ids.shape[1], window, stride)
    started = time.perf_counter()
    nll = 0.0
    for w in windows:
        logits = model(ids[:, w.begin:w.end])[0]  # [T, vocab]
        # Row i of the logits predicts token begin + i + 1.
        predicting = logits[w.first_scored - w.begin - 1:w.end - w.begin - 1].float()  # [S, vocab]
        targets = ids[0, w.first_scored:w.end].to(predicting.device)  # [S]
        log_probs = torch.log_softmax(predicting, dim=-1)
        nll -= float(log_probs.gather(1, targets[:, None]).double().sum())
    seconds = time.perf_counter() - started
    scored = ids.shape[1] - 1
    return Perplexity(perplexity=math.exp(nll / scored), nll=nll, scored_tokens=scored, tokens=ids.shape[1],
                      window=window, stride=stride, windows=len(windows), seconds=seconds)


def perplexity_of_text(model, text: str, *, window: int = DEFAULT_WINDOW, stride: int | None = None) -> Perplexity:
    """Tokenize `text` with the model's tokenizer and score it; adds bits per byte of the text."""
    if not text.strip():
        raise ValueError("the text is empty; give a text of at least a few words")
    if model.tokenizer is None:
        raise ValueError(f"{model.source} has no usable tokenizer (tokenizer.json / tokenizer_config.json), "
                         f"so its perplexity over a text cannot be computed")
    ids, bos_added = encode(model.tokenizer, text)
    result = perplexity_of_ids(model, ids, window=window, stride=stride)
    text_bytes = len(text.encode("utf-8"))
    return replace(result, bits_per_byte=result.nll / math.log(2) / text_bytes, text_bytes=text_bytes,
                   bos_added=bos_added)


def encode(tokenizer, text: str) -> tuple[list[int], bool]:
    """The text's token ids, and whether a BOS id was put in front of them.

    A tokenizer that prepends BOS on its own (Llama's, Gemma's) marks a model trained with it at
    the start of every document, so BOS is kept: it makes the first text token scorable too.
    Anything else a tokenizer adds (EOS, chat markers) is not part of the text and is left out.
    """
    plain = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer.encode(text) == [bos, *plain]:
        return [bos, *plain], True
    return plain, False


def read_text(path) -> str:
    """A UTF-8 text file's contents, with errors a user can act on."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; --text takes a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
