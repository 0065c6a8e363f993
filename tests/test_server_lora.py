"""LoRA adapters in `qrt serve` and `qrt generate`: a live server on the tiny chat model with two
PEFT adapters given at start and `--allow-runtime-lora`, driven by the openai client and raw HTTP.
Every answer with an adapter must be what `CompiledModel.generate(..., lora=name)` gives in this
process on the same files, and differ from the base's (so that a server that ignored the adapter
could not pass)."""

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from bench.serve_load import ServerProcess, free_port, metrics
from helpers.lora_adapters import adapter_config, make_peft_adapter
from qrt import runtime
from qrt.cli import build_parser, main, replica_arguments
from qrt.runtime.sampling import SamplingParams
from test_server import KEY, MAX_SEQ_LEN, NAME, SLOTS, START_TIMEOUT_S

MAX_LORAS = 3
ATTENTION = ("q_proj", "v_proj")  # the startup adapters' targets: the only modules with slots
PROMPT = "The capital of France is"
TOKENS = 12
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(chat_llama_dir, tmp_path_factory):
    """name -> folder of PEFT adapters over the tiny chat model: two served from the start, one
    of rank 16 to load at runtime, and two the server must refuse."""
    root = tmp_path_factory.mktemp("server-lora")
    specs = {"sql": dict(r=8, seed=1), "poem": dict(r=16, lora_alpha=32, seed=2),
             "third": dict(r=16, lora_alpha=32, seed=3),
             "wide": dict(r=32, seed=4), "down": dict(r=8, seed=5, target_modules=("down_proj",))}
    return {name: make_peft_adapter(chat_llama_dir, root / name, **{"target_modules": ATTENTION, **spec})
            for name, spec in specs.items()}


@pytest.fixture(scope="module")
def lora_model(chat_llama_dir, adapters):
    """The served model in this process, compiled as the server compiles it (so that the server
    finds these graphs in the run's compile cache)."""
    return runtime.compile_model(chat_llama_dir, progress=False, max_seq_len=MAX_SEQ_LEN, max_batch_size=SLOTS,
                                 lora={name: adapters[name] for name in ("sql", "poem")}, max_loras=MAX_LORAS)


@pytest.fixture(scope="module")
def server(chat_llama_dir, adapters, lora_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-lora-log") / "server.log"
    with _serve_with_adapters(chat_llama_dir, adapters, log, sys.executable) as srv:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def load(url: str, name: str, folder) -> httpx.Response:
    return post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})


def unload(url: str, name: str) -> httpx.Response:
    return post(url, "/v1/unload_lora_adapter", {"lora_name": name})


def alone(model, ids: list[int], lora: str | None) -> str:
    """The greedy text of the request alone, in this process."""
    engine = model.engine
    seq = engine.submit(model.request(ids, TOKENS, SamplingParams(), text=True, lora=lora))
    engine.run([seq])
    return seq.text


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0).choices[0].text


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_models_lists_the_base_and_each_adapter_with_its_parent(client, adapters):
    cards = {card.id: card.model_dump() for card in client.models.list().data}
    assert list(cards) == [NAME, "poem", "sql"]
    for name in ("poem", "sql"):
        assert {k: cards[name][k] for k in ("object", "owned_by", "parent", "root", "max_model_len")} == {
            "object": "model", "owned_by": "qrt", "parent": NAME, "root": str(adapters[name]),
            "max_model_len": MAX_SEQ_LEN}


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_each_adapter_answers_what_generate_gives_with_it(client, lora_model):
    base = lora_model.generate(PROMPT, TOKENS)
    for name in ("sql", "poem"):
        with_adapter = lora_model.generate(PROMPT, TOKENS, lora=name)
        assert with_adapter != base, f"adapter {name!r} does not change the tiny model's greedy text"
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        assert (out.choices[0].text, out.model) == (with_adapter, name)
    assert complete(client, NAME) == base
    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model="poem", messages=messages, max_tokens=TOKENS, temperature=0)
    assert chat.choices[0].message.content == alone(lora_model, lora_model.encode_messages(messages), "poem")
    # Rows with different adapters, and one with none, share the server's steps.
    names = [NAME, "sql", "poem", "sql"]
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: complete(client, name), names))
    assert answers == [lora_model.generate(PROMPT, TOKENS, lora=None if n == NAME else n) for n in names]


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_an_unknown_model_is_a_404_that_lists_the_known_ones(client):
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "nonesuch")
    error = caught.value.body
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert all(repr(name) in error["message"] for name in (NAME, "sql", "poem")), error["message"]


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_an_adapter_loaded_at_runtime_serves_until_unloaded(server, client, lora_model, adapters):
    started = time.perf_counter()
    reply = load(server.url, "third", adapters["third"])
    load_s = time.perf_counter() - started
    print(f"\nloading a rank-16 adapter into the running server took {load_s * 1000:.0f} ms")
    assert reply.status_code == 200, reply.text
    assert load_s < 1.0  # the target (on the default model)
    lora_model.load_lora("third", adapters["third"])
    try:
        expected = lora_model.generate(PROMPT, TOKENS, lora="third")
        assert expected != lora_model.generate(PROMPT, TOKENS)
        assert complete(client, "third") == expected
        assert "third" in [card.id for card in client.models.list().data]
    finally:
        lora_model.unload_lora("third")
    assert unload(server.url, "third").status_code == 200
    with pytest.raises(openai.NotFoundError, match="'sql'"):
        complete(client, "third")
    assert [card.id for card in client.models.list().data] == [NAME, "poem", "sql"]
    reply = unload(server.url, "third")
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "lora_name"


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_adapters_the_slots_cannot_take_are_400s_naming_the_field(server, adapters, tmp_path):
    def refused(body, param, *words):
        reply = post(server.url, "/v1/load_lora_adapter", body)
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (400, param), reply.text
        assert all(word in error["message"] for word in words), error["message"]

    refused({"lora_name": "wide", "lora_path": str(adapters["wide"])}, "lora_path", "rank 32", "max_lora_rank=16")
    refused({"lora_name": "down", "lora_path": str(adapters["down"])}, "lora_path", "down_proj", "q_proj, v_proj")
    refused({"lora_name": "empty", "lora_path": str(tmp_path)}, "lora_path", "adapter_config.json")
    dora = shutil.copytree(adapters["third"], tmp_path / "dora")
    (dora / "adapter_config.json").write_text(json.dumps({**adapter_config(dora), "use_dora": True}))
    refused({"lora_name": "dora", "lora_path": str(dora)}, "lora_path", "DoRA")
    refused({"lora_name": "sql", "lora_path": str(adapters["third"])}, "lora_name", "loaded already")
    refused({"lora_name": NAME, "lora_path": str(adapters["third"])}, "lora_name", "base model")
    refused({"lora_name": " spaced", "lora_path": str(adapters["third"])}, "lora_name", "spaces")
    refused({"lora_name": "x", "lora_path": str(adapters["third"]), "load_inplace": True}, "load_inplace", "unknown")
    assert load(server.url, "third", adapters["third"]).status_code == 200
    try:  # the third of three slots is taken
        refused({"lora_name": "fourth", "lora_path": str(adapters["third"])}, None, "all 3", "--max-loras")
    finally:
        assert unload(server.url, "third").status_code == 200
    reply = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert reply.status_code == 401  # behind the API key, like every /v1 route


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_loading_and_unloading_compile_nothing_in_the_server(server, client, adapters):
    before = metrics(server.url)["qrt_compiled_graphs"]
    for _ in range(2):
        assert load(server.url, "third", adapters["third"]).status_code == 200
        complete(client, "third")
        complete(client, "sql")
        assert unload(server.url, "third").status_code == 200
    assert metrics(server.url)["qrt_compiled_graphs"] == before


@pytest.mark.slow  # a live server (or its model) compiled with adapter slots: `make test-slow`
def test_runtime_loading_is_off_without_the_flag_and_under_replicas(lora_model, adapters):
    from fastapi.testclient import TestClient

    from qrt.server.affinity import PrefixAffinity
    from qrt.server.app import create_app
    from qrt.server.engine_loop import EngineLoop
    from qrt.server.metrics import Metrics
    from qrt.server.replicas import ReplicaPool
    from qrt.server.router import create_router

    body = {"lora_name": "third", "lora_path": str(adapters["third"])}
    with TestClient(create_app(EngineLoop(lambda: lora_model, Metrics()), model_name=NAME)) as http:
        reply = http.post("/v1/load_lora_adapter", json=body)
        assert reply.status_code == 404 and "--allow-runtime-lora" in reply.json()["error"]["message"]
    assert lora_model.lora_names == ["poem", "sql"]
    front = create_router(ReplicaPool(2, None, {}, 1), PrefixAffinity(slack=1), prefix_chars=8, max_body_bytes=1 << 20,
                          drain_timeout_s=1)
    reply = TestClient(front).post("/v1/load_lora_adapter", json=body)  # no lifespan: no replicas are started
    assert reply.status_code == 400 and "--replicas" in reply.json()["error"]["message"]


@pytest.mark.parametrize("flag, words", [("noequals", "expected NAME=PATH"), ("name=", "expected NAME=PATH"),
                                         ("=path", "non-empty name"), (" a=path", "spaces")])
def test_a_bad_lora_flag_is_an_argparse_error_naming_it(flag, words, capsys):
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--lora", flag])
        assert "argument --lora: " in (err := capsys.readouterr().err) and words in err, err


def test_lora_flags_reach_replicas_and_clash_early(capsys):
    args = build_parser().parse_args(["serve", "m", "--replicas", "2", "--lora", "a=x/y", "--lora", "b=org/b=1",
                                      "--allow-runtime-lora", "--max-lora-rank", "32"])
    assert replica_arguments(args.serve_parser, args) == ["m", "--lora", "a=x/y", "--lora", "b=org/b=1",
                                                          "--max-lora-rank", "32"]
    for argv, words in ((["serve", "m", "--lora", "a=x", "--lora", "a=y"], "two adapters named 'a'"),
                        (["serve", "m", "--lora", "m=x"], "the served model's own name"),
                        (["serve", "m", "--lora", "a=x", "--lora", "b=y", "--max-loras", "1"], "fewer than the 2"),
                        (["generate", "m", "--lora", "a=x", "--use-lora", "b"], "none of the --lora adapters")):
        assert main(argv) == 2
        assert words in capsys.readouterr().err


def test_generate_runs_the_prompt_with_the_adapter_use_lora_names(chat_llama_dir, adapters, capsys):
    eager = runtime.compile_model(chat_llama_dir, progress=False, compile=False, lora={"sql": adapters["sql"]})
    expected = eager.generate(PROMPT, TOKENS, lora="sql")
    assert expected != eager.generate(PROMPT, TOKENS)
    argv = ["generate", str(chat_llama_dir), "--eager", "--no-chat", "--prompt", PROMPT, "--max-new-tokens",
            str(TOKENS), "--lora", f"sql={adapters['sql']}", "--lora", f"poem={adapters['poem']}"]
    assert main([*argv, "--use-lora", "sql"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(argv) == 0  # two adapters without --use-lora: the base alone
    assert capsys.readouterr().out == eager.generate(PROMPT, TOKENS) + "\n"
    assert main(argv[:-2]) == 0  # one adapter: it runs
    assert capsys.readouterr().out == expected + "\n"
    # Slots on o_proj alone: the adapter on q_proj and v_proj is refused, naming its module.
    assert main([*argv[:-2], "--lora-target-modules", "o_proj"]) == 2
    assert "self_attn.q_proj" in capsys.readouterr().err
    assert main([*argv[:-2], "--lora-target-modules", "q_proj, v_proj"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def _serve_with_adapters(chat_llama_dir, adapters, log_path, *launch: str, flags=()) -> ServerProcess:
    """`qrt serve` of the tiny chat model with the two startup adapters, `--allow-runtime-lora`
    and the module server's slots (so that every process finds lora_model's graphs in the run's
    compile cache), run by `launch` (the interpreter, or torchrun) with `flags` added."""
    port = free_port()
    command = [*launch, "-m", "qrt", "--threads", "1" if "--tp" in flags else "2", "serve", str(chat_llama_dir),
               "--port", str(port), "--max-batch", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--api-key", KEY,
               "--served-model-name", NAME, "--lora", f"sql={adapters['sql']}", "--lora",
               f"poem={adapters['poem']}", "--max-loras", str(MAX_LORAS), "--allow-runtime-lora", *flags]
    return ServerProcess(command, port, "/health", log_path)


def _startup_adapters_serve(server, lora_model, adapters, refusal: str) -> None:
    """The startup adapters are listed and answer as in this process; runtime loading is refused."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [card.id for card in client.models.list().data] == [NAME, "poem", "sql"]
    names = [NAME, "sql", "poem", NAME]
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: complete(client, name), names))
    assert answers == [lora_model.generate(PROMPT, TOKENS, lora=None if n == NAME else n) for n in names]
    reply = load(server.url, "third", adapters["third"])
    assert reply.status_code == 400 and refusal in reply.json()["error"]["message"], reply.text


@pytest.mark.slow  # two replicas load the tiny model: `make test-slow`
def test_startup_adapters_are_served_by_every_replica(chat_llama_dir, adapters, lora_model, tmp_path):
    server = _serve_with_adapters(chat_llama_dir, adapters, tmp_path / "front.log", sys.executable,
                                  flags=("--replicas", "2"))
    with server:
        server.wait_ready(START_TIMEOUT_S)
        _startup_adapters_serve(server, lora_model, adapters, "--replicas")
        # Each replica itself serves the adapters, and none loads any at runtime (the front keeps the flag).
        for replica in httpx.get(server.url + "/health", timeout=10).json()["replicas"]:
            url = f"http://127.0.0.1:{replica['port']}"
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
            assert complete(client, "sql") == lora_model.generate(PROMPT, TOKENS, lora="sql")
            reply = load(url, "third", adapters["third"])
            assert reply.status_code == 404 and "--allow-runtime-lora" in reply.text


@pytest.mark.slow  # two ranks compile the tiny model: `make test-slow`
def test_startup_adapters_are_served_under_tp(chat_llama_dir, adapters, lora_model, tmp_path):
    launch = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()))
    server = _serve_with_adapters(chat_llama_dir, adapters, tmp_path / "server.log", *launch, flags=("--tp", "2"))
    with server:
        server.wait_ready(START_TIMEOUT_S)
        _startup_adapters_serve(server, lora_model, adapters, "--tp")
