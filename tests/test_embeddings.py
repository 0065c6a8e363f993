"""Embedding models: decoder checkpoints used as encoders, with sentence-transformers' pooling
(last-token + normalize, as Qwen3-Embedding; mean, unnormalized) read from their folders.
`CompiledModel.embed` is checked against sentence-transformers itself loading the same folder,
and `POST /v1/embeddings` against `embed` through the openai client on a live server."""

import base64
import json
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from bench.serve_load import ServerProcess, free_port
from helpers.checkpoints.tiny import TINY, make_checkpoint
from qrt import runtime
from qrt.errors import UnsupportedError
from qrt.runtime import embedding
from qrt.runtime.pooling import Pooling, choose_pooling, read_pooling

MAX_SEQ_LEN = 64
KEY, NAME = "embed-key", "tiny-embed"
START_TIMEOUT_S = 300  # a cold compile under a loaded CI machine (the graphs are usually in the run's cache)
# Texts of many lengths: one byte (a filler token follows it in the graph), and rows that pad.
TEXTS = ["a", "Hello world", "The quick brown fox jumps over the lazy dog.", "embeddings, in qrt!", "xy" * 20]

_FLAGS = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
          "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def write_sentence_transformers_files(folder: Path, flag: str, normalize: bool) -> None:
    """modules.json (Transformer, Pooling, optionally Normalize), 1_Pooling/config.json with the
    one pooling flag set, and sentence_bert_config.json, as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": TINY["hidden_size"], **{f: f == flag for f in _FLAGS}, "include_prompt": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LEN}))


def make_embedding_checkpoint(folder: Path, arch: str, flag: str, normalize: bool, seed: int,
                              padding_side: str) -> Path:
    """A tiny random base model (transformers' `Qwen3Model` / `LlamaModel`: no lm_head, tensor
    names without `model.`), the byte-level test tokenizer with a pad token, and the
    sentence-transformers files."""
    import transformers
    from tiny_tokenizer import write_tokenizer

    config_cls, model_cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3Model),
                             "llama": (transformers.LlamaConfig, transformers.LlamaModel)}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY)).eval()
    with torch.no_grad():  # transformers initialises norms to 1; random ones catch a norm not loaded
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + 1.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # sentence-transformers pads its batches (Qwen3-Embedding's tokenizer pads on the left).
    config.update(pad_token="<|im_end|>", padding_side=padding_side)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    write_sentence_transformers_files(folder, flag, normalize)
    return folder


@pytest.fixture(scope="module")
def last_dir(tmp_path_factory):
    return make_embedding_checkpoint(tmp_path_factory.mktemp("embed-last"), "qwen3", "pooling_mode_lasttoken",
                                     normalize=True, seed=5, padding_side="left")


@pytest.fixture(scope="module")
def mean_dir(tmp_path_factory):
    return make_embedding_checkpoint(tmp_path_factory.mktemp("embed-mean"), "llama", "pooling_mode_mean_tokens",
                                     normalize=False, seed=6, padding_side="right")


@pytest.fixture(scope="module")
def last_model(last_dir):
    """What the live server serves (same dtype, slots and length): it finds these graphs in the run's cache."""
    return runtime.compile_model(last_dir, dtype=torch.float32, max_seq_len=MAX_SEQ_LEN, progress=False)


@pytest.fixture(scope="module")
def mean_model(mean_dir):
    return runtime.compile_model(mean_dir, dtype=torch.float32, max_seq_len=MAX_SEQ_LEN, progress=False)


def reference(folder: Path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' own vectors of `texts` from `folder`, float32 [N, D]."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


# ---- what a folder says -----------------------------------------------------------------------


def test_pooling_is_read_from_the_sentence_transformers_files(last_dir, mean_dir, tmp_path):
    assert read_pooling(last_dir) == Pooling("last", normalize=True)
    assert read_pooling(mean_dir) == Pooling("mean", normalize=False)
    assert read_pooling(tmp_path) is None  # no modules.json: not an embedding model
    # The newer single `pooling_mode` key reads the same.
    (tmp_path / "modules.json").write_text((mean_dir / "modules.json").read_text())
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert read_pooling(tmp_path) == Pooling("last", normalize=False)
    # Poolings and modules qrt does not run are refused, not skipped.
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(UnsupportedError, match="pooling"):
        read_pooling(tmp_path)
    modules = json.loads((last_dir / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedError, match="Dense"):
        read_pooling(tmp_path)
    # A base model (no lm_head) without the files can only embed: the caller must say how.
    with pytest.raises(UnsupportedError, match="pooling="):
        choose_pooling(None, tmp_path / "nowhere", True, "config.json")
    assert choose_pooling("mean", None, True, "config.json") == Pooling("mean", normalize=True)


# ---- the Python API against sentence-transformers ---------------------------------------------------


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_vectors_match_sentence_transformers(kind, last_dir, mean_dir, last_model, mean_model):
    folder, model = (last_dir, last_model) if kind == "last" else (mean_dir, mean_model)
    expected = reference(folder, TEXTS)
    got = model.embed(TEXTS)
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), TINY["hidden_size"])
    difference = (got - expected).abs().max().item()
    print(f"{kind} pooling: max |qrt - sentence-transformers| = {difference:.2e}")
    assert difference < 1e-5
    norms = got.norm(dim=-1)
    if kind == "last":  # normalized
        torch.testing.assert_close(norms, torch.ones_like(norms))
    else:  # not normalized: the raw means, whose norms are far from 1 here
        assert (norms - 1).abs().min() > 0.05


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_a_batch_equals_its_texts_one_by_one_however_it_is_cut(kind, last_model, mean_model, monkeypatch):
    model = last_model if kind == "last" else mean_model
    one_by_one = torch.cat([model.embed(text) for text in TEXTS])
    batched = model.embed(TEXTS)
    assert (batched - one_by_one).abs().max() < 1e-6
    # Calls of at most 48 padded tokens: the rows go through several calls, longest first, and
    # come back in their order.
    monkeypatch.setattr(embedding, "TOKENS_PER_CALL", 48)
    assert len(embedding.batches([len(model.encode(t)) for t in TEXTS])) > 2
    assert (model.embed(TEXTS) - one_by_one).abs().max() < 1e-6


def test_inputs_as_text_token_ids_or_a_tensor_give_the_same_vectors(last_model):
    ids = [last_model.encode(t) for t in TEXTS[1:3]]
    texts = last_model.embed(TEXTS[1:3])
    torch.testing.assert_close(last_model.embed(ids), texts, rtol=0, atol=1e-6)
    torch.testing.assert_close(last_model.embed(ids[0]), texts[:1], rtol=0, atol=1e-6)
    torch.testing.assert_close(last_model.embed(torch.tensor(ids[0])), texts[:1], rtol=0, atol=1e-6)


def test_dimensions_cut_and_renormalize_only_normalized_vectors(last_model, mean_model):
    full = last_model.embed(TEXTS)
    short = last_model.embed(TEXTS, dimensions=16)
    assert short.shape == (len(TEXTS), 16)
    torch.testing.assert_close(short, F.normalize(full[:, :16], dim=-1))
    for bad in (0, TINY["hidden_size"] + 1):
        with pytest.raises(ValueError, match="dimensions must be"):
            last_model.embed(TEXTS, dimensions=bad)
    with pytest.raises(ValueError, match="does not normalize"):
        mean_model.embed(TEXTS, dimensions=16)


def test_inputs_the_model_cannot_take_are_refused(last_model):
    with pytest.raises(ValueError, match="max_seq_len"):
        last_model.embed([[1] * (MAX_SEQ_LEN + 1)])
    last_model.embed([[1] * MAX_SEQ_LEN])  # a text may fill every position: there is no KV cache to leave room in
    with pytest.raises(ValueError, match="token ids must be in"):
        last_model.embed([[1, TINY["vocab_size"]]])
    with pytest.raises(ValueError, match="empty"):
        last_model.embed(["fine", ""])
    # An embedding model has no lm_head: it does not generate.
    with pytest.raises(ValueError, match="embedding model"):
        last_model.generate([1, 2, 3], 4)
    with pytest.raises(ValueError, match="embedding model"):
        last_model(torch.tensor([[1, 2, 3]]))
    # Every call of every module so far, of many shapes, ran on the two encode graphs warmup compiled.
    report = last_model.compile_report()
    assert report["encode"] == report["encode_one"] == 1 and not report["decode"] and not report["prefill"]


def test_a_causal_lm_embeds_when_asked_and_refuses_when_not(llama_dir):
    """An ordinary checkpoint (with `model.` names and an lm_head, which is not read) pools as
    asked; without a pooling it is not an embedding model. Eager: this checks the loading."""
    import transformers

    model = runtime.compile_model(llama_dir, dtype=torch.float32, compile=False, pooling="mean", progress=False)
    hf = transformers.AutoModel.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    ids = [[5, 6, 7, 8, 9], [10, 11]]
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([row])).last_hidden_state[0].mean(0) for row in ids])
    torch.testing.assert_close(model.embed(ids), F.normalize(expected, dim=-1), rtol=0, atol=1e-5)
    plain = runtime.compile_model(llama_dir, dtype=torch.float32, compile=False, progress=False)
    with pytest.raises(ValueError, match="not an embedding model"):
        plain.embed(ids)


@pytest.mark.parametrize("dtype, quant, closeness", [(torch.bfloat16, None, 0.999), (None, "int8", 0.99)])
def test_other_formats_embed_close_to_float32(last_dir, last_model, dtype, quant, closeness):
    """bf16 weights, and weights quantized to int8 as they load: the same vectors up to their
    rounding (eager here; the compiled builds in the slow test below)."""
    model = runtime.compile_model(last_dir, dtype=dtype, quant=quant, compile=False, progress=False,
                                  max_seq_len=MAX_SEQ_LEN)
    similarity = F.cosine_similarity(model.embed(TEXTS), last_model.embed(TEXTS), dim=-1)
    print(f"dtype={dtype} quant={quant}: least cosine similarity to float32 {similarity.min():.5f}")
    assert similarity.min() > closeness


@pytest.mark.slow
@pytest.mark.parametrize("dtype, quant, closeness", [(torch.bfloat16, None, 0.999), (None, "int8", 0.99)])
def test_other_formats_compiled_embed_close_to_float32(last_dir, last_model, dtype, quant, closeness):
    model = runtime.compile_model(last_dir, dtype=dtype, quant=quant, progress=False, max_seq_len=MAX_SEQ_LEN)
    similarity = F.cosine_similarity(model.embed(TEXTS), last_model.embed(TEXTS), dim=-1)
    assert similarity.min() > closeness
    assert model.compile_report()["encode"] == model.compile_report()["encode_one"] == 1


# ---- POST /v1/embeddings -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(last_dir, last_model, tmp_path_factory):
    port = free_port()
    command = [sys.executable, "-m", "qrt", "serve", str(last_dir), "--port", str(port), "--max-batch", "1",
               "--max-seq-len", str(MAX_SEQ_LEN), "--dtype", "float32", "--api-key", KEY,
               "--served-model-name", NAME]
    srv = ServerProcess(command, port, "/health", tmp_path_factory.mktemp("embed-server") / "server.log")
    try:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_the_route_gives_what_embed_gives_as_floats_and_base64(client, last_model):
    expected = last_model.embed(TEXTS)
    reply = client.embeddings.create(model=NAME, input=TEXTS)
    assert [d.index for d in reply.data] == list(range(len(TEXTS))) and reply.model == NAME
    got = torch.tensor([d.embedding for d in reply.data])
    assert (got - expected).abs().max() < 1e-6
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(last_model.encode(t)) for t in TEXTS)
    # base64: little-endian float32, which the openai client decodes itself when it asked for floats
    # (it sends encoding_format=base64 unless told otherwise), and which we decode here by hand.
    raw = client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert np.abs(vector - expected[1].numpy()).max() < 1e-6
    # One text, token ids, lists of token ids.
    ids = [last_model.encode(t) for t in TEXTS[:2]]
    for given, rows in ((TEXTS[2], [2]), (ids[1], [1]), (ids, [0, 1])):
        got = torch.tensor([d.embedding for d in client.embeddings.create(model=NAME, input=given).data])
        assert (got - expected[rows]).abs().max() < 1e-6


def test_dimensions_on_the_route(client, last_model):
    reply = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=8, encoding_format="float")
    got = torch.tensor([d.embedding for d in reply.data])
    assert got.shape == (2, 8)
    torch.testing.assert_close(got, F.normalize(last_model.embed(TEXTS[:2])[:, :8], dim=-1), rtol=0, atol=1e-6)


def test_the_route_refuses_what_it_cannot_do(client, server):
    cases = [(dict(input=[[1] * (MAX_SEQ_LEN + 1)]), "max_seq_len"),
             (dict(input=TEXTS, dimensions=TINY["hidden_size"] + 1), "dimensions"),
             (dict(input=TEXTS, dimensions=0), "dimensions"),
             (dict(input=[[1, TINY["vocab_size"]]]), "token ids"),
             (dict(input=""), "empty")]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError, match=words):
            client.embeddings.create(model=NAME, encoding_format="float", **kwargs)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another", input="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).embeddings.create(model=NAME,
                                                                                                   input="x")
    # The embedding model does not generate.
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2)


def _in_process_client(model):
    """The app over an engine loop of an already-built model, in this process."""
    from fastapi.testclient import TestClient

    from qrt.server.app import create_app
    from qrt.server.engine_loop import EngineLoop
    from qrt.server.metrics import Metrics

    return TestClient(create_app(EngineLoop(lambda: model, Metrics()), model_name=NAME))


def test_the_route_refuses_a_model_that_does_not_embed_or_normalize(llama_dir, mean_model):
    plain = runtime.compile_model(llama_dir, dtype=torch.float32, compile=False, progress=False)
    with _in_process_client(plain) as http:
        reply = http.post("/v1/embeddings", json={"model": NAME, "input": "x"})
        assert reply.status_code == 400 and "not an embedding model" in reply.json()["error"]["message"]
    with _in_process_client(mean_model) as http:
        reply = http.post("/v1/embeddings", json={"model": NAME, "input": ["x", "yz"]})
        assert reply.status_code == 200
        torch.testing.assert_close(torch.tensor([d["embedding"] for d in reply.json()["data"]]),
                                   mean_model.embed(["x", "yz"]), rtol=0, atol=1e-6)
        reply = http.post("/v1/embeddings", json={"model": NAME, "input": "x", "dimensions": 8})
        assert reply.status_code == 400 and "does not normalize" in reply.json()["error"]["message"]
