"""lm-evaluation-harness as the client: its `local-completions` backend against a live `qrt serve`,
on a multiple-choice task (loglikelihood requests: token ids, echo, logprobs) and a generation
task, both written here as JSON (nothing downloads), compared with lm-eval's own `hf` backend
(transformers) on the same checkpoint."""

import json
import textwrap

import pytest

from bench.lm_eval_task import chosen, evaluate, write_mc_task
from test_server import KEY, NAME, server  # noqa: F401  (the fixture: `qrt serve` on the tiny chat model)

# Both sides run the float32 checkpoint in float32: a choice's loglikelihood differs by the order
# of the sums behind it, a few 1e-6 nats per token on this tiny model, far below this bound. (In
# bf16 against fp32, transformers itself moves by about 0.08 nats a choice on such a task.)
NATS = 1e-3
QUESTIONS = [
    ("The colour of the sky on a clear day is", [" blue", " green", " loud", " seven"], 0),
    ("Two plus two equals", [" four", " five", " a cat"], 0),
    ("Water freezes at zero degrees", [" Celsius", " tomorrow", " quickly"], 0),
    ("The opposite of hot is", [" cold", " hot", " purple", " running"], 0),
    ("A baby cat is called a", [" kitten", " puppy", " tree"], 0),
]


def write_tasks(folder):
    write_mc_task(folder, QUESTIONS)
    with open(folder / "gen.jsonl", "w") as out:
        for question, choices, _ in QUESTIONS:
            out.write(json.dumps({"question": question, "answer": choices[0]}) + "\n")
    (folder / "qrt_gen.yaml").write_text(textwrap.dedent(f"""\
        task: qrt_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: answer
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 12
          do_sample: false
        metric_list:
          - metric: exact_match
        """))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(folder)
    return folder


@pytest.mark.slow  # about 90 s: lm-eval's imports, a server, and both backends
def test_lm_eval_against_qrt_serve_matches_its_hf_backend(server, chat_llama_dir, tasks, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    qrt = evaluate("local-completions", {
        "model": NAME, "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(chat_llama_dir), "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True,
    }, tasks)
    hf = evaluate("hf", {"pretrained": str(chat_llama_dir), "dtype": "float32"}, tasks)
    assert len(qrt["qrt_mc"]) == len(QUESTIONS)
    worst = max(abs(a - b) for doc_q, doc_h in zip(qrt["qrt_mc"], hf["qrt_mc"]) for a, b in zip(doc_q, doc_h))
    assert worst < NATS, (worst, qrt["qrt_mc"], hf["qrt_mc"])
    assert qrt["qrt_mc_greedy"] == hf["qrt_mc_greedy"]
    assert [chosen(doc) for doc in qrt["qrt_mc"]] == [chosen(doc) for doc in hf["qrt_mc"]]
    assert qrt["qrt_gen"] == hf["qrt_gen"]
    assert all(isinstance(text, str) for text in qrt["qrt_gen"])
