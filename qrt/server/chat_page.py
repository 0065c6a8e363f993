"""The chat page at GET /: one HTML page with its script and style sheet, shipped in
qrt/server/page and served by qrt itself, so a browser pointed at `qrt serve` (or at the front of
`qrt serve --replicas N`) can talk to the model with nothing fetched from anywhere else.

The page holds no data and asks for none, so it is open without the API key; the page itself
sends the key (which the user types in) with its /v1 requests."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

PAGE_DIR = Path(__file__).with_name("page")
# The page's files by their URL path, with their content types.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/chat/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/chat/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/chat/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
# Belt and braces over "the page has no external URLs": the browser itself refuses to load or
# send anything to another origin, and model output cannot run script even if the markdown
# renderer let some HTML through.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-cache"}


def add_chat_page(app: FastAPI) -> None:
    """Serve the page's files on `app`. Call it before any catch-all route (the replica router
    forwards every other path), so that these paths are answered here."""
    for url_path, (name, media_type) in FILES.items():
        body = (PAGE_DIR / name).read_bytes()  # a few kB each: read once, when the app is made
        app.add_api_route(url_path, _answer(body, media_type), methods=["GET"], include_in_schema=False)


def _answer(body: bytes, media_type: str):
    async def page_file():
        return Response(body, media_type=media_type, headers=HEADERS)
    return page_file
