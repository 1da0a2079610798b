"""The chat page: `GET /` serves static/index.html, `/static/...` its script and style. Plain files shipped
inside the package (package data in pyproject.toml), no build step, nothing fetched from another site, so
the page works offline; it talks to the server's own /v1/models and /v1/chat/completions."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"

# The page runs its own files only: no inline script or handler, nothing from elsewhere. A reply's
# markdown is escaped by the renderer (static/markdown.js); this is the second line if that ever fails.
CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")


async def index():
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                                        "Cache-Control": "no-cache"})


def mount_page(app: FastAPI) -> None:
    app.add_api_route("/", index, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
