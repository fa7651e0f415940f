"""/docs in a real browser with the network off (tests/browser.py): Swagger UI must
come from the edge itself and render the API, as on an air-gapped cluster. The
edge runs under uvicorn in-process; /docs needs no backend. One Chromium start
per test."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import uvicorn
from fastapi.openapi.docs import get_swagger_ui_html
from PIL import Image

from services.http_edge import openapi
from tests.browser import dump_dom, needs_chromium, screenshot
from tests.integration.test_http_edge import edge_app, serving

pytestmark = needs_chromium
# Each operation Swagger UI renders: `<div class="opblock opblock-post" id="operations-…">`,
# then its summary, `<span class="opblock-summary-path" data-path="/v1/chat/completions">`.
OPERATION = re.compile(r'<div class="opblock opblock-(\w+)[^"]*" id="operations-[^"]*">.*?data-path="([^"]+)"',
                       re.DOTALL)
CDN_PAGE = "/cdn-docs"  # the page as it was: FastAPI's default, its assets on a CDN


@dataclass
class Rendered:
    dom: str
    outside: list[str]  # what the page asked for beyond loopback, all refused
    served: list[str]  # the edge's access log: "GET /docs 200", …

    @property
    def operations(self) -> list[tuple[str, str]]:
        return [(method.upper(), path) for method, path in OPERATION.findall(self.dom)]


def render(path: str, caplog: pytest.LogCaptureFixture, browse: Callable[..., object] = dump_dom) -> Rendered:
    async def scenario() -> Rendered:
        app = edge_app(1)  # its tokenizer address: a port nothing listens on

        @app.get(CDN_PAGE, include_in_schema=False)
        async def cdn_page():
            return get_swagger_ui_html(openapi_url=openapi.OPENAPI_URL, title="as it was")

        server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_config=None, timeout_graceful_shutdown=1))
        outside: list[str] = []
        with caplog.at_level("INFO", logger="stormserve.access"):
            async with serving(server) as port:
                # In a thread: the edge answers the browser from this event loop.
                dom = await asyncio.to_thread(browse, f"http://127.0.0.1:{port}{path}", outside=outside)
        served = [f"{r.fields['method']} {r.fields['path']} {r.fields['status']}"
                  for r in caplog.records if r.name == "stormserve.access"]
        return Rendered(dom if isinstance(dom, str) else "", outside, served)

    return asyncio.run(asyncio.wait_for(scenario(), timeout=90))


def test_docs_page_renders_the_api_with_no_network(caplog) -> None:
    page = render("/docs", caplog)
    assert ("POST", "/v1/chat/completions") in page.operations, page.dom[-2000:]
    assert ("GET", "/v1/models") in page.operations
    assert page.outside == []
    # Everything the page loaded came from the edge.
    assets = openapi.ASSETS_URL
    assert {"GET /docs 200", f"GET {assets}/swagger-ui-bundle.js 200", f"GET {assets}/swagger-ui.css 200",
            f"GET {openapi.OPENAPI_URL} 200"} <= set(page.served)
    assert all(" 200" in line for line in page.served), page.served


def test_the_network_is_really_off_for_a_cdn_page(caplog) -> None:
    """The control: the same browser flags leave the old CDN page blank, its CDN refused."""
    page = render(CDN_PAGE, caplog)
    assert page.operations == []
    assert any(target.startswith("cdn.jsdelivr.net") for target in page.outside), page.outside
    assert page.served == [f"GET {CDN_PAGE} 200"]  # its script never loaded, so neither did /openapi.json


def test_screenshot_of_the_docs_page(caplog, tmp_path) -> None:
    png = tmp_path / "docs.png"
    page = render("/docs", caplog, browse=partial(screenshot, path=png, width=1024, height=768))
    image = Image.open(png)
    assert image.size == (1024, 768)
    # Rendered, not blank: Swagger UI's green POST and blue GET bars are on the first screen.
    colors = {color for _, color in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (73, 204, 144) in colors and (97, 175, 254) in colors
    assert page.outside == []
