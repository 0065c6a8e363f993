"""The chat page at GET /. First without a browser: the page and its files, served open (the API
key guards the API, not the page), by one server and by the front of `--replicas`, with nothing
fetched from elsewhere. Then (`make test-slow`) a headless Chromium, driven by Selenium, against
live `qrt serve` processes on the tiny chat model: an answer streams in, Stop ends a long one on
the server too, refusals are shown in words, and a server with --api-key gets its key asked for
once and kept for the tab."""

import fnmatch
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from fastapi.testclient import TestClient

from bench.serve_load import ServerProcess, free_port, metrics
from qrt.server.affinity import PrefixAffinity
from qrt.server.app import create_app
from qrt.server.chat_page import FILES, PAGE_DIR
from qrt.server.metrics import Metrics
from qrt.server.router import create_router
from test_server import MAX_SEQ_LEN, SLOTS, START_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
KEY = "page-key"
NAME = "tiny-chat"
SCREENSHOT = ROOT / "docs" / "img" / "chat-page.png"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# A cold compile of the default model on two busy cores took over 5 minutes.
DEFAULT_MODEL_START_S = 1500
WAIT_S = 60  # the longest any page state may take to come, with the tiny model on a loaded machine


def _app(api_key=KEY):
    # An engine loop still loading its model: the API answers 503, the page is there already.
    loading = SimpleNamespace(metrics=Metrics(), load_error=None, fault=None, ready=threading.Event(),
                              draining=threading.Event())
    return create_app(loading, model_name=NAME, api_key=api_key)


def _router():
    pool = SimpleNamespace(replicas=[], ready=lambda: [])  # no replica has started: forwarding answers 503
    return create_router(pool, PrefixAffinity(slack=4), prefix_chars=64, max_body_bytes=1 << 20, drain_timeout_s=1)


def _check_page_files(client: TestClient) -> str:
    """Every file of the page, served whole with its content type and the CSP; returns the HTML."""
    for url_path, (name, media_type) in FILES.items():
        reply = client.get(url_path)  # no Authorization header
        assert reply.status_code == 200, (url_path, reply.text)
        assert reply.headers["content-type"] == media_type
        assert reply.content == (PAGE_DIR / name).read_bytes()
        assert "connect-src 'self'" in reply.headers["content-security-policy"]
    html = client.get("/").text
    for url_path in FILES:
        if url_path != "/":
            assert f'"{url_path.lstrip("/")}"' in html, url_path  # the page asks for each of them, relative
    return html


def test_the_page_and_its_files_are_served_without_the_key_which_still_guards_the_api():
    client = TestClient(_app())
    html = _check_page_files(client)
    assert html.startswith("<!doctype html>") and 'role="log"' in html
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 503  # still loading


def test_the_replica_front_serves_the_page_itself():
    client = TestClient(_router())
    assert _check_page_files(client) == TestClient(_app()).get("/").text
    refused = client.get("/v1/models")  # other paths still go to a replica: here none is ready
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_replica_ready"


def test_the_page_fetches_nothing_from_elsewhere():
    for path in sorted(PAGE_DIR.iterdir()):
        text = path.read_text()
        # No absolute URL anywhere (src, href, url(), fetch), no protocol-relative one ("//host"),
        # no style sheet imports: everything the page loads or calls is a path of this server.
        assert not re.search(r"https?://", text, re.I), path.name
        assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*//""", text, re.I), path.name
        assert not re.search(r"""["'`]//""", text), path.name
        assert "@import" not in text and "url(" not in text, path.name
    # The script's requests are relative, so they go wherever the page came from.
    script = (PAGE_DIR / "chat.js").read_text()
    assert re.findall(r"""api\("([^"]+)""", script) == ["v1/models", "v1/chat/completions"]
    assert "fetch(path" in script and script.count("fetch(") == 1


def test_every_file_of_the_page_ships_in_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    page_patterns = patterns["qrt.server.page"]
    names = sorted(path.name for path in PAGE_DIR.iterdir())
    assert names == sorted(name for name, _ in FILES.values())  # the page has no file it does not serve
    for name in names:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in page_patterns), name


# ---- in a browser ---------------------------------------------------------------------------


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (it is in the test extra: pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{path} is missing (apt-get install -y {package})"
    return None


_MISSING = _browser_missing()
needs_browser = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


class Server(ServerProcess):
    def __init__(self, log_path, model=(), api_key=None, name=NAME, slots=SLOTS, max_seq_len=MAX_SEQ_LEN):
        port = free_port()
        command = [sys.executable, "-m", "qrt", "serve", *map(str, model), "--port", str(port),
                   "--max-batch", str(slots), "--max-seq-len", str(max_seq_len), "--served-model-name", name]
        super().__init__(command + (["--api-key", api_key] if api_key else []), port, "/health", log_path)


@pytest.fixture(scope="module")
def servers(chat_llama_dir, tmp_path_factory):
    """One open server and one with --api-key, started together (their compiles overlap)."""
    logs = tmp_path_factory.mktemp("chat-page-servers")
    started = [Server(logs / "open.log", [chat_llama_dir])]
    try:
        started.append(Server(logs / "keyed.log", [chat_llama_dir], api_key=KEY))
        for server in started:
            server.wait_ready(START_TIMEOUT_S)
        yield SimpleNamespace(open=started[0], keyed=started[1])
    finally:
        for server in started:
            server.stop()


def _start_browser(window_size="1280,860"):
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={window_size}", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    # The driver's path is given, so Selenium Manager is not run (it would try to download one).
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    return driver


@pytest.fixture(scope="module")
def browser():
    driver = _start_browser()
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The chat page in the browser, by the ids the page gives its parts."""

    def __init__(self, driver, url):
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        driver.get(url + "/")
        self.wait_for = lambda check, timeout=WAIT_S: WebDriverWait(driver, timeout, poll_frequency=0.05).until(
            lambda _: check())
        self.wait_for(lambda: self.js("return document.getElementById('status').textContent") != "")

    def js(self, script, *args):
        return self.driver.execute_script(script, *args)

    def find(self, element_id):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def text(self, element_id) -> str:
        return self.find(element_id).get_attribute("textContent")

    def fill(self, element_id, value):
        field = self.find(element_id)
        field.clear()
        field.send_keys(str(value))

    def type_message(self, *keys):
        box = self.find("message")
        box.click()
        box.send_keys(*keys)

    def answers(self):
        return self.js("return [...document.querySelectorAll('.message.assistant')].map(m => ({"
                       "text: m.querySelector('.body').textContent, meta: (m.querySelector('.meta') || {}).textContent"
                       " || null, pending: m.classList.contains('pending')}))")

    def record_renders(self):
        """From now on, note the answer's text length at every change while it is still streaming."""
        self.js("window.renders = []; new MutationObserver(() => {"
                " const last = [...document.querySelectorAll('.message.assistant')].pop();"
                " if (last && last.classList.contains('pending'))"
                "   window.renders.push(last.querySelector('.body').textContent.length);"
                "}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true})")

    def dialog_open(self) -> bool:
        return self.js("return document.getElementById('key-dialog').open")


def _greedy_completion_tokens(server, content: str, max_tokens: int, api_key=None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=WAIT_S, json={
        "model": NAME, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["completion_tokens"]


@pytest.mark.slow
@needs_browser
def test_an_answer_streams_in_with_its_speed_and_new_chat_clears_it(servers, browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, servers.open.url)
    page.wait_for(lambda: page.text("status") == "Ready.")
    assert page.text("model-name") == f"Model: {NAME}"
    assert not page.find("model-field").is_displayed()  # one model: no picker
    page.fill("system-prompt", "Be brief.")
    page.fill("temperature", 0)
    page.fill("max-tokens", 120)
    # Shift+Enter is a new line, not a send.
    page.type_message("Hello", Keys.SHIFT, Keys.ENTER, Keys.NULL, "there")
    assert page.find("message").get_attribute("value") == "Hello\nthere"
    assert page.answers() == []
    page.record_renders()
    page.type_message(Keys.ENTER)
    page.wait_for(lambda: page.answers() and page.answers()[-1]["meta"])
    (answer,) = page.answers()
    assert answer["text"] and not answer["pending"]
    # The text came in pieces: several lengths were on the page before the answer ended.
    partial = [n for n in page.js("return window.renders") if n > 0]
    assert len(set(partial)) >= 2, partial
    # The count is the stream's usage: the same greedy request, not streamed, has as many tokens.
    tokens = _greedy_completion_tokens(servers.open, "Hello\nthere", 120)
    assert re.fullmatch(rf"{tokens} tokens? · [\d.]+ tokens/s · first token after [\d.]+ s( · cut at max tokens)?",
                        answer["meta"]), answer["meta"]
    assert page.text("status").startswith("Done: ")
    assert page.find("message").get_attribute("value") == ""
    assert page.js("return document.getElementById('log').getAttribute('aria-busy')") == "false"
    you = page.js("return document.querySelector('.message.user .body').textContent")
    assert you == "Hello\nthere"
    browser.save_screenshot(str(tmp_path / "chat-page.png"))

    page.find("new-chat").click()
    assert page.answers() == [] and page.find("empty-note").is_displayed()
    assert page.js("return document.activeElement.id") == "message"


@pytest.mark.slow
@needs_browser
def test_escape_stops_a_long_answer_and_the_server_drops_it(servers, browser):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, servers.open.url)
    page.wait_for(lambda: page.text("status") == "Ready.")
    page.fill("temperature", 0)
    page.fill("max-tokens", MAX_SEQ_LEN - 64)  # far more than comes before the stop
    cancelled = metrics(servers.open.url).get('qrt_requests_total{outcome="cancelled"}', 0.0)
    page.type_message("Tell me everything", Keys.ENTER)
    page.wait_for(lambda: page.answers() and len(page.answers()[-1]["text"]) > 20)
    assert page.find("stop").is_enabled() and not page.find("send").is_enabled()
    page.find("message").send_keys(Keys.ESCAPE)
    page.wait_for(lambda: page.text("status") == "Stopped.")
    (answer,) = page.answers()
    assert re.fullmatch(r"about \d+ tokens \(chunks counted\) · [\d.]+ tokens/s · first token after [\d.]+ s · stopped",
                        answer["meta"]), answer["meta"]
    time.sleep(0.5)
    assert page.answers()[-1]["text"] == answer["text"]  # nothing more came
    assert page.find("send").is_enabled() and not page.find("stop").is_enabled()
    assert page.js("return document.activeElement.id") == "message"
    # The stop reached the server: the request was cancelled there, not generated to its end.
    deadline = time.monotonic() + WAIT_S
    while metrics(servers.open.url).get('qrt_requests_total{outcome="cancelled"}', 0.0) < cancelled + 1:
        assert time.monotonic() < deadline, "the server did not cancel the stopped request"
        time.sleep(0.1)


@pytest.mark.slow
@needs_browser
def test_refusals_are_shown_in_words_and_the_message_comes_back(servers, browser):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, servers.open.url)
    page.wait_for(lambda: page.text("status") == "Ready.")
    page.fill("max-tokens", MAX_SEQ_LEN + 1)
    page.type_message("Too long an answer", Keys.ENTER)
    page.wait_for(lambda: page.find("error").is_displayed())
    error = page.text("error")
    assert error.startswith("The server answered 400: ") and f"max_seq_len ({MAX_SEQ_LEN})" in error, error
    assert page.answers() == [] and page.find("message").get_attribute("value") == "Too long an answer"
    # The page's own checks, before anything is sent.
    page.fill("temperature", 5)
    page.type_message(Keys.ENTER)
    page.wait_for(lambda: page.text("error") == "Temperature must be a number from 0 to 2.")


# ChatML whose generation prompt opens a reasoning block, as DeepSeek-R1's does: the tiny model's
# answer is then all reasoning (it will not happen to write </think>).
THINKING_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                     "{{ message['content'].split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(chat_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking-model")
    shutil.copytree(chat_llama_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    server = Server(folder / "server.log", [folder])
    try:
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@needs_browser
def test_a_reasoning_models_reasoning_is_shown_in_a_fold_above_the_answer(thinking_server, browser):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, thinking_server.url)
    page.wait_for(lambda: page.text("status") == "Ready.")
    page.fill("temperature", 0)
    page.fill("max-tokens", 24)
    page.type_message("Think first", Keys.ENTER)
    page.wait_for(lambda: page.answers() and page.answers()[-1]["meta"])
    reply = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=WAIT_S, json={
        "model": NAME, "messages": [{"role": "user", "content": "Think first"}], "max_tokens": 24, "temperature": 0})
    expected = reply.json()["choices"][0]["message"]
    assert expected["content"] == "" and expected["reasoning_content"]
    shown = page.js("const m = document.querySelector('.message.assistant');"
                    "const fold = m.querySelector('details.reasoning');"
                    "return {thought: fold.querySelector('.thought').textContent, open: fold.open,"
                    " before: fold.nextElementSibling === m.querySelector('.body'),"
                    " answer: m.querySelector('.body').textContent}")
    # Shown as the server sent it, as text, open while no answer has begun, above the answer.
    assert shown == {"thought": expected["reasoning_content"], "open": True, "before": True, "answer": ""}


@pytest.mark.slow
@needs_browser
def test_markdown_is_rendered_from_escaped_text(servers, browser):
    page = Page(browser, servers.open.url)
    source = ("Some **bold** and *italic* with `<b>code</b>`\n\n- one\n- two <script>window.hit = 1</script>\n\n"
              "3. three\n4. four\n\n```python\nif a < b and c > d:\n    print('<img src=x onerror=\"window.hit=1\">')\n```\n"
              '<img src=x onerror="window.hit=1"> [link](javascript:window.hit=1)')
    html = page.js("return window.qrtMarkdown.render(arguments[0])", source)
    assert html == (
        "<p>Some <strong>bold</strong> and <em>italic</em> with <code>&lt;b&gt;code&lt;/b&gt;</code></p>"
        "<ul><li>one</li><li>two &lt;script&gt;window.hit = 1&lt;/script&gt;</li></ul>"
        '<ol start="3"><li>three</li><li>four</li></ol>'
        '<div class="code"><span class="code-language">python</span><pre><code>if a &lt; b and c &gt; d:\n'
        "    print(&#39;&lt;img src=x onerror=&quot;window.hit=1&quot;&gt;&#39;)</code></pre></div>"
        "<p>&lt;img src=x onerror=&quot;window.hit=1&quot;&gt; [link](javascript:window.hit=1)</p>")
    # Put on the page, it makes no element but the ones written above, and runs nothing.
    tags = page.js("const div = document.createElement('div'); div.innerHTML = arguments[0];"
                   "document.body.append(div); const tags = [...div.querySelectorAll('*')].map(e => e.tagName);"
                   "div.remove(); return tags", html)
    assert set(tags) == {"P", "STRONG", "EM", "CODE", "UL", "OL", "LI", "DIV", "SPAN", "PRE"}
    time.sleep(0.2)
    assert page.js("return window.hit === undefined")


@pytest.mark.slow
@needs_browser
def test_every_control_has_a_label_and_the_keyboard_reaches_it_with_a_visible_ring(servers, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, servers.open.url)
    unlabelled = page.js("return [...document.querySelectorAll('input, select, textarea, button')]"
                         ".filter(e => e.tagName === 'BUTTON' ? !e.textContent.trim() : e.labels.length === 0)"
                         ".map(e => e.id)")
    assert unlabelled == []
    assert page.js("return document.getElementById('log').getAttribute('aria-live')") == "polite"
    page.find("temperature").click()
    ActionChains(browser).send_keys(Keys.TAB).perform()  # keyboard focus: the ring must show
    focused = page.js("const e = document.activeElement; const s = getComputedStyle(e);"
                      "return [e.id, s.outlineStyle, parseFloat(s.outlineWidth)]")
    assert focused[0] == "max-tokens" and focused[1] != "none" and focused[2] >= 2, focused


@pytest.mark.slow
@needs_browser
def test_the_key_is_asked_for_on_a_401_then_kept_for_the_tab(servers, browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, servers.keyed.url)  # GET / itself needs no key
    page.js("sessionStorage.clear()")
    page.driver.refresh()
    page.wait_for(lambda: "asks for an API key" in page.text("status"))
    page.fill("temperature", 0)
    page.fill("max-tokens", 24)
    page.type_message("Hi", Keys.ENTER)
    page.wait_for(page.dialog_open)
    assert page.js("return document.activeElement.id") == "key-input"
    assert page.text("error").startswith("The server answered 401: missing or wrong API key")
    assert "asks for an API key" in page.text("key-reason")

    page.find("key-input").send_keys("wrong-key", Keys.ENTER)
    page.wait_for(lambda: page.dialog_open() and "refused the key" in page.text("key-reason"))
    assert page.text("error").startswith("The server answered 401: missing or wrong API key")
    assert page.answers() == [] and page.find("message").get_attribute("value") == "Hi"

    page.find("key-input").send_keys(KEY, Keys.ENTER)  # the message goes again, with the key
    page.wait_for(lambda: page.answers() and page.answers()[-1]["meta"])
    assert not page.dialog_open() and not page.find("error").is_displayed()
    assert page.js("return sessionStorage.getItem('qrt-api-key')") == KEY
    assert page.text("model-name") == f"Model: {NAME}"
    # Asked once: the next message goes with the kept key.
    page.type_message("Again", Keys.ENTER)
    page.wait_for(lambda: len(page.answers()) == 2 and page.answers()[-1]["meta"])
    assert not page.dialog_open()
    browser.save_screenshot(str(tmp_path / "chat-page-key.png"))


@pytest.mark.slow
@needs_browser
def test_a_server_that_is_gone_is_said_so(servers, browser):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, servers.keyed.url)
    page.wait_for(lambda: page.text("status") == "Ready.")
    servers.keyed.stop()
    page.type_message("Anyone there?", Keys.ENTER)
    page.wait_for(lambda: page.find("error").is_displayed())
    assert page.text("error").startswith("Could not reach the server (")
    assert page.find("message").get_attribute("value") == "Anyone there?"


@pytest.mark.slow
@needs_browser
@pytest.mark.skipif(os.environ.get("QRT_UPDATE_SCREENSHOT") != "1",
                    reason="writes docs/img/chat-page.png: set QRT_UPDATE_SCREENSHOT=1 to run it")
def test_write_the_docs_screenshot_on_the_default_model(tmp_path):
    """The README's picture of the page: the default model (SmolLM2-135M-Instruct) answering."""
    from selenium.webdriver.common.keys import Keys

    # One slot: fewer graphs to compile, and the suite's compile cache starts cold.
    server = Server(tmp_path / "default.log", name="SmolLM2-135M-Instruct", slots=1, max_seq_len=1024)
    driver = None
    try:
        server.wait_ready(DEFAULT_MODEL_START_S)
        driver = _start_browser("1280,1200")  # tall enough for the question and the whole answer
        page = Page(driver, server.url)
        page.wait_for(lambda: page.text("status") == "Ready.")
        page.fill("system-prompt", "You are a helpful assistant.")
        page.fill("temperature", 0)
        page.fill("max-tokens", 200)
        page.type_message("Write a Python function that reverses a string.", Keys.ENTER)
        page.wait_for(lambda: page.answers() and page.answers()[-1]["meta"], timeout=START_TIMEOUT_S)
        assert page.answers()[-1]["text"]
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOT))
    finally:
        if driver is not None:
            driver.quit()
        server.stop()
