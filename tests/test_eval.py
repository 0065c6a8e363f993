"""Perplexity (`qrt eval`, runtime.evaluate, bench/quality.py) on a tiny checkpoint, against transformers."""

import hashlib
import json
import math
import shutil

import pytest
import torch

from qrt import runtime
from bench import quality
from helpers.checkpoints.tiny import random_ids
from qrt.formats.catalog import online_formats
from qrt.cli import main
from qrt.runtime.evaluate import DEFAULT_TEXT, encode, perplexity_of_ids, perplexity_of_text, plan_windows, read_text

WINDOW, STRIDE = 32, 12
TEXT = "The quick brown fox jumps over the lazy dog. Perplexity is scored one window at a time. " * 2


@pytest.fixture(scope="module")
def model(llama_dir):
    """Its own model, not the shared `compiled` one: the windows compile the forward graph for a
    length other tests do not expect. Every call here has WINDOW tokens, so one graph serves all."""
    return runtime.compile_model(llama_dir, progress=False, max_seq_len=WINDOW, warmup=False)


@pytest.fixture(scope="module")
def byte_tokenized_dir(llama_dir, tmp_path_factory):
    """The tiny checkpoint with a tokenizer of one token per UTF-8 byte (ids 0-255 < vocab 300)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama-bytes") / "ckpt"
    shutil.copytree(llama_dir, folder)
    byte_vocab = {symbol: i for i, symbol in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(folder))
    return folder


def hf_token_nll(hf, ids: torch.Tensor, begin: int, targets) -> float:
    """Negative log-likelihood (nats, float64) that transformers gives ids[t] for t in `targets`,
    from a forward over ids[begin:begin + WINDOW]."""
    with torch.no_grad():
        logits = hf(ids[None, begin:begin + WINDOW]).logits[0].double()  # [T, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    return -sum(float(log_probs[t - begin - 1, ids[t]]) for t in targets)


@pytest.mark.parametrize("n_tokens,window,stride", [(2, 2, 1), (5, 8, 4), (8, 8, 7), (9, 8, 1), (9, 8, 7),
                                                     (100, 32, 12), (101, 32, 16), (1000, 512, 256)])
def test_windows_score_every_token_once_with_enough_context(n_tokens, window, stride):
    windows = plan_windows(n_tokens, window, stride)
    scored = [t for w in windows for t in range(w.first_scored, w.end)]
    assert scored == list(range(1, n_tokens))  # each once, in order; token 0 has no prediction
    assert all(w.end - w.begin == min(window, n_tokens) for w in windows)  # one graph shape
    assert all(w.begin < w.first_scored for w in windows)  # the token before each scored one is inside
    assert all(w.first_scored - w.begin >= window - stride for w in windows[1:])


def test_sliding_window_perplexity_matches_transformers(model, llama_dir, hf_model):
    ids = random_ids(0, (100,))
    result = perplexity_of_ids(model, ids, window=WINDOW, stride=STRIDE)
    # The reference: windows start every STRIDE tokens, the last ends at the last token, and each
    # token is scored in the first window that holds it and the token before it.
    begins = list(range(0, len(ids) - WINDOW, STRIDE)) + [len(ids) - WINDOW]
    owner = {t: next(b for b in begins if b < t < b + WINDOW) for t in range(1, len(ids))}
    nll = sum(hf_token_nll(hf_model(llama_dir), ids, b, [t for t, o in owner.items() if o == b]) for b in begins)
    assert result.scored_tokens == 99 and result.tokens == 100 and result.windows == len(begins) == 7
    # Both sides are float32 forwards of the same weights (measured apart by ~1e-10); scoring each
    # token from the neighbouring row moves the total by ~1e-3 on this model.
    assert result.nll == pytest.approx(nll, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(nll / 99), rel=1e-6)
    assert model.compile_report()["forward"] == 1


def test_a_sequence_within_the_window_is_one_plain_forward(model, llama_dir, hf_model):
    ids = random_ids(1, (WINDOW,))
    result = perplexity_of_ids(model, ids, window=WINDOW)
    nll = hf_token_nll(hf_model(llama_dir), ids, 0, range(1, WINDOW))
    assert result.windows == 1 and result.scored_tokens == WINDOW - 1
    assert result.perplexity == pytest.approx(math.exp(nll / (WINDOW - 1)), rel=1e-6)


def test_inputs_that_cannot_be_scored_are_value_errors(model, tmp_path):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity_of_ids(model, [5], window=WINDOW)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len of 32"):
        perplexity_of_ids(model, [5, 6, 7], window=64)
    with pytest.raises(ValueError, match="stride must be between 1 and window - 1 = 31"):
        perplexity_of_ids(model, [5, 6, 7], window=WINDOW, stride=WINDOW)
    with pytest.raises(ValueError, match="the text is empty"):
        perplexity_of_text(model, " \n")
    with pytest.raises(ValueError, match="no usable tokenizer"):
        perplexity_of_text(model, TEXT)
    with pytest.raises(ValueError, match="no such file"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_text(tmp_path / "latin1.txt")


class _Tokenizer:
    """Whitespace 'tokenizer' that may prepend BOS and/or append EOS, like real ones do."""

    def __init__(self, add_bos: bool, add_eos: bool):
        self.bos_token_id, self.add_bos, self.add_eos = 1, add_bos, add_eos

    def encode(self, text, add_special_tokens=True):
        ids = [10 + len(word) for word in text.split()]
        if add_special_tokens:
            ids = [1] * self.add_bos + ids + [2] * self.add_eos
        return ids


@pytest.mark.parametrize("add_bos,add_eos", [(False, False), (True, False), (False, True), (True, True)])
def test_bos_is_kept_only_when_the_tokenizer_adds_it_and_nothing_else(add_bos, add_eos):
    ids, bos_added = encode(_Tokenizer(add_bos, add_eos), "one three")
    if add_bos and not add_eos:
        assert (ids, bos_added) == ([1, 13, 15], True)
    else:
        assert (ids, bos_added) == ([13, 15], False)


def test_the_default_text_is_shipped_unmodified():
    digest = hashlib.sha256(DEFAULT_TEXT.read_bytes()).hexdigest()
    assert digest in (DEFAULT_TEXT.parent / "README.md").read_text()
    assert "dedicated to the public domain under the CC0" in " ".join(read_text(DEFAULT_TEXT).split())


def test_eval_command_prints_perplexity_tokens_bits_per_byte_and_time(byte_tokenized_dir, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    n_bytes = len(TEXT.encode("utf-8"))
    args = ["eval", str(byte_tokenized_dir), "--text", str(text_file), "--window", "64", "--eager"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"({n_bytes} bytes, {n_bytes} tokens, no special tokens added)" in out
    assert "window:         64 tokens, stride 32 (" in out and f"scored tokens:  {n_bytes - 1}\n" in out
    for field in ("perplexity:", "bits per byte:", "time:"):
        assert field in out

    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scored_tokens"] == n_bytes - 1 and report["text_bytes"] == n_bytes
    assert report["bits_per_byte"] == pytest.approx(report["nll"] / math.log(2) / n_bytes)
    assert report["perplexity"] == pytest.approx(math.exp(report["nll"] / (n_bytes - 1)))
    assert f"perplexity:     {report['perplexity']:.4f}" in out


def test_eval_command_errors_name_the_problem(byte_tokenized_dir, llama_dir, tmp_path, capsys):
    assert main(["eval", str(byte_tokenized_dir), "--text", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
    assert main(["eval", str(byte_tokenized_dir), "--window", "8", "--stride", "8"]) == 2
    assert "stride must be between 1 and window - 1" in capsys.readouterr().err
    assert main(["eval", str(byte_tokenized_dir), "--window", "1024", "--eager"]) == 2
    assert "exceeds the model's max_seq_len of 256" in capsys.readouterr().err
    assert main(["eval", str(llama_dir), "--eager"]) == 2
    assert "no usable tokenizer" in capsys.readouterr().err


def test_quality_bench_has_a_row_for_every_online_quantization(byte_tokenized_dir, tmp_path, capsys):
    assert quality.quant_names() == ["none", *online_formats()]
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    out_json = tmp_path / "quality.json"
    # Only the formats this test knows to fit the tiny shapes; the default run takes all of them.
    assert quality.main([str(byte_tokenized_dir), "--text", str(text_file), "--window", "64", "--quant",
                         "none,fp8", "--eager", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "| quantization | perplexity | × bf16 | bits per byte | scored tokens |" in table
    assert "| bf16 |" in table and "| 1.0000 |" in table and "| fp8 |" in table
    rows = json.loads(out_json.read_text())["rows"]
    assert [row["quant"] for row in rows] == ["none", "fp8"]
    assert all(row["scored_tokens"] == len(TEXT.encode("utf-8")) - 1 for row in rows)
