"""The chat page at `/` (sharpi serve's web UI, as llama-server ships one): plain HTML, JavaScript and CSS from
sharpi/serve/static, no build step, nothing fetched from anywhere but this server.

What it does (static/app.js): streams chat completions (/v1/chat/completions, stream: true); takes a pasted
document, which goes first in every question's messages with `compress` (the chosen scorer and budget), so the
server compresses it once and every question reuses the compressed prefix; shows the KV memory the compressed
document holds against the uncompressed one and the compression's ratio; and shades each of the document's tokens
by the share of (layer, KV head) slots that kept it (/v1/compress/shares). When the server answers 401 it asks for
the API key, kept in the tab's sessionStorage and sent as `Authorization: Bearer`.

Served: GET / (index.html), /static/app.js and /static/style.css, and nothing else (any other path is the API's
404). The page holds no data, so it needs no key (the API calls it makes do). Every response carries a
Content-Security-Policy that allows only this origin's script, style and fetches (no inline script or style, no
frames of it, no form sent anywhere, no <base>), nosniff and no referrer; app.js writes every model and user text
with textContent, never as HTML.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/static/style.css": ("style.css", "text/css; charset=utf-8")}


def install_page(app: FastAPI) -> None:
    """Add the page's routes to `app` (the files read once, here)."""
    static = resources.files(__package__) / "static"
    for path, (name, media_type) in FILES.items():
        _serve(app, path, (static / name).read_bytes(), media_type)


def _serve(app: FastAPI, path: str, content: bytes, media_type: str) -> None:
    async def page_file() -> Response:
        return Response(content, media_type=media_type, headers=HEADERS)
    app.add_api_route(path, page_file, methods=["GET"], include_in_schema=False)
