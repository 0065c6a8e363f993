// The chat page: a conversation with the model of the server that served this page, each answer
// streamed from POST v1/chat/completions (server-sent events read from fetch's ReadableStream).
// Every URL is relative to the page, so the page works wherever `qrt serve` (or the front of
// `qrt serve --replicas N`) is reached.
(function () {
  "use strict";

  const KEY_STORAGE = "qrt-api-key";
  const MODELS_RETRY_MS = 2000; // while the server is still loading its model (503)
  const $ = (id) => document.getElementById(id);
  const el = {
    log: $("log"), empty: $("empty-note"), error: $("error"), status: $("status"),
    composer: $("composer"), message: $("message"), send: $("send"), stop: $("stop"), newChat: $("new-chat"),
    system: $("system-prompt"), temperature: $("temperature"), maxTokens: $("max-tokens"),
    model: $("model"), modelField: $("model-field"), modelName: $("model-name"), setKey: $("set-key"),
    keyDialog: $("key-dialog"), keyReason: $("key-reason"), keyInput: $("key-input"),
    keySave: $("key-save"), keyCancel: $("key-cancel"),
  };
  const state = {
    history: [], // the finished turns: {role, content}, and reasoning_content where an answer had it
    models: null, // the ids GET v1/models listed, once it answered
    controller: null, // the AbortController of the answer being streamed
    conversation: 0, // counts New chats, so that an answer stopped by one is not filed in the next
    retry: null, // what to run again once the key dialog gives a key
  };

  // A refusal or failure, in words for the page. status: the HTTP status, 0 when none came.
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function storedKey() {
    try {
      return sessionStorage.getItem(KEY_STORAGE) || "";
    } catch (err) { // storage turned off: the key lives as long as the page
      return state.key || "";
    }
  }

  function storeKey(key) {
    state.key = key;
    try {
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else sessionStorage.removeItem(KEY_STORAGE);
    } catch (err) { /* kept in state.key only */ }
  }

  // fetch with the key; any answer but 2xx becomes an ApiError with the server's own message.
  async function api(path, options) {
    const headers = Object.assign({}, options && options.headers);
    const key = storedKey();
    if (key) headers.Authorization = "Bearer " + key;
    let response;
    try {
      response = await fetch(path, Object.assign({}, options, { headers }));
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, "Could not reach the server (" + err.message + "). Is qrt serve still running?");
    }
    if (!response.ok) throw new ApiError(response.status, await refusal(response));
    return response;
  }

  async function refusal(response) {
    const text = await response.text().catch(() => "");
    let message = "";
    try {
      const body = JSON.parse(text);
      message = (body && body.error && body.error.message) || "";
    } catch (err) { /* not JSON: the text itself, below */ }
    message = message || text.trim().slice(0, 300) || response.statusText;
    return "The server answered " + response.status + ": " + message;
  }

  // The data of each server-sent event, as text, until the stream ends.
  async function* events(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        let chunk;
        try {
          chunk = await reader.read();
        } catch (err) {
          if (err.name === "AbortError") throw err;
          throw new ApiError(0, "The connection broke during the answer (" + err.message + ").");
        }
        if (chunk.done) return;
        buffer += decoder.decode(chunk.value, { stream: true });
        let end;
        while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
          const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield data;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  // ---- the page --------------------------------------------------------------------------

  function setStatus(text) {
    el.status.textContent = text;
  }

  function showError(text) {
    el.error.textContent = text;
    el.error.hidden = false;
  }

  function clearError() {
    el.error.textContent = "";
    el.error.hidden = true;
  }

  function nearBottom() {
    return el.log.scrollHeight - el.log.scrollTop - el.log.clientHeight < 40;
  }

  function addMessage(role, text) {
    const follow = nearBottom();
    const node = document.createElement("article");
    node.className = "message " + role;
    const who = document.createElement("h2");
    who.className = "role";
    who.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    if (role === "user") body.textContent = text; // shown as typed, never as markup
    node.append(who, body);
    el.log.append(node);
    el.empty.hidden = true;
    if (follow) el.log.scrollTop = el.log.scrollHeight;
    return node;
  }

  function renderAnswer(node, text) {
    const follow = nearBottom();
    node.querySelector(".body").innerHTML = window.qrtMarkdown.render(text);
    if (follow) el.log.scrollTop = el.log.scrollHeight;
  }

  // A reasoning model's reasoning (the stream's reasoning_content), as plain text in a fold above
  // the answer: open while the model reasons, folded once the answer begins.
  function renderReasoning(node, thought, answering) {
    const follow = nearBottom();
    let fold = node.querySelector(".reasoning");
    if (!fold) {
      fold = document.createElement("details");
      fold.className = "reasoning";
      fold.open = true;
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      const text = document.createElement("div");
      text.className = "thought";
      fold.append(summary, text);
      node.querySelector(".body").before(fold);
    }
    fold.querySelector(".thought").textContent = thought; // shown as written, never as markup
    if (answering && !fold.dataset.folded) {
      fold.open = false;
      fold.dataset.folded = "yes"; // folded once: a reader who opens it again keeps it open
    }
    if (follow) el.log.scrollTop = el.log.scrollHeight;
  }

  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
    el.log.setAttribute("aria-busy", String(busy)); // the live region speaks the answer once it is whole
    if (!busy && (document.activeElement === el.stop || document.activeElement === document.body)) {
      el.message.focus(); // the Stop button just turned off under the keyboard's focus
    }
  }

  function fillModels(ids) {
    const chosen = el.model.value;
    el.model.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(chosen)) el.model.value = chosen;
    el.modelField.hidden = ids.length < 2;
    el.modelName.textContent = ids.length === 1 ? "Model: " + ids[0] : ids.length + " models";
  }

  async function loadModels() {
    const body = await (await api("v1/models")).json();
    const ids = (body.data || []).map((model) => model.id);
    if (!ids.length) throw new ApiError(0, "The server lists no models.");
    state.models = ids;
    fillModels(ids);
  }

  function settings() {
    const temperatureText = el.temperature.value.trim();
    const temperature = temperatureText === "" ? 1 : Number(temperatureText);
    if (!Number.isFinite(temperature) || temperature < 0 || temperature > 2) {
      throw new ApiError(0, "Temperature must be a number from 0 to 2.");
    }
    const maxText = el.maxTokens.value.trim();
    const maxTokens = maxText === "" ? null : Number(maxText);
    if (maxTokens !== null && (!Number.isInteger(maxTokens) || maxTokens < 1)) {
      throw new ApiError(0, "Max tokens must be a whole number of at least 1, or empty.");
    }
    return { temperature, maxTokens, system: el.system.value.trim(), model: el.model.value || state.models[0] };
  }

  // Tokens per second are measured from the first piece of text to the last, so they leave out
  // the wait for the first token (shown apart). The count is the stream's usage
  // (stream_options.include_usage); a stopped answer has none, and then the text chunks are
  // counted instead: one per token, except where the server held text back and sent it later.
  function statsLine(timing) {
    const exact = timing.usage !== null;
    const tokens = exact ? timing.usage.completion_tokens : timing.chunks;
    const parts = [(exact ? "" : "about ") + tokens + (tokens === 1 ? " token" : " tokens") +
                   (exact ? "" : " (chunks counted)")];
    if (tokens > 1 && timing.last > timing.first) {
      parts.push(((tokens - 1) * 1000 / (timing.last - timing.first)).toFixed(1) + " tokens/s");
    }
    if (timing.first) parts.push("first token after " + ((timing.first - timing.started) / 1000).toFixed(2) + " s");
    if (timing.stopped) parts.push("stopped");
    else if (timing.finish === "length") parts.push("cut at max tokens");
    return parts.join(" · ");
  }

  // One turn: the user's message and the streamed answer. A turn that fails before any text
  // comes is taken back (the message returns to the box); one that fails midway keeps its text.
  async function turn(text) {
    if (!state.models) await loadModels();
    const chosen = settings();
    const messages = chosen.system ? [{ role: "system", content: chosen.system }] : [];
    messages.push(...state.history, { role: "user", content: text });
    const request = { model: chosen.model, messages, stream: true, stream_options: { include_usage: true },
                      temperature: chosen.temperature };
    if (chosen.maxTokens !== null) request.max_tokens = chosen.maxTokens;

    const conversation = state.conversation;
    const question = addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.classList.add("pending");
    el.message.value = "";
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    setStatus("Answering… (Escape stops)");
    const timing = { started: performance.now(), first: 0, last: 0, chunks: 0, usage: null, finish: null,
                     stopped: false };
    let reply = "";
    let thought = "";
    let done = false;
    let failure = null;
    let frame = 0;
    try {
      const response = await api("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request),
        signal: controller.signal,
      });
      for await (const data of events(response.body)) {
        if (data === "[DONE]") {
          done = true;
          break;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, "The answer failed on the server: " + chunk.error.message);
        if (chunk.usage) timing.usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = choice.delta && choice.delta.content;
          const reasoning = choice.delta && choice.delta.reasoning_content;
          if (piece || reasoning) {
            reply += piece || "";
            thought += reasoning || "";
            timing.chunks += 1;
            timing.last = performance.now();
            timing.first = timing.first || timing.last;
            // One render per frame, however fast the pieces come.
            frame = frame || requestAnimationFrame(() => {
              frame = 0;
              if (thought) renderReasoning(answer, thought, reply !== "");
              renderAnswer(answer, reply);
            });
          }
          if (choice.finish_reason) timing.finish = choice.finish_reason;
        }
      }
      if (!done) throw new ApiError(0, "The answer ended early: the connection closed before the server finished.");
    } catch (err) {
      if (err.name === "AbortError") timing.stopped = true;
      else failure = err;
    } finally {
      if (frame) cancelAnimationFrame(frame);
      if (state.controller === controller) state.controller = null;
      setBusy(false);
    }
    if (conversation !== state.conversation) return; // New chat cleared the page meanwhile
    if (failure && !reply && !thought) {
      question.remove();
      answer.remove();
      el.empty.hidden = el.log.querySelector(".message") !== null;
      if (!el.message.value) el.message.value = text;
      setStatus("");
      throw failure;
    }
    answer.classList.remove("pending");
    if (thought) renderReasoning(answer, thought, reply !== "");
    renderAnswer(answer, reply);
    // The reasoning goes back with the answer: the chat template keeps or drops it.
    const said = thought ? { role: "assistant", content: reply, reasoning_content: thought }
                         : { role: "assistant", content: reply };
    state.history.push({ role: "user", content: text }, said);
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.textContent = statsLine(timing);
    answer.append(meta);
    setStatus(timing.stopped ? "Stopped." : "Done: " + meta.textContent);
    if (failure) showError(failure.message);
  }

  // Runs action; a 401 asks for the key and runs it again with the key given.
  async function withKey(action) {
    try {
      await action();
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) askForKey(err.message, action);
      else showError(err.message);
    }
  }

  function askForKey(reason, retry) {
    const refused = storedKey() !== "";
    storeKey(""); // a refused key is not kept
    state.retry = retry;
    showError(reason);
    el.keyReason.textContent = (refused ? "The server refused the key. " : "This server asks for an API key. ") +
                               "(" + reason + ")";
    el.keyInput.value = "";
    if (!el.keyDialog.open) el.keyDialog.showModal();
    el.keyInput.focus();
  }

  function saveKey() {
    const key = el.keyInput.value.trim();
    if (!key) {
      el.keyInput.focus();
      return;
    }
    storeKey(key);
    el.keyDialog.close();
    clearError();
    const retry = state.retry;
    state.retry = null;
    el.message.focus();
    if (retry) withKey(retry);
  }

  function cancelKey() {
    state.retry = null;
    if (el.keyDialog.open) el.keyDialog.close();
    el.message.focus();
  }

  function send() {
    if (state.controller || el.keyDialog.open) return;
    const text = el.message.value;
    if (!text.trim()) {
      el.message.focus();
      return;
    }
    clearError();
    withKey(() => turn(text));
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  function newChat() {
    stop();
    state.conversation += 1;
    state.history = [];
    el.log.querySelectorAll(".message").forEach((node) => node.remove());
    el.empty.hidden = false;
    clearError();
    setStatus("New chat.");
    el.message.focus();
  }

  async function start() {
    for (;;) {
      try {
        await loadModels();
        setStatus("Ready.");
        return;
      } catch (err) {
        if (err.status === 401) {
          setStatus("This server asks for an API key: the page asks for it when you send.");
          return;
        }
        if (err.status !== 503) {
          showError(err.message);
          return;
        }
        setStatus("Waiting for the server. " + err.message);
        await new Promise((resolve) => setTimeout(resolve, MODELS_RETRY_MS));
      }
    }
  }

  el.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  el.message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.ctrlKey && !event.altKey && !event.metaKey &&
        !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller && !el.keyDialog.open) {
      event.preventDefault();
      stop();
    }
  });
  el.stop.addEventListener("click", stop);
  el.newChat.addEventListener("click", newChat);
  el.setKey.addEventListener("click", () => askForKeyByHand());
  el.keySave.addEventListener("click", saveKey);
  el.keyCancel.addEventListener("click", cancelKey);
  el.keyInput.addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      event.preventDefault();
      saveKey();
    }
  });
  el.keyDialog.addEventListener("cancel", () => { state.retry = null; }); // Escape closes the dialog

  function askForKeyByHand() {
    state.retry = async () => { // the models again, with the new key
      await loadModels();
      setStatus("Ready.");
    };
    el.keyReason.textContent = "The key is sent with every request of this page.";
    el.keyInput.value = "";
    el.keyDialog.showModal();
    el.keyInput.focus();
  }

  start();
})();
