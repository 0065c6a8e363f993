"""Scores people can publish: lm-eval's `local-completions` against `qrt serve` on the real default
model in bf16 (SmolLM2-135M-Instruct), and lm-eval's `hf` backend on the same checkpoint in
float32 and in bf16, on a multiple-choice task of 53 questions (bench/lm_eval_task.py). qrt's served log-likelihoods must be
as close to float32 as transformers' own bf16 arithmetic is: the mean difference at most 1.25
times, the worst at most 1.5 times, and at most one more answer flipped.

The questions vary in length so that the prompts are scored through every path the server has:
short ones, ones longer than a prefill chunk of 256 tokens (scored over two chunks), and lm-eval's
batches of several prompts in one request."""

import pytest

from bench.lm_eval_task import LONG_QUESTIONS, QUESTIONS, differences, evaluate, served_scores, write_mc_task

KEY = "lm-eval-key"


@pytest.mark.slow  # a real 135M model served and scored three ways: a few minutes
@pytest.mark.runs_first
def test_served_scores_are_as_close_to_float32_as_transformers_bf16(tmp_path, monkeypatch):
    from qrt.runtime.default_model import default_model_path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    questions = QUESTIONS + LONG_QUESTIONS
    assert len(questions) >= 50
    write_mc_task(tmp_path, questions)
    path = default_model_path()  # the bf16 folder converted from the shipped GGUF
    served = served_scores(path, tmp_path, key=KEY)
    float32 = evaluate("hf", {"pretrained": str(path), "dtype": "float32"}, tmp_path, tasks=["qrt_mc"])["qrt_mc"]
    bf16 = evaluate("hf", {"pretrained": str(path), "dtype": "bfloat16"}, tmp_path, tasks=["qrt_mc"])["qrt_mc"]
    qrt_mean, qrt_worst, qrt_flips = differences(served, float32)
    hf_mean, hf_worst, hf_flips = differences(bf16, float32)
    report = (f"qrt serve bf16 vs float32: mean {qrt_mean:.4f} worst {qrt_worst:.4f} flips {qrt_flips}; "
              f"transformers bf16 vs float32: mean {hf_mean:.4f} worst {hf_worst:.4f} flips {hf_flips}")
    print(report)  # the figures docs/quality.md quotes (pytest -s)
    assert len(served) == len(questions)
    assert qrt_mean <= 1.25 * hf_mean, report
    assert qrt_worst <= 1.5 * hf_worst, report
    assert qrt_flips <= hf_flips + 1, report
