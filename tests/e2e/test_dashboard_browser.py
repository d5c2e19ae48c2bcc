"""The dashboard in a real browser: headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium) on a running tiny-model server with an API key.

The page asks for the key (a wrong one is refused), takes it from the URL fragment, and
shows the pool; an n=3 request's prompt blocks show as shared cells (hovering one names
the request and its 3 references) and its three sequences as rows; once the request
ends every cell is free or cached. Screenshots go to the test's temporary directory.
Skips, saying why, only where no Chromium or chromedriver can be found (`make test`
installs them as root with apt).
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, get

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no Chromium / chromedriver found: `make test` installs Debian's chromium and chromium-driver when "
           "run as root (apt-get install chromium chromium-driver)",
)

KEY = "dashboard-key"
NUM_BLOCKS = 96
BLOCK_SIZE = 16
PROMPT = " ".join(f"word{i % 7}" for i in range(60))  # several full blocks, shared by the 3 samples


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--api-key", KEY,
             "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("dashboard"), extra, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1100", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str, timeout_s: float = 15.0):
    """Poll `condition(driver)` until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition(driver)
        if value:
            return value
        if time.monotonic() > deadline:
            status = driver.find_element("id", "status-text").text
            raise AssertionError(f"page never showed {what} (status: {status!r})")
        time.sleep(0.05)


def counts(driver) -> dict[str, int]:
    """The legend's block counts of the first engine panel, as the page shows them (read in
    one script, so all from the same update)."""
    texts = driver.execute_script("""
        const out = {};
        for (const b of document.querySelectorAll("section.engine .legend b[data-count]")) {
          out[b.dataset.count] = b.textContent;
        }
        return out;""")
    return {name: int(text.replace(",", "")) for name, text in texts.items()}


class StreamedRequest(threading.Thread):
    """A streaming n=3 completion, read in the background until it ends or `stop()` drops it."""

    def __init__(self, server: ServerProcess, body: dict):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        self.body = body
        self.request_id: str | None = None
        self.error: str | None = None
        self.finished: set[int] = set()
        self.ended = threading.Event()
        self._stop = threading.Event()

    def run(self) -> None:
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(self.body),
                              {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            resp = self.conn.getresponse()
            if resp.status != 200:
                self.error = resp.read().decode()
                return
            while not self._stop.is_set():
                line = resp.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    self.request_id = chunk["id"]
                    for choice in chunk["choices"]:
                        if choice.get("finish_reason"):
                            self.finished.add(choice["index"])
        finally:
            self.conn.close()  # an unfinished request is aborted by the gateway
            self.ended.set()

    def stop(self) -> None:
        self._stop.set()


def test_the_dashboard_shows_shared_blocks_rows_and_a_pool_left_free_or_cached(server, browser, tmp_path: Path):
    from selenium.webdriver.common.action_chains import ActionChains

    status, body = get(server.url + "/dashboard/stream")
    assert status == 401 and "invalid_api_key" in body  # the data needs the key; the page does not
    assert get(server.url + "/dashboard")[0] == 200

    browser.get(server.url + "/dashboard")
    wait_for(browser, lambda d: d.find_element("id", "keyform").is_displayed(), "the API key form")
    browser.find_element("id", "key").send_keys("not-the-key\n")
    wait_for(browser, lambda d: d.find_element("id", "status-text").text == "wrong API key", "a refused key")

    browser.get(server.url + "/dashboard#key=" + KEY)
    wait_for(browser, lambda d: counts(d).get("free") == NUM_BLOCKS, "an idle, free pool")
    assert not browser.find_element("id", "keyform").is_displayed()
    title = browser.find_element("css selector", "section.engine .title").text
    assert f"{NUM_BLOCKS} blocks × {BLOCK_SIZE} tokens" in title and "paged" in title

    request = StreamedRequest(server, {
        "model": "tiny-llama", "prompt": PROMPT, "n": 3, "max_tokens": 360, "temperature": 1.0, "seed": 7,
        "ignore_eos": True, "stream": True})
    request.start()
    try:
        wait_for(browser, lambda d: request.error or (request.request_id and counts(d).get("shared", 0) >= 2),
                 "shared blocks")
        assert request.error is None, request.error
        rows = wait_for(browser, lambda d: len(d.find_elements(
            "css selector", f'tr[data-request-id="{request.request_id}"]')) == 3 and d.find_elements(
            "css selector", f'tr[data-request-id="{request.request_id}"]'), "the request's three rows")
        assert sorted(r.get_attribute("data-seq") for r in rows) == ["0", "1", "2"]
        assert {r.get_attribute("data-status") for r in rows} <= {"running", "waiting"}

        # hover a shared cell: the tooltip names the request and its three holders
        shared = browser.execute_script("""
            const panel = [...window.pagedserveDashboard.engines.values()][0];
            document.querySelector('canvas.pool').scrollIntoView({block: 'center'});
            const b = panel.snap.states.findIndex((s) => s === 2);
            const c = window.pagedserveDashboard.cellCenter(b);
            return [b, Math.round(c.x), Math.round(c.y)];""")
        block, x, y = shared
        assert block >= 0
        actions = ActionChains(browser)
        actions.w3c_actions.pointer_action.move_to_location(x, y)
        actions.perform()
        tip = wait_for(browser, lambda d: d.find_element("id", "tooltip").is_displayed()
                       and d.find_element("id", "tooltip").text, "a tooltip")
        assert f"block {block} · shared · 3 references" in tip, tip
        assert request.request_id in tip and all(f"seq {i} · logical block" in tip for i in range(3)), tip
        browser.save_screenshot(str(tmp_path / "dashboard-running.png"))
    finally:
        request.stop()
        request.ended.wait(30)

    after = wait_for(browser, lambda d: (c := counts(d)) and c["owned"] == 0 and c["shared"] == 0 and c, "a released pool")
    assert after["free"] + after["cached"] == NUM_BLOCKS and after["cached"] >= 1, json.dumps(after)  # the prompt's stay cached
    assert not browser.find_elements("css selector", f'tr[data-request-id="{request.request_id}"]')
    browser.save_screenshot(str(tmp_path / "dashboard-after.png"))
    assert (tmp_path / "dashboard-running.png").stat().st_size > 10_000
