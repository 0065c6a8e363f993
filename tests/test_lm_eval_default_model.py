"""Scores people can publish: lm-eval's `local-completions` against `qrt serve` on the real default
model in bf16 (SmolLM2-135M-Instruct), and lm-eval's `hf` backend on the same checkpoint in
float32 and in bf16, on a multiple-choice task written here. qrt's served log-likelihoods must be
as close to float32 as transformers' own bf16 arithmetic is: the mean difference at most 1.25
times, the worst at most 1.5 times, and at most one more answer flipped.

The questions vary in length so that the prompts are scored through every path the server has:
short ones, ones longer than a prefill chunk of 256 tokens (scored over two chunks), and lm-eval's
batches of several prompts in one request."""

import sys

import pytest

from bench.serve_load import ServerProcess, free_port
from test_lm_eval import evaluate, write_mc_task

KEY, NAME = "lm-eval-key", "smollm2-bf16"
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


def differences(scores: list[list[float]], reference: list[list[float]]) -> tuple[float, float, int]:
    """(mean and worst |difference| per choice, answers chosen differently) against the reference."""
    gaps = [abs(a - b) for doc, ref in zip(scores, reference) for a, b in zip(doc, ref)]
    flips = sum(max(range(len(doc)), key=doc.__getitem__) != max(range(len(ref)), key=ref.__getitem__)
                for doc, ref in zip(scores, reference))
    return sum(gaps) / len(gaps), max(gaps), flips


@pytest.mark.slow  # a real 135M model served and scored three ways: a few minutes
@pytest.mark.xfail(strict=True, reason=(
    "one position misses: after the lone-space token of question 31 ('Ten minus three equals' + '  seven') qrt's "
    "compiled prefill scores ' seven' at -12.96 nats where float32 gives -21.04 and transformers' bf16 -20.83 "
    "(qrt eager: -20.83), so the worst difference is 8.1 against transformers' 1.16; the mean (0.215 against "
    "0.211) is within bounds. The cause: a bf16 residual stream's roundings of a 530-sized channel that later cancels; an fp32 stream with eager roundings in compiled graphs passes, and is not in the build yet (docs/quality.md)"))
def test_served_scores_are_as_close_to_float32_as_transformers_bf16(tmp_path, monkeypatch):
    from qrt.runtime.default_model import default_model_path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    questions = QUESTIONS + LONG_QUESTIONS
    assert len(questions) >= 50
    write_mc_task(tmp_path, questions)
    path = default_model_path()  # the bf16 folder converted from the shipped GGUF
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "qrt", "serve", str(path), "--port", str(port), "--api-key", KEY,
                            "--served-model-name", NAME], port, "/health", tmp_path / "server.log")
    try:
        server.wait_ready(START_TIMEOUT_S)
        # batch_size 4: lm-eval sends four prompts in one request, as people run it for speed.
        served = evaluate("local-completions", {
            "model": NAME, "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(path), "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True,
        }, tmp_path, tasks=["qrt_mc"], batch_size=4)["qrt_mc"]
    finally:
        server.stop()
    float32 = evaluate("hf", {"pretrained": str(path), "dtype": "float32"}, tmp_path, tasks=["qrt_mc"])["qrt_mc"]
    bf16 = evaluate("hf", {"pretrained": str(path), "dtype": "bfloat16"}, tmp_path, tasks=["qrt_mc"])["qrt_mc"]
    qrt_mean, qrt_worst, qrt_flips = differences(served, float32)
    hf_mean, hf_worst, hf_flips = differences(bf16, float32)
    report = (f"qrt serve bf16 vs float32: mean {qrt_mean:.4f} worst {qrt_worst:.4f} flips {qrt_flips}; "
              f"transformers bf16 vs float32: mean {hf_mean:.4f} worst {hf_worst:.4f} flips {hf_flips}")
    print(report)
    assert len(served) == len(questions)
    assert qrt_mean <= 1.25 * hf_mean, report
    assert qrt_worst <= 1.5 * hf_worst, report
    assert qrt_flips <= hf_flips + 1, report
