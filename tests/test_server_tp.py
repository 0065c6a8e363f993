"""`qrt serve --tp 2` under torchrun: rank 0 serves HTTP and the other rank steps the same engine
over its half of the weights (qrt/server/lockstep.py). Its answers are the one-process model's,
with requests overlapping, one abandoned midway, and a chat; SIGTERM to the group ends both ranks."""

import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from bench.serve_load import ServerProcess, free_port
from test_server import KEY, MAX_SEQ_LEN, NAME, SLOTS, START_TIMEOUT_S, expected


@pytest.mark.slow  # two ranks compile the tiny model: `make test-slow`
def test_serve_with_tp2_answers_what_one_process_answers(chat_llama_dir, chat_model, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "qrt", "--threads", "1", "serve", str(chat_llama_dir),
               "--tp", "2", "--port", str(port), "--max-batch", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN),
               "--api-key", KEY, "--served-model-name", NAME]
    server = ServerProcess(command, port, "/health", tmp_path / "server.log")
    try:
        server.wait_ready(START_TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        # A stream abandoned after a few chunks: rank 0 drops it, and tells the other rank to.
        stream = client.completions.create(model=NAME, prompt="abandoned", max_tokens=200, temperature=0, stream=True)
        for _, _ in zip(range(3), stream):
            pass
        stream.close()
        prompts = [f"tale {i}" for i in range(5)]  # more than the 4 slots: one waits its turn
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda p: client.completions.create(model=NAME, prompt=p, max_tokens=16,
                                                                        temperature=0).choices[0].text, prompts))
        assert answers == [expected(chat_model, chat_model.encode(p), 16)[0] for p in prompts]
        messages = [{"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == expected(chat_model, chat_model.encode_messages(messages), 12)[0]
    finally:
        stopping = time.monotonic()
        server.stop()
        stop_s = time.monotonic() - stopping
    log = (tmp_path / "server.log").read_text()
    # Rank 0 drained and sent its last round, which ended the other rank: torchrun, which kills
    # ranks that outlast its 30 s grace, did not have to. (torchrun itself prints a traceback of
    # the SIGTERM it got; no rank printed one.)
    assert "qrt: server stopped" in log and stop_s < 25, (stop_s, log)
    assert not re.search(r'File "[^"]*/qrt/', log), log  # no frame of qrt's in a traceback
