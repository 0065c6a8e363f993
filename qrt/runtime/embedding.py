"""An embedding model's inputs to vectors: texts or token ids checked, cut into batches, run
through the encode graph (the final hidden states, no lm_head, no KV cache) and pooled.

A batch is right-padded: every row's tokens come first, so under causal attention none of them
attends to padding, and each row's hidden states are those of its text alone; pooling reads only
the row's own tokens."""

import torch

from .graph_runner import ENCODE_ROWS

# The most padded tokens (rows x longest row) one call of the encode graph runs: bounds the
# memory of a call's activations and attention scores, and how long one call holds the engine
# thread in the server. A single text longer than this still runs, alone.
TOKENS_PER_CALL = 8192
PAD = 0  # any id of the vocabulary: padding comes after a row's tokens, which never attend to it


def token_rows(model, inputs) -> list[list[int]]:
    """Each input's token ids: `inputs` a string, a list of strings, a list of token ids, a list
    of token-id lists, or an integer tensor [T] / [N, T]. Texts are encoded as the checkpoint's
    tokenizer encodes them (with its special tokens, as sentence-transformers does)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dtype not in (torch.int64, torch.int32) or inputs.dim() not in (1, 2):
            raise ValueError("a tensor of inputs must be integer token ids, [T] or [N, T]")
        inputs = inputs.reshape(-1, inputs.shape[-1]).tolist()
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise ValueError("embed takes a string, a list of strings, a list of token ids or a list of token-id lists")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in inputs):
        inputs = [list(inputs)]
    rows = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            rows.append(model.encode(item))
        elif isinstance(item, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in item):
            rows.append(list(item))
        else:
            raise ValueError(f"input {index}: expected a string or a list of token ids, got {type(item).__name__}")
    check_rows(model, rows)
    return rows


def check_rows(model, rows: list[list[int]]) -> None:
    """Each row non-empty, within the model's positions and vocabulary (ValueError naming the row)."""
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(f"input {index} is empty; give at least one token")
        if len(row) > model.max_seq_len:
            raise ValueError(f"input {index} has {len(row)} tokens, more than max_seq_len ({model.max_seq_len}); "
                             f"shorten it, or pass a larger max_seq_len to compile_model")
        bad = [i for i in row if not 0 <= i < model.vocab_size]
        if bad:
            raise ValueError(f"input {index}: token ids must be in [0, {model.vocab_size}); got {bad[:5]}")


def batches(lengths: list[int]) -> list[list[int]]:
    """The rows (indices into `lengths`) of each encode call: longest first, so that rows of like
    length share a call and pad little; at most ENCODE_ROWS rows and TOKENS_PER_CALL padded
    tokens a call (a row longer than that alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    calls, current = [], []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) == ENCODE_ROWS or (len(current) + 1) * longest > TOKENS_PER_CALL):
            calls.append(current)
            current = []
        current.append(index)
    if current:
        calls.append(current)
    return calls


def encode_rows(model, rows: list[list[int]]) -> torch.Tensor:
    """One encode call: rows of token ids (checked) -> float32 pooled vectors [len(rows), D]
    (normalized where the model's pooling normalizes)."""
    # The encode graphs' lengths are dynamic from 2 (Dynamo specializes 1): a one-token row gets a
    # filler token after it, which nothing before it attends to. (A lone row has a graph of its own.)
    width = max(2, max(len(row) for row in rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)  # [R, T]
    lengths = torch.zeros(len(rows), dtype=torch.long)  # [R]
    for place, row in enumerate(rows):
        ids[place, :len(row)] = torch.tensor(row, dtype=torch.long)
        lengths[place] = len(row)
    with torch.no_grad():
        hidden = model.hidden_states(ids).cpu()  # [R, T, D]
        return model.pooling.pool(hidden, lengths)  # [R, D]


def embed_rows(model, rows: list[list[int]]) -> torch.Tensor:
    """float32 vectors [N, D] of checked token-id rows, in their order, over as many encode calls
    as `batches` plans."""
    vectors = [None] * len(rows)
    for call in batches([len(row) for row in rows]):
        for index, vector in zip(call, encode_rows(model, [rows[i] for i in call])):
            vectors[index] = vector
    return torch.stack(vectors)
