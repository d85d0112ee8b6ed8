"""`GET /dashboard` (issue 20): the live map in a real headless browser (Debian's chromium driven by
playwright) against a server under load: its figures move, they equal /metrics once the load stops,
a click on a request opens its trace as a waterfall, and a screenshot is saved.

KESTREL_DASHBOARD_SCREENSHOT=PATH saves the screenshot there too (docs/dashboard.png is made so).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from decimal import ROUND_HALF_UP, Decimal

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kestrel.entrypoints.openai.dashboard import snapshot
from kestrel.entrypoints.openai.metrics import ServerMetrics, histogram_quantile
from tests.support.server_process import Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As the workplace's probe starts it: the closed network refuses Google's background connections.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ---- without a browser ----------------------------------------------------------------------------

def test_histogram_quantile_is_prometheus_s():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 4.0)]) == 1.0  # in +Inf: the last bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


class _Stats:
    num_running_reqs, num_waiting_reqs, kv_cache_usage = 3, 2, 0.25


class _Engine:
    """What the metrics and the snapshot read of an engine, for one engine core."""
    config = None
    traces = None
    num_open_requests = 5
    core_stats = [_Stats()]
    core_counters = [{"prompt_tokens": 40, "generation_tokens": 7, "steps": 4, "step_requests": 10,
                      "forward_s": 0.5}]
    core_num_kv_blocks = [64]


def test_the_snapshot_is_the_registry_s_figures():
    metrics = ServerMetrics(_Engine(), "m")
    snap = snapshot(_Engine(), metrics)
    (engine,) = snap["engines"]
    assert (engine["running"], engine["waiting"], engine["kv_usage"]) == (3, 2, 0.25)
    assert (engine["prompt_tokens_total"], engine["generation_tokens_total"], engine["steps_total"]) == (40, 7, 4)
    assert engine["step_requests_total"] == 10 and engine["phase_seconds_total"]["forward"] == 0.5
    assert snap["api_server"]["open_requests"] == 5 and snap["api_server"]["cpu_seconds_total"] > 0
    assert snap["api_server"]["ttft_s"] == {"p50": None, "p90": None, "p99": None, "count": 0.0}


# ---- in the browser -------------------------------------------------------------------------------

def metric_families(server: Server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}


def metric_value(families: dict, name: str, **labels: str) -> float:
    """The sum of a family's samples named `name` that carry `labels`."""
    family = families[name.removesuffix("_total")] if name.endswith("_total") else families[name]
    return sum(s.value for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def quantile_ms(families: dict, name: str, q: float) -> str:
    buckets = [(float(s.labels["le"]), s.value) for s in families[name].samples if s.name == name + "_bucket"]
    # As the page's `toFixed(1)`: the exact binary value rounded, a tie (14.25) upward, where Python's
    # format would round it to even (14.2).
    ms = Decimal(histogram_quantile(q, buckets) * 1000)
    return str(ms.quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


class Load:
    """Streaming completions from `clients` concurrent clients until stopped, in a thread."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients, self.stopping = url, clients, threading.Event()
        self.completed = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self, c: httpx.AsyncClient, i: int) -> None:
        while not self.stopping.is_set():
            body = {"prompt": f"Request {i}: once upon a time", "max_tokens": 24 + 8 * i, "ignore_eos": True,
                    "stream": True}
            async with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    pass
            self.completed += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(self._client(c, i) for i in range(self.clients)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


def figure(page, key: str) -> str:
    return page.locator(f'[data-metric="{key}"]').first.text_content()


def wait_for(predicate, timeout_s: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium")   # `make browser` installs it (as root, with apt-get)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_live_map_moves_matches_metrics_and_opens_a_trace(browser, tmp_path):
    from tests.support.parity import save_tiny_llama
    save_tiny_llama(tmp_path / "model")
    server = Server("--model", str(tmp_path / "model"), "--dtype", "float32", "--max-model-len", "512",
                    "--kv-cache-memory", "16MiB", "--request-trace-buffer", "100")
    try:
        server.wait_ready()
        run_the_page(browser, server, tmp_path / "dashboard.png")
    finally:
        server.stop()


def run_the_page(browser, server: Server, screenshot: os.PathLike) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.url}/dashboard")
    wait_for(lambda: figure(page, "e0.running") != "–", what="the first snapshot")
    assert page.locator("#status").inner_text().startswith("live")
    # Boxes of the map: the API server, the engine core with its scheduler and KV-cache manager, the
    # worker with its model runner and sampler.
    for title in ("API server", "Engine core 0", "Scheduler", "KV-cache manager", "Worker", "Model runner", "Sampler"):
        assert page.locator("#map text", has_text=title).count() >= 1, title

    with Load(server.url, clients=4) as load:
        wait_for(lambda: load.completed >= 2, what="requests under load")
        before = int(figure(page, "e0.generation_tokens_total"))
        time.sleep(2)
        after = int(figure(page, "e0.generation_tokens_total"))
        assert after > before
        assert float(figure(page, "api.tokens_out_per_s")) > 0
        assert float(figure(page, "e0.steps_per_s")) > 0
        assert float(figure(page, "e0.batch")) >= 1
        assert float(figure(page, "e0.forward_ms")) > 0
        assert int(figure(page, "e0.running")) >= 1
        assert int(figure(page, "e0.kv_blocks_used")) >= 1

    # Idle: the page's figures are /metrics' (the page updates twice a second).
    wait_for(lambda: metric_value(metric_families(server), "kestrel:num_requests_running") == 0, what="idle")
    time.sleep(1.5)
    families = metric_families(server)
    for key, name in [("e0.generation_tokens_total", "kestrel:generation_tokens_total"),
                      ("e0.prompt_tokens_total", "kestrel:prompt_tokens_total"),
                      ("e0.preemptions_total", "kestrel:num_preemptions_total"),
                      ("e0.running", "kestrel:num_requests_running"),
                      ("e0.waiting", "kestrel:num_requests_waiting"),
                      ("api.requests_finished_total", "kestrel:request_success_total")]:
        assert int(figure(page, key)) == round(metric_value(families, name)), key
    for state in ("used", "free"):
        assert int(figure(page, f"e0.kv_blocks_{state}")) == metric_value(families, "kestrel:kv_cache_blocks",
                                                                         state=state)
    ttft = figure(page, "api.ttft").split(" / ")
    assert ttft == [quantile_ms(families, "kestrel:time_to_first_token_seconds", q) for q in (0.5, 0.99)]

    # A click on a request opens its trace, a lane per box.
    row = page.locator("#requests tbody tr").first
    wait_for(lambda: row.count() == 1, what="the request list")
    request_id = row.get_attribute("data-id")
    row.click()
    page.wait_for_selector('#waterfall rect[data-lane="model_runner"]')
    assert page.locator("#trace-id").text_content() == request_id
    for lane in ("api_server", "scheduler", "model_runner", "sampler"):
        assert page.locator(f'#waterfall rect[data-lane="{lane}"]').count() >= 1, lane
    assert "model_runner" in page.locator("#trace-boxes").inner_text()

    page.screenshot(path=str(screenshot), full_page=True)
    assert os.path.getsize(screenshot) > 10_000
    if os.environ.get("KESTREL_DASHBOARD_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["KESTREL_DASHBOARD_SCREENSHOT"])
    assert not errors, errors
    page.close()
