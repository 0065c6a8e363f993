"""The command line: inspect, dump and generate on a tiny checkpoint."""

import pytest

from helpers.kernel_checks import fp8_cpu_kernel
from qrt import runtime
from qrt.cli import main

FP8_KERNEL = fp8_cpu_kernel("qrt.fp8_linear")


def test_inspect_shows_format_layers_and_tensors(llama_dir, capsys):
    assert main(["inspect", str(llama_dir), "--quant", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "quantization:  fp8 (online" in out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "F32" in out
    assert "model.layers.1.mlp.gate_up_proj" in out and FP8_KERNEL in out
    (lm_head,) = [line for line in out.splitlines() if line.lstrip().startswith("lm_head ")]  # the layer row
    assert "int8" in lm_head and "qrt.int8pack_linear" in lm_head  # online fp8: lm_head int8 per channel


def test_inspect_of_an_unknown_architecture_names_the_supported_ones(llama_dir, tmp_path, capsys):
    import json
    import shutil

    shutil.copytree(llama_dir, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path / "ckpt")]) == 2
    assert "LlamaForCausalLM, Qwen2ForCausalLM" in capsys.readouterr().err


@pytest.mark.slow  # compiles and dumps every graph, about 15 s: `make test-slow`
def test_dump_writes_a_navigable_folder(llama_dir, tmp_path, capsys):
    out = tmp_path / "dump"
    assert main(["dump", str(llama_dir), "--quant", "fp8", "--out", str(out), "--decode-steps", "4"]) == 0
    index = (out / "index.md").read_text()
    assert "prefill: 1 graph(s), 0 break(s)" in index and "decode: 1 graph(s), 0 break(s)" in index
    assert "ok: 4 decode steps" in index
    for role in ("prefill", "decode", "forward"):
        before = out / f"{role}.graph0.00.swap_quantized_linear.before.py"
        after = out / f"{role}.graph0.00.swap_quantized_linear.after.py"
        kernel_call = FP8_KERNEL.removeprefix("qrt.") + "("
        assert "qrt.fp8_linear(" in before.read_text() and kernel_call in after.read_text()
        assert "fp8_linear(" not in after.read_text().replace(kernel_call, "")
    kernels = (out / "kernels.md").read_text()
    assert kernels.count(FP8_KERNEL) >= 3 * 8
    assert (out / "graph_breaks.txt").read_text() == "no graph breaks\n"


def test_generate_reports_invalid_input_without_a_traceback(llama_dir, capsys):
    assert main(["generate", str(llama_dir), "--eager", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "no usable tokenizer" in capsys.readouterr().err


def test_inspect_names_a_stored_fp8_format_and_its_kernels(tmp_path, capsys):
    from helpers.checkpoints.fp8 import make_fp8_checkpoint

    make_fp8_checkpoint(tmp_path / "ckpt", "hf-fp8-block")
    assert main(["inspect", str(tmp_path / "ckpt"), "--tensors", "-1"]) == 0
    out = capsys.readouterr().out
    assert "quantization:  fp8 (HF fp8: block 32x32 weight scales" in out
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in out and "F8_E4M3" in out
    if fp8_cpu_kernel("qrt.fp8_block_linear") == "qrt.fp8_block_linear_native_cpu":
        assert "qrt.fp8_block_linear_native_cpu" in out and "fp8_e4m3 [N, K], block scales" in out
    else:
        assert "qrt.fp8_block_linear_cpu" in out and "dequantized with block scales" in out and "(HF fp8)" in out


@pytest.mark.slow  # a model compiled with its verify graphs: `make test-slow`
def test_generate_with_speculation_says_what_it_kept(chat_llama_dir, capsys):
    args = ["generate", str(chat_llama_dir), "--no-chat", "--prompt", "abcabcabcabcabc", "--max-new-tokens", "24",
            "--speculative", "ngram", "--num-speculative-tokens", "2", "--prompt-lookup-min", "1"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "qrt: speculative decoding kept" in captured.err
    assert main(["generate", str(chat_llama_dir), "--no-chat", "--prompt", "abcabcabcabcabc", "--max-new-tokens",
                 "24"]) == 0
    assert capsys.readouterr().out == captured.out  # the same greedy text as without speculation


def test_draft_flags_without_a_draft_method_are_refused(chat_llama_dir, capsys):
    assert main(["generate", str(chat_llama_dir), "--draft-quant", "int4"]) == 2
    assert "--draft and --draft-quant need --speculative draft" in capsys.readouterr().err
    assert main(["generate", str(chat_llama_dir), "--speculative", "mtp", "--draft", "other"]) == 2
    assert "--draft and --draft-quant need --speculative draft" in capsys.readouterr().err


def test_generate_prints_a_reasoning_models_answer_and_its_reasoning_apart(chat_llama_dir, tmp_path, capsys):
    """A template whose generation prompt opens a <think> block (as DeepSeek-R1's does): the tiny
    model's answer is all reasoning, which goes to stderr, labelled, leaving stdout the answer."""
    import json
    import shutil

    folder = tmp_path / "thinker"
    shutil.copytree(chat_llama_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1] }}"
                               "<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["generate", str(folder), "--eager", "--prompt", "Think", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    model = runtime.compile_model(folder, compile=False, progress=False)
    whole = model.generate("Think", 12, chat=True)  # the same greedy answer, as one text
    assert "</think>" not in whole and whole.strip()
    assert f"thinking: {whole.strip()}\n" in captured.err and captured.out == "\n"  # no answer after it
