"""The Playground (`/playground/`) and `GET /status`.

Over HTTP (always run): the assets, their headers and the no-CDN rule; the status object; the API key
guarding /status and not the static files.

In a real browser (Debian's `chromium` + `chromium-driver` through selenium, headless; skipped, and so
reported by pytest -ra, where they are not installed): the page loads with no console errors, a chat
message streams a reply whose timings appear beside it, Stop aborts a reply (the server counts the
abort), the Monitor's figures change after a request, and a server with an API key gets the key from
the page's dialog. Each view is saved as a PNG screenshot under the test's tmp folder, and to
docs/img/ when IGNIS_UPDATE_SCREENSHOTS=1 (the images the docs show).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import re
import shutil
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import Running, serve
from starlette.middleware import Middleware
from toy_model import ToySource

from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server import ServerOptions
from ignis.runtime.server.playground import ASSETS, PlaygroundAssets

ROOT = Path(__file__).resolve().parents[3]
STATIC = ROOT / "runtime" / "server" / "playground" / "static"
KEY = "sk-playground-test"


# ---------------------------------------------------------------------------------------- helpers


class _BearerCheck:
    """Stands in for the server's API-key middleware on a branch without `--api-key`: 401 unless
    `Authorization: Bearer KEY`, every path but /health (the server's rule)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        auth = dict(scope.get("headers", ())).get(b"authorization", b"")
        if auth == b"Bearer " + self.key:
            await self.app(scope, receive, send)
            return
        body = (
            b'{"error":{"message":"invalid API key","type":"invalid_request_error","code":"invalid_api_key"}}'
        )
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serve_with_key(**options: Any) -> Iterator[Running]:
    """A server requiring KEY: the server's own `api_key` option where it has one, else `_BearerCheck`
    put just inside the Playground's asset layer (where the server's key check sits)."""
    if "api_key" in ServerOptions.__dataclass_fields__:
        with serve(api_key=KEY, **options) as running:
            yield running
        return
    import ignis.runtime.server.runner as runner

    make = runner.create_app

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = make(*args, **kwargs)
        outer = [i for i, m in enumerate(app.user_middleware) if m.cls is PlaygroundAssets]
        assert outer == [0], "the asset layer must be the outermost middleware"
        app.user_middleware.insert(1, Middleware(_BearerCheck, api_key=KEY))
        return app

    runner.create_app = create_app
    try:
        with serve(**options) as running:
            yield running
    finally:
        runner.create_app = make


def _chat(client: httpx.Client, text: str = "hello", max_tokens: int = 12) -> dict[str, Any]:
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------- over HTTP


def test_page_and_assets(client: httpx.Client) -> None:
    r = client.get("/playground")
    assert r.status_code == 308 and r.headers["location"] == "/playground/"
    page = client.get("/playground/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["cache-control"] == "no-cache"
    # Every file the page loads is one of the package's assets, by a relative URL.
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(refs) == ["favicon.svg", "playground.css", "playground.js"]
    for name, media in ASSETS.items():
        got = client.get(f"/playground/{name}")
        assert got.status_code == 200, name
        assert got.headers["content-type"] == media
        assert got.content == (STATIC / name).read_bytes()
        assert int(got.headers["content-length"]) == len(got.content)
    head = client.head("/playground/playground.js")
    assert head.status_code == 200 and head.content == b""
    again = client.get("/playground/", headers={"If-None-Match": page.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


def test_nothing_else_is_served_from_the_package(client: httpx.Client) -> None:
    for path in (
        "/playground/__init__.py",
        "/playground/static/index.html",
        "/playground/%2e%2e/metrics",
        "/playgroundx",
    ):
        r = client.get(path)
        assert r.status_code == 404, (path, r.status_code)
        assert r.json()["error"]["type"] == "not_found_error"
    r = client.post("/playground/", json={})
    assert r.status_code in (404, 405) and "error" in r.json()


def test_assets_use_no_cdn_and_only_the_api() -> None:
    """No URL to another origin in any asset (the SVG namespace is a name, not a fetch); the script
    fetches only the API's own endpoints."""
    for name in ASSETS:
        text = (STATIC / name).read_text()
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)
    script = (STATIC / "playground.js").read_text()
    fetched = set(re.findall(r'"\.\./([^"]+)"', script))
    assert fetched == {"v1/chat/completions", "metrics", "status"}


def test_every_asset_is_package_data() -> None:
    """A wheel holds the files the page is made of (pyproject's package-data covers each)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["ignis.runtime.server.playground"]
    for name in ASSETS:
        assert any(fnmatch.fnmatch(f"static/{name}", g) for g in globs), name
    assert sorted(p.name for p in STATIC.iterdir()) == sorted(ASSETS)  # no file left unserved


def test_status(server: Running, client: httpx.Client) -> None:
    r = client.get("/status")
    assert r.status_code == 200
    s = r.json()
    assert s["model"] == server.server.model.name
    assert s["speculative"] == {
        "backend": "dflash2",
        "draft_tokens": 3,
        "draft_rows": 0,
        "draft_head": "full",
    }
    assert s["lanes"]["max"] == 8 and s["lanes"]["queue_size"] == 16
    assert s["lanes"]["active"] == 0 and s["lanes"]["waiting"] == 0
    assert s["lanes"]["engine_restarts"] == 0
    assert s["max_context"] == server.server.lanes.max_context
    assert s["gpu"] is None  # the toy model runs on the CPU: no CUDA context, none created by /status
    assert s["uptime_s"] > 0 and abs(s["started"] - time.time()) < 3600
    time.sleep(0.05)
    assert client.get("/status").json()["uptime_s"] > s["uptime_s"]
    assert "/status" in client.get("/openapi.json").json()["paths"]


def test_status_counts_busy_lanes_and_queued_requests() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "stream": True,
        "ignore_eos": True,
    }
    with serve(ToySource(step_delay=0.2), lanes=1, queue_size=2) as running, running.client() as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as first:
            next(first.iter_lines())  # decoding
            with running.client() as c2, c2.stream("POST", "/v1/chat/completions", json=body) as second:
                assert second.status_code == 200
                deadline = time.monotonic() + 10
                lanes = c.get("/status").json()["lanes"]
                while lanes["waiting"] != 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
                    lanes = c.get("/status").json()["lanes"]
                assert (lanes["active"], lanes["waiting"]) == (1, 1)
        deadline = time.monotonic() + 10
        while c.get("/status").json()["lanes"]["active"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.get("/status").json()["lanes"] == {
            "max": 1,
            "active": 0,
            "waiting": 0,
            "queue_size": 2,
            "engine_restarts": 0,
        }


def test_status_of_a_server_without_speculation() -> None:
    with serve(spec=SpecDefaults(backend="off"), lanes=2, queue_size=3) as running, running.client() as c:
        s = c.get("/status").json()
        assert s["speculative"]["backend"] == "off" and s["speculative"]["draft_tokens"] == 0
        assert s["lanes"]["max"] == 2 and s["lanes"]["queue_size"] == 3


def test_api_key_guards_status_but_not_the_page() -> None:
    with serve_with_key() as running, running.client() as c:
        assert c.get("/status").status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.get("/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = c.get("/status", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["model"]
        assert c.get("/health").status_code == 200
        # The static files hold no data: a browser must be able to load the page that asks for the key.
        assert c.get("/playground/").status_code == 200
        assert c.get("/playground/playground.js").status_code == 200


def test_the_start_up_log_names_the_playground(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ignis.runtime.server")
    with serve(port=0) as running, running.client() as c:
        host, port = running.server.tcp_address or ("", 0)
        url = f"http://{host}:{port}/playground/"
        assert any(url in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert httpx.get(url, timeout=10).status_code == 200  # the address logged serves the page
        assert c.get("/playground/").status_code == 200  # and over the Unix socket (a local proxy's way)


@pytest.mark.gpu
def test_status_reports_gpu_memory() -> None:
    """The figures are of the device the process holds memory on (the last one here), read from
    another thread (a request handler's thread sits on device 0)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ignis.runtime.server.status import gpu_memory

    device = torch.cuda.device_count() - 1
    x = torch.empty(64 << 20, dtype=torch.uint8, device=f"cuda:{device}")
    with ThreadPoolExecutor(1) as pool:
        g = pool.submit(gpu_memory).result()
    assert g is not None and g["index"] == device
    assert g["allocated_bytes"] >= x.numel() and g["reserved_bytes"] >= g["allocated_bytes"]
    assert g["peak_allocated_bytes"] >= g["allocated_bytes"]
    assert g["allocated_bytes"] <= g["used_bytes"] <= g["total_bytes"] and g["name"]
    del x


# ---------------------------------------------------------------------------------------- in a browser

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_DRIVER = shutil.which("chromedriver")
_NO_BROWSER = (
    "Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)"
    if not (_CHROMIUM and _DRIVER)
    else None
)
browser = pytest.mark.skipif(_NO_BROWSER is not None, reason=_NO_BROWSER or "")


@pytest.fixture(scope="module")
def chrome(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if _NO_BROWSER is not None:
        pytest.skip(_NO_BROWSER)
    webdriver = pytest.importorskip("selenium.webdriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = _CHROMIUM
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=_DRIVER)
    drv = webdriver.Chrome(options=opts, service=service)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture
def driver(chrome: Any) -> Iterator[Any]:
    """The browser for one test: its console log starts empty, and its page is left for a blank one
    after (a page left open would keep polling a server that a later test has stopped)."""
    chrome.get("about:blank")
    chrome.get_log("browser")
    yield chrome
    chrome.get("about:blank")


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[Running]:
    """A server on a loopback TCP port (the browser's way in); the toy steps slowed a little so a
    reply streams over several polls of the Monitor."""
    with serve(ToySource(step_delay=0.01), lanes=4, queue_size=8, port=0) as running:
        yield running


def _url(running: Running, path: str = "/playground/") -> str:
    addr = running.server.tcp_address
    assert addr is not None
    return f"http://{addr[0]}:{addr[1]}{path}"


def _wait(drv: Any, condition: Any, timeout: float = 30.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout, poll_frequency=0.05).until(condition)


def _severe(drv: Any) -> list[dict[str, Any]]:
    return [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]


def _screenshot(drv: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    assert drv.save_screenshot(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    if os.environ.get("IGNIS_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(path, ROOT / "docs" / "img" / name)
    return path


def _text(drv: Any, element_id: str) -> str:
    return str(drv.execute_script(f"return document.getElementById('{element_id}').textContent"))


def _send(drv: Any, text: str) -> Any:
    from selenium.webdriver.common.by import By

    before = len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = drv.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    drv.find_element(By.ID, "send").click()
    _wait(drv, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before)
    return drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def _set(drv: Any, field: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    box = drv.find_element(By.ID, f"set-{field}")
    box.clear()
    box.send_keys(value)


@browser
def test_page_loads_without_console_errors(driver: Any, tcp_server: Running) -> None:
    driver.get(_url(tcp_server))
    _wait(driver, lambda d: _text(d, "model-name") == tcp_server.server.model.name)
    assert _text(driver, "spec-badge") == "dflash2 × 3"
    assert "draft tokens" in _text(driver, "spec-info")
    time.sleep(1.5)  # a few polls of /metrics and /status
    assert driver.execute_script("return document.getElementById('conn').className") == "dot ok"
    assert _severe(driver) == []


@browser
def test_chat_streams_a_reply_with_timings(driver: Any, tcp_server: Running, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    driver.get(_url(tcp_server) + "#chat")
    _wait(driver, lambda d: _text(d, "model-name") == tcp_server.server.model.name)
    _set(driver, "temperature", "0")
    _set(driver, "max_tokens", "40")
    _set(driver, "system", "you are a toy.")
    reply = _send(driver, "hello there")
    _wait(driver, lambda d: reply.get_attribute("data-done") == "1")
    text = reply.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")

    # The same conversation, greedy, over the API gives the same text.
    with tcp_server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "system", "content": "you are a toy."},
                    {"role": "user", "content": "hello there"},
                ],
                "max_tokens": 40,
                "temperature": 0,
                "top_p": 1,
                "top_k": 0,
            },
        ).json()
    assert text == r["choices"][0]["message"]["content"]

    def timing(key: str) -> str:
        return str(reply.find_element(By.CSS_SELECTOR, f'.timings [data-k="{key}"] b').text)

    assert re.fullmatch(r"[\d.]+ (ms|s)", timing("ttft"))
    assert float(timing("tps")) > 0
    assert timing("tokens") == str(r["usage"]["completion_tokens"])
    assert timing("prompt").split()[0] == str(r["usage"]["prompt_tokens"])
    # The toy drafter is the target itself: every greedy draft is accepted, 4 tokens a full round.
    tpr = float(timing("tpr").lstrip("≈"))
    assert 1.0 < tpr <= 4.0
    assert timing("accept").startswith("100/100/100")
    assert len(reply.find_elements(By.CSS_SELECTOR, '.timings [data-k="accept"] svg rect')) == 6
    assert timing("finish") == r["choices"][0]["finish_reason"]
    line = reply.find_element(By.CSS_SELECTOR, ".timings .settings-line").text
    assert "temperature 0" in line and "max_tokens 40" in line and "dflash2 × 3" in line
    assert _severe(driver) == []
    _screenshot(driver, tmp_path, "playground-chat.png")


@browser
def test_stop_aborts_the_reply(driver: Any) -> None:
    from selenium.webdriver.common.by import By

    with serve(ToySource(step_delay=0.05), lanes=2, queue_size=2, port=0) as slow, slow.client() as c:
        driver.get(_url(slow))
        _wait(driver, lambda d: _text(d, "model-name") == slow.server.model.name)
        _set(driver, "max_tokens", "200")
        _set(driver, "temperature", "0")
        reply = _send(driver, "tell me a long story")
        _wait(driver, lambda d: len(reply.find_element(By.CSS_SELECTOR, ".text").text) >= 3)
        # Streamed: text shows while the reply is still running (200 tokens take seconds here).
        assert reply.get_attribute("data-done") is None
        assert "streaming" in reply.get_attribute("class")
        partial = reply.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")
        driver.find_element(By.ID, "stop").click()
        _wait(driver, lambda d: reply.get_attribute("data-done") == "1")
        finish = reply.find_element(By.CSS_SELECTOR, '.timings [data-k="finish"] b').text
        kept = reply.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")
        assert kept.startswith(partial) and len(kept) < 200  # the reply is cut, what came is kept
        assert finish.startswith("stopped")
        assert driver.find_element(By.ID, "send").is_enabled()
        assert not driver.find_element(By.ID, "stop").is_enabled()

        def aborted() -> bool:
            text = c.get("/metrics").text
            return 'ignis_request_finished_total{finish_reason="abort"} 1.0' in text

        deadline = time.monotonic() + 10
        while not aborted() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted(), "the server did not abort the lane"
        assert c.get("/status").json()["lanes"]["active"] == 0


@browser
def test_monitor_figures_change_after_a_request(driver: Any, tcp_server: Running, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    driver.get(_url(tcp_server) + "#monitor")
    _wait(driver, lambda d: _text(d, "mon-lanes") == "0 / 4")
    time.sleep(1.2)
    before = {k: _text(driver, k) for k in ("mon-gen", "mon-rounds-total", "mon-requests", "mon-tpr")}

    def traffic(lane: int) -> None:  # three lanes at once, three requests each
        with tcp_server.client() as c:
            for text in ("one", "two more words", "three"):
                _chat(c, f"{text} {lane}", max_tokens=60)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(traffic, range(3)))
    with tcp_server.client() as c:
        generated = re.search(r"^ignis_generation_tokens_total (\S+)$", c.get("/metrics").text, re.M)
    assert generated is not None
    total = f"{int(float(generated.group(1)))} tokens in all"
    _wait(driver, lambda d: _text(d, "mon-gen") == total, timeout=10)  # a poll after the last request
    assert _text(driver, "mon-rounds-total") != before["mon-rounds-total"]
    assert _text(driver, "mon-requests") != before["mon-requests"]
    assert 1.0 < float(_text(driver, "mon-tpr")) <= 4.0
    # The plots have drawn something: the throughput plot's pixels are not all blank.
    painted = driver.execute_script(
        "const c = document.getElementById('plot-accept');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;"
    )
    assert painted > 500
    title = driver.find_element(By.ID, "plot-accept").get_attribute("title")
    assert title.splitlines()[0].startswith("position 0: 100.0 % of ")
    assert len(title.splitlines()) == 3  # one bar per draft position
    assert _text(driver, "mon-gpu") == "no CUDA device in use"
    assert re.fullmatch(r"[\d.]+ (ms|s)", _text(driver, "mon-ttft"))
    assert re.match(
        r"TTFT p50 \(p95 [\d.]+ (ms|s)\); inter-token p50 [\d.]+ (ms|s), p95", _text(driver, "mon-itl")
    )
    with tcp_server.client() as c:
        exposition = c.get("/metrics").text
    caches = _text(driver, "mon-caches")
    if "ignis_prompt_checkpoint_" in exposition:
        assert caches.startswith("Prompt checkpoints")
    else:
        assert caches == "No prefix-cache or expert-cache metrics on this server."
    assert _severe(driver) == []
    _screenshot(driver, tmp_path, "playground-monitor.png")


@browser
def test_page_asks_for_the_api_key(driver: Any) -> None:
    from selenium.webdriver.common.by import By

    with serve_with_key(port=0) as running:
        driver.get(_url(running))
        driver.execute_script("sessionStorage.clear(); localStorage.clear();")  # no key of an earlier server
        driver.refresh()
        dialog = driver.find_element(By.ID, "key-dialog")
        _wait(driver, lambda d: dialog.get_attribute("open") is not None)
        assert _text(driver, "model-name") == "…"  # nothing was read without the key
        # Dismissed, the dialog stays closed while the page keeps polling; the header button reopens it.
        driver.find_element(By.ID, "key-cancel").click()
        time.sleep(2.5)
        assert dialog.get_attribute("open") is None
        assert driver.execute_script("return document.getElementById('conn').className") == "dot bad"
        driver.find_element(By.ID, "key-button").click()
        _wait(driver, lambda d: dialog.get_attribute("open") is not None)
        driver.find_element(By.ID, "key-cancel").click()
        # Sending without the key opens the dialog again and gives the message back.
        driver.find_element(By.ID, "prompt").send_keys("hi")
        driver.find_element(By.ID, "send").click()
        _wait(driver, lambda d: dialog.get_attribute("open") is not None)
        assert driver.find_element(By.ID, "prompt").get_attribute("value") == "hi"
        assert driver.find_elements(By.CSS_SELECTOR, ".msg") == []
        driver.find_element(By.ID, "key-input").send_keys(KEY)
        driver.find_element(By.ID, "key-save").click()
        _wait(driver, lambda d: _text(d, "model-name") == running.server.model.name)
        _set(driver, "max_tokens", "8")
        driver.find_element(By.ID, "send").click()  # the message given back
        reply = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))[0]
        _wait(driver, lambda d: reply.get_attribute("data-done") == "1")
        assert reply.find_element(By.CSS_SELECTOR, '.timings [data-k="tokens"] b').text == "8"
        # The key lives in this tab's session storage only (the "remember" box was not ticked).
        assert driver.execute_script("return localStorage.getItem('ignis.playground.apiKey')") is None
        driver.execute_script("sessionStorage.clear();")


@browser
def test_a_refused_request_shows_the_servers_message(driver: Any, tcp_server: Running) -> None:
    from selenium.webdriver.common.by import By

    driver.get(_url(tcp_server) + "#chat")
    _wait(driver, lambda d: _text(d, "model-name") == tcp_server.server.model.name)
    context = tcp_server.server.lanes.max_context
    assert context is not None
    _set(driver, "max_tokens", str(context + 1))
    box = driver.find_element(By.ID, "prompt")
    box.send_keys("too long an answer")
    driver.find_element(By.ID, "send").click()
    error = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))[0]
    message = error.find_element(By.CSS_SELECTOR, ".text").text
    assert message.startswith(f"this model's maximum context length is {context} tokens")
    # The message is given back to edit, and is not left in the conversation.
    assert driver.find_element(By.ID, "prompt").get_attribute("value") == "too long an answer"
    assert driver.find_elements(By.CSS_SELECTOR, ".msg.user") == []
    assert driver.find_element(By.ID, "send").is_enabled()
    # The browser reports the 400 itself; nothing else went wrong on the page.
    severe = _severe(driver)
    assert all("status of 400" in e["message"] for e in severe), severe


class _ExpertCacheCollector:
    """Expert-cache figures as a server with one would export them (the Monitor shows any
    `ignis_expert_cache_*` family, with a hit rate from hits and lookups)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily("ignis_expert_cache_lookups", "Expert lookups.", value=400)
        yield CounterMetricFamily(
            "ignis_expert_cache_hits", "Expert lookups served from the cache.", value=300
        )
        yield GaugeMetricFamily("ignis_expert_cache_bytes", "Bytes the cache holds.", value=3 * 2**30)


@browser
def test_monitor_shows_cache_figures_where_present(driver: Any) -> None:
    with serve(port=0) as running:
        running.server.metrics.registry.register(_ExpertCacheCollector())
        driver.get(_url(running) + "#monitor")
        _wait(driver, lambda d: "Expert cache" in _text(d, "mon-caches"))
        rows = driver.execute_script(
            "return [...document.querySelectorAll('#mon-caches tr')].map(r => r.textContent)"
        )
        assert rows == ["hit rate75.0 %", "lookups400", "hits300", "bytes3.0 GiB"]
        assert _severe(driver) == []
