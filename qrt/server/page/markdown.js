// The markdown of model answers, rendered safely: the whole text is HTML-escaped first, so the
// only markup in the result is the markup written here (tags without attributes, except a
// list's numeric start). What it knows: fenced code blocks, inline code, bold and italic,
// bulleted and numbered lists, headings (shown as bold lines) and paragraphs. Links and raw
// HTML stay text. Window global `qrtMarkdown`, used by chat.js.
(function () {
  "use strict";

  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  // \u0000 marks the places of inline code while the emphasis rules run; it is removed from
  // the input so that no text can forge one.
  const HOLE = "\u0000";
  const BULLET = /^\s*[-*+]\s+/;
  const NUMBER = /^\s*(\d{1,9})[.)]\s+/;
  const HEADING = /^\s{0,3}#{1,6}\s+/;
  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;

  function escapeHtml(text) {
    return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // One escaped line (or item) of text: code spans first, so that their asterisks stay
  // asterisks. Emphasis never spans a tag (escaped text holds no "<" of its own), so the tags
  // written here always nest.
  function inline(escaped) {
    const codes = [];
    let out = escaped.replace(/`([^`\n]+)`/g, (_, code) => {
      codes.push(code);
      return HOLE + (codes.length - 1) + HOLE;
    });
    out = out
      .replace(/\*\*(?=\S)([^<]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([^<]*?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*<\n]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=[^\s_])([^_<\n]*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>");
    return out.replace(new RegExp(HOLE + "(\\d+)" + HOLE, "g"), (_, i) => "<code>" + codes[Number(i)] + "</code>");
  }

  function isBlockStart(line) {
    return FENCE.test(line) || BULLET.test(line) || NUMBER.test(line) || HEADING.test(line);
  }

  function render(text) {
    const lines = escapeHtml(String(text).split(HOLE).join("")).split(/\r?\n/);
    const html = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = FENCE.exec(line);
      if (fence) {
        const closing = new RegExp("^\\s{0,3}" + fence[1][0] + "{" + fence[1].length + ",}\\s*$");
        const code = [];
        for (i += 1; i < lines.length && !closing.test(lines[i]); i += 1) code.push(lines[i]);
        i += 1; // the closing fence; while an answer streams, the block runs to the end of the text
        // fence[2] holds only [\w+#.-]: nothing that could leave the element.
        const language = fence[2] ? '<span class="code-language">' + fence[2] + "</span>" : "";
        html.push('<div class="code">' + language + "<pre><code>" + code.join("\n") + "</code></pre></div>");
        continue;
      }
      if (!line.trim()) {
        i += 1;
        continue;
      }
      if (BULLET.test(line) || NUMBER.test(line)) {
        const ordered = !BULLET.test(line);
        const marker = ordered ? NUMBER : BULLET;
        const first = ordered ? Number(NUMBER.exec(line)[1]) : 1;
        const items = [];
        while (i < lines.length && marker.test(lines[i])) {
          let item = lines[i].replace(marker, "");
          // Indented lines that start no block of their own go on the item before them.
          for (i += 1; i < lines.length && /^\s+\S/.test(lines[i]) && !isBlockStart(lines[i]); i += 1) {
            item += "\n" + lines[i].trim();
          }
          items.push("<li>" + inline(item).replace(/\n/g, "<br>") + "</li>");
        }
        const tag = ordered ? "ol" : "ul";
        const start = ordered && first !== 1 ? ' start="' + first + '"' : "";
        html.push("<" + tag + start + ">" + items.join("") + "</" + tag + ">");
        continue;
      }
      if (HEADING.test(line)) {
        html.push('<p class="heading"><strong>' + inline(line.replace(HEADING, "").replace(/\s#+\s*$/, "")) +
                  "</strong></p>");
        i += 1;
        continue;
      }
      const paragraph = [line];
      for (i += 1; i < lines.length && lines[i].trim() && !isBlockStart(lines[i]); i += 1) paragraph.push(lines[i]);
      html.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
    }
    return html.join("");
  }

  window.qrtMarkdown = { render, escapeHtml };
})();
