"""The chat page (GET /) in a real headless browser: Debian's chromium, driven by selenium through Debian's
chromedriver, against the real server (`python3 -m mlxinfer serve`: the default model, cpu backend, one
thread, two slots) on 127.0.0.1. A reply streams in and grows, equals the API's answer to the same
messages (system prompt included), and shows its tokens and tokens/s; Stop aborts a reply mid-stream and
the server cancels it and frees its KV blocks (read from /metrics). The page's markdown renderer is run
in the same browser on hostile inputs. And the page's files are package data (what `pip install .` ships).

Without chromium, its driver or selenium the browser tests skip and say why (`.ci/run` installs them)."""

import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE_FILES = ("index.html", "app.js", "markdown.js", "style.css")


def _which(*names):
    return next((p for p in map(shutil.which, names) if p), None)


CHROMIUM = _which("chromium", "chromium-browser")
CHROMEDRIVER = _which("chromedriver")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, **labels) -> float:
    """One sample of the server's Prometheus text (0 where the series has not appeared yet)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? (\S+)$" if want else
                         rf"^{re.escape(name)} (\S+)$", re.M)
    m = pattern.search(httpx.get(url + "/metrics", timeout=30).text)
    return float(m.group(1)) if m else 0.0


def until(condition, timeout: float, what: str):
    """Poll `condition` until it returns something true; its value then, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


# -- the page's files are package data ---------------------------------------------------------------

def test_the_page_is_package_data(tmp_path):
    """What setuptools' build_py copies from this pyproject.toml (what a wheel, so `pip install .`, holds)
    includes the page's files: a page left out of the package data would work here from the source tree
    and 404 for every user."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("mlxinfer", "metal_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_py",
                        "--build-lib", str(tmp_path / "lib")], cwd=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    built = tmp_path / "lib" / "mlxinfer" / "server" / "static"
    assert sorted(p.name for p in built.iterdir()) == sorted(PAGE_FILES)


# -- the real server and a real browser -------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    """`mlxinfer serve` as a user starts it (the default model, fetched by the fixture), on the cpu
    backend with one thread, at most two requests at once."""
    port = _free_port()
    log = tmp_path_factory.mktemp("page") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxinfer", "serve", "--backend", "cpu", "-t", "1",
                                 "--host", "127.0.0.1", "--port", str(port), "--max-batch", "2", "--max-queue", "4"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}"
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        until(up, 300, "the server answering /health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them: "
                    "apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))  # no driver download
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    """The page, freshly loaded, once it shows the model's name."""
    browser.get(server + "/")
    until(lambda: browser.find_element("id", "model").text not in ("", "…"), 30, "the model's name shown")
    return browser


def fill(driver, field: str, text: str):
    el = driver.find_element("id", field)
    el.clear()
    el.send_keys(text)


def streaming(driver) -> bool:
    return bool(driver.find_elements("css selector", ".message.assistant.streaming"))


def last_reply(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def test_the_page_and_its_files_are_served(server):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]  # no inline or foreign script runs
    for name in re.findall(r'(?:src|href)="/static/([^"]+)"', r.text):
        assert httpx.get(f"{server}/static/{name}").status_code == 200, name
    assert sorted(re.findall(r'(?:src|href)="/static/([^"]+)"', r.text)) == sorted(set(PAGE_FILES) - {"index.html"})
    assert httpx.get(server + "/static/nothing.js").status_code == 404


# Records, in the page, the length of the streaming reply's text at every change of the conversation.
WATCH = """
window.seenLengths = [];
new MutationObserver(() => {
  const reply = document.querySelector(".message.assistant.streaming");
  if (reply) window.seenLengths.push(reply.textContent.length);
}).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
"""
SYSTEM = "Always answer with a bulleted markdown list."
QUESTION = "What should I pack for a day at the beach?"


def test_a_reply_streams_in_and_equals_the_apis_answer(page, server):
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    assert page.find_element("id", "model").text == model

    def api(messages):
        body = {"messages": messages, "max_tokens": 40, "temperature": 0}
        return httpx.post(server + "/v1/chat/completions", json=body, timeout=300).json()

    want = api([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    plain = api([{"role": "user", "content": QUESTION}])["choices"][0]["message"]["content"]
    text = want["choices"][0]["message"]["content"]
    assert text != plain  # so a system prompt the page dropped would show
    fill(page, "system", SYSTEM)
    fill(page, "temperature", "0")
    fill(page, "max-tokens", "40")
    fill(page, "input", QUESTION)
    page.execute_script(WATCH)
    page.find_element("id", "send").click()
    until(lambda: streaming(page), 30, "the reply starting")
    until(lambda: not streaming(page), 300, "the reply ending")
    seen = page.execute_script("return window.seenLengths")
    assert len(set(n for n in seen if n)) >= 3, seen  # shown piece by piece as it came
    shown = last_reply(page).get_attribute("innerHTML")
    assert shown == page.execute_script(INSPECT, text)["html"]  # the API's text, rendered
    stats = page.find_element("id", "stats").text
    m = re.fullmatch(r"last reply: (\d+) tokens, (\d+\.\d) tokens/s", stats)
    assert m, stats
    assert int(m.group(1)) == want["usage"]["completion_tokens"] and float(m.group(2)) > 0


def test_stop_aborts_a_reply_and_the_server_frees_its_blocks(page, server):
    """Stop mid-stream: the page stops at once and keeps what came; the server sees the connection close,
    cancels the request and its KV blocks are free again (used 0, read from /metrics). Left running, the
    reply would go on for hundreds of tokens (a greedy story; 2,000 allowed)."""
    fill(page, "temperature", "0")
    fill(page, "max-tokens", "2000")
    fill(page, "input", "Write a long story about a dragon who learns to bake bread.")
    page.find_element("id", "send").click()
    until(lambda: streaming(page) and len(last_reply(page).text) >= 20, 120, "the reply streaming")
    assert metric(server, "mlxinfer_kv_blocks", state="used") > 0
    assert metric(server, "mlxinfer_requests_running") == 1
    page.find_element("id", "stop").click()
    until(lambda: not streaming(page), 30, "the page stopping the reply")
    stats = page.find_element("id", "stats").text
    assert re.fullmatch(r"last reply: (\d+) tokens(, \d+\.\d tokens/s)? \(stopped\)", stats), stats
    until(lambda: metric(server, "mlxinfer_requests_running") == 0
          and metric(server, "mlxinfer_kv_blocks", state="used") == 0, 30, "the server freeing the KV blocks")
    shown = last_reply(page).text
    time.sleep(0.5)
    assert last_reply(page).text == shown  # nothing arrives after Stop
    assert not page.find_element("id", "send").get_property("disabled")


def test_tokens_per_second_is_decode_speed(page):
    tps = "return tokensPerSecond(arguments[0], arguments[1], arguments[2])"
    assert page.execute_script(tps, 11, 1000.0, 3000.0) == 5  # 10 intervals in 2 s
    assert page.execute_script(tps, 1, 1000.0, 1000.0) is None  # one token: no interval to time
    assert page.execute_script(tps, 3, 1000.0, 1000.0) is None


# -- the markdown renderer, in the same browser --------------------------------------------------------

# Every element and attribute the renderer may produce; anything else came from the input.
INSPECT = """
const t = document.createElement("template");  // inert: nothing in it loads or runs
t.innerHTML = renderMarkdown(arguments[0]);
const found = [];
for (const el of t.content.querySelectorAll("*")) {
  found.push([el.tagName.toLowerCase(), Array.from(el.attributes, (a) => [a.name, a.value])]);
}
return {html: t.innerHTML, text: t.content.textContent, elements: found};
"""
TAGS = {"p", "br", "strong", "em", "code", "pre", "a", "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6"}
ATTRIBUTES = {"href", "target", "rel", "class", "start"}

HOSTILE = [
    "<script>window.pwned = 1</script>",
    '<img src=x onerror="window.pwned = 1">',
    "**<svg onload=alert(1)>**",
    "[click](javascript:alert(1))",
    "[click](JavaScript:alert(1))",
    "[click](data:text/html,<script>alert(1)</script>)",
    "[click](vbscript:msgbox(1))",
    "[x](https://example.com/\" onmouseover=\"alert(1))",
    '[x](https://example.com/"><script>alert(1)</script>)',
    "`<b>` and ```\n<iframe src=x></iframe>\n```",
    "```\"><script>x</script>\n<b>\n```",
    "# <h1 onclick=alert(1)>\n- <a href=javascript:alert(1)>x</a>\n1. <style>*{}</style>",
    "_<i>_ *<u>* \u0000 &lt;script&gt; &amp;",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_markdown_escapes_hostile_input(page, hostile):
    got = page.execute_script(INSPECT, hostile)
    for tag, attributes in got["elements"]:
        assert tag in TAGS, got["html"]
        for name, value in attributes:
            assert name in ATTRIBUTES, got["html"]
            if name == "href":
                assert re.match(r"(https?://|mailto:)", value, re.I), got["html"]
    if "](" not in hostile:  # the markup the input holds is all still there, as text: escaped, not dropped
        for piece in re.findall(r"[<>\"&][a-zA-Z]*", hostile):
            assert piece in got["text"], (piece, got["html"])
    assert page.execute_script("return window.pwned") is None


@pytest.mark.parametrize("source, html", [
    ("**bold** and *it* and _it_ and __b__", "<p><strong>bold</strong> and <em>it</em> and <em>it</em> and "
                                             "<strong>b</strong></p>"),
    ("2 * 3 * 4 and snake_case_name", "<p>2 * 3 * 4 and snake_case_name</p>"),
    ("use `a < b` here", "<p>use <code>a &lt; b</code> here</p>"),
    ("`**not bold**`", "<p><code>**not bold**</code></p>"),
    ("```python\nif a < b:\n    print('*x*')\n```\nafter", '<pre><code class="language-python">if a &lt; b:\n'
                                                          "    print('*x*')</code></pre><p>after</p>"),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    ("# Title\ntext\nmore", "<h1>Title</h1><p>text<br>more</p>"),
    ("- a\n- **b**\n\n3. c\n4. d", "<ul><li>a</li><li><strong>b</strong></li></ul><ol start=\"3\"><li>c</li><li>d</li></ol>"),
    ("[docs](https://example.com/a?b=1&c=2)", '<p><a href="https://example.com/a?b=1&amp;c=2" target="_blank" '
                                              'rel="noopener noreferrer">docs</a></p>'),
    ("[mail](mailto:a@example.com) [no](ftp://x)", '<p><a href="mailto:a@example.com" target="_blank" '
                                                   'rel="noopener noreferrer">mail</a> [no](ftp://x)</p>'),
])
def test_markdown_renders_what_replies_use(page, source, html):
    assert page.execute_script(INSPECT, source)["html"] == html
