"""A multiple-choice task for lm-evaluation-harness, written as JSON (nothing downloads), and the
helpers that score it through lm-eval's backends and compare the scores.

QUESTIONS (short prompts, and LONG_QUESTIONS past one 256-token prefill chunk) are what the real
default model is scored on: tests/test_lm_eval_default_model.py (qrt serve in bf16 against
transformers) and bench/lm_eval_quant.py (qrt's quantized models against their own float32
models). lm-eval joins a question and a choice with a space, so the choices' own leading spaces
also score positions after a lone-space token."""

import json
import sys
import textwrap
from pathlib import Path

from bench.serve_load import ServerProcess, free_port

SERVED_NAME = "qrt-mc"
START_TIMEOUT_S = 600

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("The capital of Japan is", [" Tokyo", " Beijing", " Seoul", " Bangkok"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mars", " Venus", " Mercury"], 0),
    ("Water boils at sea level at a temperature of 100 degrees", [" Celsius", " Kelvin", " miles", " grams"], 0),
    ("The chemical symbol for gold is", [" Au", " Ag", " Fe", " Pb"], 0),
    ("A triangle has", [" three sides", " four sides", " five sides", " six sides"], 0),
    ("The opposite of day is", [" night", " morning", " noon", " week"], 0),
    ("Bees make", [" honey", " milk", " silk", " wool"], 0),
    ("The first month of the year is", [" January", " March", " June", " October"], 0),
    ("Ice is water in its", [" solid", " liquid", " gaseous", " plasma"], 0),
    ("The sun rises in the", [" east", " west", " north", " south"], 0),
    ("A spider has eight", [" legs", " wings", " eyes closed", " tails"], 0),
    ("The author of Romeo and Juliet is William", [" Shakespeare", " Wordsworth", " Blake", " Golding"], 0),
    ("Humans breathe in oxygen and breathe out carbon", [" dioxide", " monoxide", " fibre", " paper"], 0),
    ("The longest river in Africa is the", [" Nile", " Thames", " Danube", " Volga"], 0),
    ("Question: How many days are in a week?\nAnswer:", [" seven", " five", " ten", " twelve"], 0),
    ("Question: What colour is grass?\nAnswer:", [" green", " blue", " red", " purple"], 0),
    ("Question: Which animal barks?\nAnswer:", [" a dog", " a cat", " a fish", " a bird"], 0),
    ("Question: What do we call frozen rain?\nAnswer:", [" hail", " fog", " dew", " steam"], 0),
    ("Question: Which organ pumps blood through the body?\nAnswer:", [" the heart", " the lungs",
                                                                      " the liver", " the skin"], 0),
    ("Question: What is the boiling point of water in Fahrenheit?\nAnswer:", [" 212", " 100", " 32", " 451"], 0),
    ("Question: Which gas do plants absorb from the air?\nAnswer:", [" carbon dioxide", " helium", " neon",
                                                                    " argon"], 0),
    ("Question: What is the plural of mouse?\nAnswer:", [" mice", " mouses", " meese", " mousen"], 0),
    ("Question: Which ocean lies between Europe and America?\nAnswer:", [" the Atlantic", " the Pacific",
                                                                        " the Indian", " the Arctic"], 0),
    ("Question: How many legs does an insect have?\nAnswer:", [" six", " four", " eight", " ten"], 0),
    ("Question: What is the fastest land animal?\nAnswer:", [" the cheetah", " the tortoise", " the cow",
                                                            " the snail"], 0),
    ("Question: In which season do leaves fall from the trees?\nAnswer:", [" autumn", " spring", " summer",
                                                                          " never"], 0),
    ("Question: What do you use to write on a blackboard?\nAnswer:", [" chalk", " soup", " a spoon", " glue"], 0),
    ("Question: What is the main language spoken in Brazil?\nAnswer:", [" Portuguese", " Spanish", " French",
                                                                       " Dutch"], 0),
    ("Question: Which instrument has black and white keys?\nAnswer:", [" the piano", " the drum",
                                                                      " the flute", " the harp"], 0),
    ("Two plus two equals", [" four", " five", " three", " six"], 0),
    ("Ten minus three equals", [" seven", " six", " eight", " thirteen"], 0),
    ("Five times five equals", [" twenty-five", " ten", " fifty", " fifteen"], 0),
    ("Half of one hundred is", [" fifty", " twenty", " ten", " two hundred"], 0),
    ("The square root of nine is", [" three", " nine", " eighty-one", " one"], 0),
    ("Q: What shape is a football usually?\nA: It is", [" round", " square", " flat", " triangular"], 0),
    ("Q: Where do fish live?\nA: They live in", [" water", " trees", " deserts", " clouds"], 0),
    ("Q: What do cows drink?\nA: They drink", [" water", " milk", " oil", " juice"], 0),
    ("Q: What is the tallest animal?\nA: It is the", [" giraffe", " mouse", " rabbit", " hen"], 0),
    ("Q: Which planet do we live on?\nA: We live on", [" Earth", " Mars", " the Moon", " Saturn"], 0),
    ("Complete the sentence. The cat sat on the", [" mat", " cloud", " equation", " thunder"], 0),
    ("Complete the sentence. She opened the door with a", [" key", " banana", " river", " song"], 0),
    ("Complete the sentence. He drank a glass of", [" water", " bricks", " sand", " nails"], 0),
    ("Complete the sentence. At night we see the moon and the", [" stars", " sandwiches", " chairs",
                                                                 " bicycles"], 0),
    ("Complete the sentence. Birds build their", [" nests", " cars", " bridges", " phones"], 0),
    ("Pick the odd one out: apple, banana, carrot, cherry. The odd one is", [" carrot", " apple", " banana",
                                                                             " cherry"], 0),
    ("Pick the odd one out: red, blue, green, table. The odd one is", [" table", " red", " blue", " green"], 0),
    ("Which word means very happy?", [" joyful", " gloomy", " angry", " tired"], 0),
    ("Which word means the opposite of ancient?", [" modern", " old", " antique", " aged"], 0),
    ("Which is heavier, a kilogram of iron or a gram of feathers? The heavier one is", [" the iron",
                                                                                       " the feathers"], 0),
]

# Prompts past one prefill chunk (256 tokens): a passage, then a question about it.
PASSAGE = ("The village of Westbrook lies in a valley between two hills. Every morning the baker opens "
           "his shop at six, and the smell of fresh bread fills the main street. The river that runs "
           "through the village is crossed by an old stone bridge, built three hundred years ago. In "
           "spring the meadows are full of flowers, and in winter the children skate on the frozen "
           "pond behind the church. ") * 4
LONG_QUESTIONS = [
    (PASSAGE + "Question: What does the baker open at six?\nAnswer: his", [" shop", " bridge", " church", " pond"], 0),
    (PASSAGE + "Question: What crosses the river?\nAnswer: an old stone", [" bridge", " wall", " boat", " tower"], 0),
    (PASSAGE + "Question: Where do the children skate in winter?\nAnswer: on the", [" pond", " river", " hills",
                                                                                   " bread"], 0),
]


def write_mc_task(folder, questions) -> None:
    """lm-eval task `qrt_mc` in `folder`: the multiple-choice questions [(question, choices, answer)]."""
    with open(folder / "mc.jsonl", "w") as out:
        for question, choices, answer in questions:
            out.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (folder / "qrt_mc.yaml").write_text(textwrap.dedent(f"""\
        task: qrt_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
        """))


def evaluate(model: str, model_args: dict, tasks_dir, tasks=("qrt_mc", "qrt_gen"), batch_size: int = 1) -> dict:
    """{task: [(per-choice loglikelihoods or the generated text, per document)]} from lm-eval."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                              task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                              batch_size=batch_size, device="cpu")
    samples = results["samples"]
    by_doc = {task: sorted(samples[task], key=lambda s: s["doc_id"]) for task in samples}
    found = {}
    if "qrt_mc" in by_doc:
        found["qrt_mc"] = [[float(r[0][0]) for r in s["resps"]] for s in by_doc["qrt_mc"]]
        found["qrt_mc_greedy"] = [[bool(r[0][1]) for r in s["resps"]] for s in by_doc["qrt_mc"]]
    if "qrt_gen" in by_doc:
        found["qrt_gen"] = [s["resps"][0][0] for s in by_doc["qrt_gen"]]
    return found


def chosen(choice_scores: list[float]) -> int:
    """The index of the choice a question's log-likelihoods pick (the first of equal ones)."""
    return max(range(len(choice_scores)), key=choice_scores.__getitem__)


def differences(scores: list[list[float]], reference: list[list[float]]) -> tuple[float, float, int]:
    """(mean and worst |difference| per choice, answers chosen differently) against the reference."""
    gaps = [abs(a - b) for doc, ref in zip(scores, reference) for a, b in zip(doc, ref)]
    flips = sum(chosen(doc) != chosen(ref) for doc, ref in zip(scores, reference))
    return sum(gaps) / len(gaps), max(gaps), flips


def served_scores(path, work: Path, quant: str | None = None, key: str = "lm-eval-key",
                  batch_size: int = 4) -> list[list[float]]:
    """lm-eval's local-completions against `qrt serve PATH [--quant QUANT]`: the per-choice
    log-likelihoods of the task written in `work` (write_mc_task), per question. batch_size 4:
    lm-eval sends four prompts in one request, as people run it for speed. The environment must
    hold OPENAI_API_KEY=key."""
    port = free_port()
    command = [sys.executable, "-m", "qrt", "serve", str(path), "--port", str(port), "--api-key", key,
               "--served-model-name", SERVED_NAME] + ([] if quant is None else ["--quant", quant])
    server = ServerProcess(command, port, "/health", work / f"server-{quant or 'as-stored'}.log")
    try:
        server.wait_ready(START_TIMEOUT_S)
        return evaluate("local-completions", {
            "model": SERVED_NAME, "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(path), "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True,
        }, work, tasks=["qrt_mc"], batch_size=batch_size)["qrt_mc"]
    finally:
        server.stop()
