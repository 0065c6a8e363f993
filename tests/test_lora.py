"""LoRA adapters beside a base model (qrt/runtime/lora.py), checked against PEFT itself.

The adapters are PEFT's own (tests/helpers/lora_adapters.py: trained a few steps, saved with
save_pretrained); the reference is `PeftModel` over the same base in float32, or, for a quantized
base, over the transformers model holding the base's dequantized weights."""

import json
import shutil

import pytest
import torch
from helpers.checkpoints.format_cases import CASES
from helpers.checkpoints.integer import make_int_checkpoint
from helpers.checkpoints.tiny import make_checkpoint, random_ids
from helpers.compare import relative_l2
from helpers.graph_checks import no_recompiles
from safetensors.torch import save_file
from helpers.lora_adapters import (make_peft_adapter, peft_logits, peft_over_model, peft_reference,
                                   random_peft_adapter)

from qrt import runtime
from qrt.checkpoint.lora_adapter import read_adapter
from qrt.errors import CheckpointError, UnsupportedError
from qrt.runtime.engine import Engine
from qrt.runtime.lora import UnknownAdapter

IDS = random_ids(7, (1, 14))
# float32 throughout: qrt and PEFT differ in summation order only.
FP32 = 2e-6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    make_checkpoint(base, "llama", dtype=torch.float32, seed=3)
    adapters = {
        # Every projection, plain LoRA.
        "every": make_peft_adapter(base, root / "every", seed=1),
        # rsLoRA with a rank and an alpha of their own for some modules, on three kinds only.
        "patterned": make_peft_adapter(base, root / "patterned", seed=2, use_rslora=True, r=8,
                                       rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 32},
                                       target_modules=("q_proj", "v_proj", "down_proj")),
        "mlp": make_peft_adapter(base, root / "mlp", seed=3, r=4, target_modules="all-linear"),
    }
    return base, adapters


@pytest.fixture(scope="module")
def served(files):
    """The base compiled with two adapters resident and a third slot free, four KV slots."""
    base, adapters = files
    return runtime.compile_model(base, max_batch_size=4, max_seq_len=64, progress=False, max_loras=3,
                                 lora={"every": adapters["every"], "patterned": adapters["patterned"]})


def _prompt_logits(model, adapter: str | None) -> torch.Tensor:
    """float32 logits [T, V] of every position of IDS, prefilled into slot 0 with `adapter`."""
    model.lora.bind(0, model.lora.residents.get(adapter))
    try:
        _, hidden = model.prefill_chunk(IDS[0].tolist(), 0, 0, with_hidden=True)
        return model.position_logits(hidden)
    finally:
        model.lora.bind(0, None)


def _base_logits(base) -> torch.Tensor:
    import transformers

    return peft_logits(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), IDS)[0]


@pytest.mark.parametrize("adapter", ["every", "patterned"])
def test_compiled_logits_equal_peft(files, served, adapter):
    base, adapters = files
    reference = peft_logits(peft_reference(base, adapters[adapter]), IDS)[0]
    base_logits = _base_logits(base)
    ours = _prompt_logits(served, adapter)
    assert (ours - reference).abs().max() < FP32 * reference.abs().max()
    # The adapter moves the logits by far more than the bound, so the check above sees it.
    assert (reference - base_logits).abs().max() > 1e3 * FP32 * reference.abs().max()
    assert (_prompt_logits(served, None) - base_logits).abs().max() < FP32 * reference.abs().max()


def test_eager_all_linear_adapter_equals_peft(files):
    base, adapters = files
    model = runtime.compile_model(base, compile=False, progress=False, max_seq_len=64, lora={"mlp": adapters["mlp"]})
    reference = peft_logits(peft_reference(base, adapters["mlp"]), IDS)[0]
    assert (_prompt_logits(model, "mlp") - reference).abs().max() < FP32 * reference.abs().max()


def test_bf16_base_against_peft(files, tmp_path):
    """A bf16 model: within bf16's rounding of PEFT in float32, and nearer it than the base alone."""
    base, adapters = files
    model = runtime.compile_model(base, dtype="bfloat16", compile=False, progress=False, max_seq_len=64,
                                  lora={"every": adapters["every"]})
    reference = peft_logits(peft_reference(base, adapters["every"]), IDS)[0]
    base_logits = _base_logits(base)
    ours = _prompt_logits(model, "every")
    assert relative_l2(ours, reference) < 0.02
    assert relative_l2(ours, reference) < relative_l2(base_logits, reference) / 4


def test_gptq_base_against_peft_over_its_dequantized_weights(files, tmp_path):
    """A quantized base: the adapter over GPTQ int4 weights, against PEFT over the transformers
    model that holds those weights dequantized."""
    _, adapters = files
    folder = tmp_path / "gptq"
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    dequantized = make_int_checkpoint(folder, "gptq", config, seed=3, bits=4, group_size=32)
    model = runtime.compile_model(folder, compile=False, progress=False, max_seq_len=64,
                                  lora={"every": adapters["every"]})
    reference = peft_logits(peft_over_model(dequantized, adapters["every"]), IDS)[0]
    assert (_prompt_logits(model, "every") - reference).abs().max() < 1e-5 * reference.abs().max()


def _mixed_batch_equals_rows_alone(model) -> None:
    """Four prompts with three different adapters and none: generated together, as each alone."""
    prompts = [random_ids(s, (1, 6 + s))[0].tolist() for s in range(4)]
    names = ["every", "patterned", "mlp", None]
    together = model.generate_batch(prompts, 10, lora=names)
    alone = [model.generate(p, 10, lora=n) for p, n in zip(prompts, names)]
    assert together == alone
    # Every adapter changes its row's tokens, so a row that ran another's would be seen.
    assert all(t != model.generate(p, 10) for t, p in zip(together[:3], prompts))


def test_rows_with_different_adapters_equal_each_row_alone(files, served):
    served.load_lora("mlp", files[1]["mlp"])
    try:
        _mixed_batch_equals_rows_alone(served)
    finally:
        served.unload_lora("mlp")


@pytest.mark.slow  # one more compile, in bf16: `make test-slow`
def test_bf16_rows_with_different_adapters_equal_each_row_alone(files):
    """In bf16 too, as the batch-invariance tests demand of qrt's CPU kernels: a row's result
    does not depend on the rows beside it, the LoRA kernel's included."""
    base, adapters = files
    model = runtime.compile_model(base, dtype="bfloat16", max_batch_size=4, max_seq_len=64, progress=False,
                                  lora={name: adapters[name] for name in ("every", "patterned", "mlp")})
    _mixed_batch_equals_rows_alone(model)


def test_loading_and_unloading_never_recompiles(files, served):
    _, adapters = files
    prompt = IDS[0].tolist()
    before = served.generate(prompt, 8, lora="every")
    with no_recompiles(served):
        served.load_lora("mlp", adapters["mlp"])
        with_mlp = served.generate(prompt, 8, lora="mlp")
        served.unload_lora("mlp")
        served.load_lora("every again", adapters["every"])
        again = served.generate(prompt, 8, lora="every again")
        served.unload_lora("every again")
    assert again == before
    assert with_mlp != before
    with pytest.raises(UnknownAdapter, match="'mlp'.*loaded: \\['every', 'patterned'\\]"):
        served.generate(prompt, 4, lora="mlp")


def test_a_prefix_is_reused_only_under_the_same_adapter(served):
    engine = Engine(served, chunk_size=4)
    prompt = random_ids(11, (1, 13))[0].tolist()

    def run(adapter):
        seq = engine.submit(served.request(prompt, 6, runtime.sampling.SamplingParams(), lora=adapter))
        engine.run([seq])
        return seq.tokens

    first = run("every")
    reused = served.prefix_cache.reused_tokens
    other = run("patterned")
    assert served.prefix_cache.reused_tokens == reused  # another adapter's keys and values are not reused
    assert run("every") == first
    assert served.prefix_cache.reused_tokens > reused
    assert other == served.generate(prompt, 6, lora="patterned")


def test_adapters_beyond_the_slots_rank_or_targets_are_refused(files, tmp_path):
    base, adapters = files
    model = runtime.compile_model(base, compile=False, progress=False, max_seq_len=64, max_loras=1,
                                  max_lora_rank=8, lora_targets=["q_proj", "v_proj"])
    assert model.lora.targets == ["k_proj", "q_proj", "v_proj"]  # the fused q/k/v layer holds slots
    with pytest.raises(ValueError, match="mlp.down_proj.*not one of the layers"):
        model.load_lora("every", adapters["every"])
    assert model.lora_names == []  # a refused adapter leaves nothing behind
    wide = make_peft_adapter(base, tmp_path / "wide", r=16, target_modules=("q_proj",))
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank=8"):
        model.load_lora("wide", wide)
    model.load_lora("q", make_peft_adapter(base, tmp_path / "q", r=4, target_modules=("q_proj", "v_proj")))
    with pytest.raises(ValueError, match="all 1 LoRA adapter slots are in use"):
        model.load_lora("q2", tmp_path / "q")
    with pytest.raises(ValueError, match="loaded already"):
        model.load_lora("q", tmp_path / "q")


def test_files_qrt_cannot_honour_are_refused_by_name(files, tmp_path):
    base, adapters = files
    dora = make_peft_adapter(base, tmp_path / "dora", use_dora=True, target_modules=("q_proj",))
    with pytest.raises(UnsupportedError, match="DoRA"):
        read_adapter(dora)
    saved = make_peft_adapter(base, tmp_path / "saved", modules_to_save=["lm_head"], target_modules=("q_proj",))
    with pytest.raises(UnsupportedError, match="modules_to_save \\['lm_head'\\]"):
        read_adapter(saved)
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        read_adapter(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(adapters["every"], broken)
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}, str(broken / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="q_proj.weight'.*expected base_model.model.<module>.lora_A.weight"):
        read_adapter(broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_adapter(broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(UnsupportedError, match="peft_type 'IA3'"):
        read_adapter(broken)


def test_frozen_build_and_unknown_names_are_refused(files, served):
    base, adapters = files
    with pytest.raises(UnsupportedError, match="build='regional'"):
        runtime.compile_model(base, build="frozen", progress=False, lora={"every": adapters["every"]})
    with pytest.raises(UnknownAdapter, match="'nope'"):
        served.generate(IDS[0].tolist(), 2, lora="nope")
    plain = runtime.compile_model(base, compile=False, progress=False, max_seq_len=64)
    with pytest.raises(ValueError, match="without LoRA slots"):
        plain.generate(IDS[0].tolist(), 2, lora="every")


# Every base format: each adapted layer's output gains exactly scaling · B A x for the rows that
# run the adapter and nothing for the others, whatever kernel runs the base. The quick loop runs
# one case per family of base kernel; `make test-slow` every case.
QUICK_BASES = {"none", "stored:gptq", "stored:gguf", "stored:bitsandbytes"}


@pytest.mark.parametrize("name", [n if n in QUICK_BASES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_every_base_format_adds_the_adapter_to_its_layers(name, tmp_path, llama_dir):
    case = CASES[name]
    folder = llama_dir if case.write is None else tmp_path / "case"
    if case.write is not None:
        case.write(folder)
    model = runtime.compile_model(folder, quant=case.quant, dtype=case.dtype, compile=False, progress=False,
                                  max_seq_len=64, max_batch_size=2, max_loras=1)
    model.load_lora("every", random_peft_adapter(model.model.config, tmp_path / "adapter"))
    adapter = read_adapter(tmp_path / "adapter")
    lora, names = model.lora, model.model.checkpoint_names()
    lora.rows[:2] = torch.tensor([lora.residents["every"].slot, 0])
    for number, (module, pair) in enumerate(adapter.modules.items()):
        param, shard_id = names.parameter_of(f"{module}.weight")
        linear = model.model.get_submodule(param.removesuffix(".weight"))
        offset, size = linear.shard_layout.offsets[shard_id] if linear.shard_layout else (0, linear.output_size)
        x = torch.randn(2, 3, linear.input_size, generator=torch.Generator().manual_seed(number)).to(model.model.dtype)
        with torch.no_grad():
            y = linear(x)
            linear.lora, held = None, linear.lora
            y0 = linear(x)
            linear.lora = held
        expected = (x[0].double() @ pair.a.double().T @ pair.b.double().T) * pair.scaling  # [3, n]
        got = (y[0, :, offset:offset + size] - y0[0, :, offset:offset + size]).double()
        bound = (1e-5 if model.model.dtype == torch.float32 else 2e-2) * expected.abs().max()
        assert (got - expected).abs().max() < bound, module
        assert torch.equal(y[1], y0[1]), module  # a row without the adapter: the base alone
    assert len(adapter.modules) == 7 * model.model.config.num_layers


@pytest.mark.slow
def test_two_ranks_equal_peft(files, tmp_path):
    """tp=2: A follows a row-parallel layer's input split, B a column-parallel layer's output
    split; both ranks' logits and tokens equal PEFT's."""
    from test_tensor_parallel import torchrun

    base, adapters = files
    ids = IDS[0].tolist()
    jobs = [{"name": name, "path": str(base), "compile": compile, "ids": [ids], "prompt": ids[:6], "steps": 8,
             "forward": False, "lora": {"every": str(adapters["every"])}, "use_lora": "every",
             "teacher_forced": {"ids": ids, "prefill": 4}} for name, compile in (("eager", False), ("compiled", True))]
    done = torchrun(jobs, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    peft = peft_reference(base, adapters["every"])
    reference = peft_logits(peft, IDS)[0, 3:]  # the positions teacher_forced_logits scores
    with torch.no_grad():
        tokens = peft.generate(torch.tensor([ids[:6]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 6:].tolist()
    for name in ("eager", "compiled"):
        assert (results[name]["teacher_forced"] - reference).abs().max() < 1e-5 * reference.abs().max(), name
        assert results[name]["tokens"] == tokens, name
