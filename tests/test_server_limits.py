"""The server's bounds on what clients hold, each driven against a real `mlxinfer serve` process on
127.0.0.1 (issue 33 B2, B6, B8, B9): idle and half-open connections, a client that never reads, the
drain on SIGTERM, the API key, and the smaller contract points. Bounded in requests and time: the
model is a 2-layer synthetic one, every wait has a deadline."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from mlxinfer.server.connections import EVICTABLE_AFTER  # noqa: E402
from mlxinfer.synthetic import write_synthetic_model  # noqa: E402

SHAPE = dict(arch="qwen3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320,
             context_length=4096, tied_output=False, seed=11)
KEY = "sk-test-0123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("limits") / "m.gguf", **SHAPE))


@pytest.fixture(scope="module")
def endless(model):
    """Request options that generate until max_tokens: the model's end-of-generation tokens banned."""
    import mlxinfer

    eog = mlxinfer.load(model, backend="cpu").tokenizer.eog_ids
    return {"prompt": [10, 11], "temperature": 0, "logit_bias": {str(t): -100 for t in eog}}


class Server:
    """`mlxinfer serve` in a child process; its stderr goes to a file (read by `log()`)."""

    def __init__(self, model, tmp_path, *options):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err_path = tmp_path / f"serve-{self.port}.log"
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxinfer", "serve", "--model", model, "--backend", "cpu",
                                      "--port", str(self.port), *options], stdout=subprocess.DEVNULL, stderr=self.err)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)

    def log(self) -> str:
        self.err.flush()
        return self.err_path.read_text()

    def metric(self, name: str, headers=None) -> float:
        for line in httpx.get(self.url + "/metrics", headers=headers, timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_for(self, name: str, value: float, timeout: float = 20, headers=None) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name, headers) != value:
            assert time.monotonic() < deadline, f"{name} never reached {value}: {self.metric(name, headers)}"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.err.close()
        return self.proc.returncode


@pytest.fixture
def server(model, tmp_path, request):
    """A server started with the options the test names (`options(...)`), or none."""
    s = Server(model, tmp_path, *getattr(request, "param", ()))
    yield s
    s.stop()


def options(*args):
    """The decorator that starts a test's server with these command-line options."""
    return pytest.mark.parametrize("server", [args], indirect=True, ids=["-".join(a.lstrip("-") for a in args)])


def _raw_request(port: int, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A POST to /v1/completions on a socket of its own, not read (rcvbuf: its receive buffer, set
    before connecting so that the window stays that small)."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def _closed_by_server(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` within `timeout` seconds (what it sent before is skipped; a reset,
    where the server closed with bytes of ours unread, is a close too)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


# -- B2: idle and half-open connections -------------------------------------------------------------

def _still_open(socks) -> int:
    """How many of `socks` the server has not closed (what it sent, a 503, is read and skipped)."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            while s.recv(65536):
                pass
        except BlockingIOError:
            n += 1
        except ConnectionResetError:
            pass
    return n


@options("--max-connections", "50", "--timeout-header", "60")
def test_idle_and_half_open_connections_do_not_lock_clients_out(server):
    """200 connections that send nothing or half a request line, against a cap of 50 (and a header
    deadline far away: only the cap makes room): a normal client is answered, at once or after the
    503s with Retry-After it gets while every connection is fresh, by closing the longest idle one; no
    more than 50 of the idle sockets stay open; the log grows by a line, not a line (or a traceback) per
    connection. (The header deadline: the next test.)"""
    before = server.log().count("\n")
    idle = []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # and never the rest
        idle.append(s)
    body = {"prompt": [10, 11], "max_tokens": 3, "temperature": 0}
    for _ in range(3):  # as a client honouring Retry-After: 1
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        if r.status_code != 503:
            break
        assert r.headers["retry-after"] == "1" and "--max-connections" not in r.text  # (no option in the answer)
        time.sleep(EVICTABLE_AFTER)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 5
    while _still_open(idle) > 50:  # all accepted before the normal client: closed within a loop turn or two
        assert time.monotonic() < deadline, _still_open(idle)
        time.sleep(0.05)
    for s in idle:
        s.close()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    new = [line for line in server.log().splitlines()[before:] if "HTTP/1.1" not in line]  # not access lines
    assert len(new) <= 2 and "Traceback" not in server.log(), new
    assert any("--max-connections" in line for line in new)


@options("--max-connections", "1", "--timeout-header", "60")
def test_a_connection_with_a_request_in_flight_is_never_closed_for_the_cap(server, endless):
    """At the cap, only an idle connection may be closed to make room: a connection that waited past the
    idle grace before sending its request is busy once the request came, so a newcomer then gets the 503
    and the stream goes on to its end and [DONE]."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    time.sleep(EVICTABLE_AFTER + 0.3)  # idle past the grace (the header deadline is far away)
    data = json.dumps({**endless, "max_tokens": 2000, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    while b"data: {" not in got:  # the stream has started: the request is in flight
        more = s.recv(65536)
        assert more, got
        got += more
    newcomer = httpx.get(server.url + "/health", timeout=10)
    assert newcomer.status_code == 503 and newcomer.headers["retry-after"] == "1"
    while b"data: [DONE]" not in got:
        more = s.recv(65536)
        assert more, "the stream was cut"
        got += more
    s.close()
    assert b'"finish_reason": "length"' in got  # it ran to max_tokens


@options("--timeout-header", "1", "--timeout-body", "1")
def test_a_request_trickled_byte_by_byte_is_cut_at_the_header_and_body_timeouts(server):
    """Headers sent a byte at a time (each byte well within uvicorn's keep-alive) are cut at the
    header deadline; a body that stops halfway gets a 408 at the body deadline and the connection
    closes."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    line, cut = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200, False
    deadline = time.monotonic() + 10
    for b in line:
        try:
            s.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        time.sleep(0.05)
    assert cut or _closed_by_server(s, timeout=2)
    assert time.monotonic() < deadline
    s.close()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    s.settimeout(10)
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    s.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"--timeout-body" in answer and b'"error"' in answer


# -- B6: a client that leaves, a client that never reads ------------------------------------------

@options("--timeout-send", "1", "--max-batch", "2")
def test_clients_that_never_read_are_cut_off_and_free_their_slots(server, endless):
    """Two streams whose clients never read (a 4 KiB receive window), on a batch of two: once the
    socket's buffers are full the send stalls, and after --timeout-send the request is cancelled
    (counted as such), its slot freed, and a normal request runs. Without the bound both would hold
    the batch for their 3000 tokens."""
    cancelled = server.metric('mlxinfer_requests_total{reason="cancelled"}')
    body = {**endless, "max_tokens": 3000, "logprobs": 5, "stream": True}
    stalled = [_raw_request(server.port, body, rcvbuf=4096) for _ in range(2)]
    server.wait_for('mlxinfer_requests_total{reason="cancelled"}', cancelled + 2, timeout=30)
    assert server.metric("mlxinfer_requests_running") == 0 and server.metric("mlxinfer_kv_slots_used") == 0
    assert server.metric("mlxinfer_generation_tokens_total") == 0  # they did not finish
    r = httpx.post(server.url + "/v1/completions", json={**endless, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    for s in stalled:
        s.close()


def test_a_client_that_leaves_is_counted_and_frees_its_slot(server, endless):
    """A stream and a whole answer whose clients close their sockets mid-generation: both requests
    end cancelled (/metrics' requests_total counts them) and no slot stays used."""
    cancelled = server.metric('mlxinfer_requests_total{reason="cancelled"}')
    for stream in (True, False):
        s = _raw_request(server.port, {**endless, "max_tokens": 4000, "stream": stream})
        server.wait_for("mlxinfer_requests_running", 1)
        s.close()
        server.wait_for("mlxinfer_requests_running", 0)
    server.wait_for('mlxinfer_requests_total{reason="cancelled"}', cancelled + 2)
    assert server.metric("mlxinfer_kv_slots_used") == 0


# -- B8: the drain on SIGTERM ---------------------------------------------------------------------

def _stream(url: str, body: dict):
    """A streamed completion's response and its `data:` lines (an iterator)."""
    client = httpx.Client(timeout=60)
    r = client.send(client.build_request("POST", url + "/v1/completions", json={**body, "stream": True}), stream=True)
    return client, r, (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))


def _until_logged(server, text: str, timeout: float = 10) -> None:
    """Wait (at most `timeout` s) until the server's log holds `text`."""
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert time.monotonic() < deadline, f"{text!r} not logged in {timeout} s"
        time.sleep(0.02)


@options("--drain-timeout", "60")
def test_sigterm_lets_running_streams_finish_and_answers_new_requests_503(server, endless):
    """SIGTERM mid-stream: the stream goes on to its last token and [DONE]; meanwhile a new request and
    /health get 503 with Retry-After (not a refused connection); the process then exits by itself."""
    client, r, data = _stream(server.url, {**endless, "max_tokens": 1500})
    first = next(data)
    server.proc.send_signal(signal.SIGTERM)
    _until_logged(server, "draining")
    new = httpx.post(server.url + "/v1/completions", json={**endless, "max_tokens": 2}, timeout=10)
    assert new.status_code == 503 and new.headers["retry-after"] == "1"
    assert "shutting down" in new.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    rest = [first, *data]
    client.close()
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert len(rest) == 1500 + 2  # a chunk per token, the finishing chunk, [DONE]
    assert server.proc.wait(30) == 0 and "Traceback" not in server.log()


@options("--drain-timeout", "1")
def test_a_stream_still_running_at_the_drain_timeout_gets_an_error_event_and_done(server, endless):
    """A stream far from its end when --drain-timeout passes: an error event naming the drain, then
    `data: [DONE]`; a whole answer waiting at the same time gets a 503 naming it; the process exits."""
    import threading

    client, r, data = _stream(server.url, {**endless, "max_tokens": 4000})
    first = next(data)
    whole = {}
    t = threading.Thread(target=lambda: whole.update(r=httpx.post(
        server.url + "/v1/completions", json={**endless, "max_tokens": 4000}, timeout=60)))
    t.start()
    server.wait_for("mlxinfer_requests_running", 2)
    server.proc.send_signal(signal.SIGTERM)
    rest = [first, *data]
    client.close()
    t.join(60)
    assert rest[-1] == "[DONE]" and "--drain-timeout" in json.loads(rest[-2])["error"]["message"]
    assert whole["r"].status_code == 503 and "--drain-timeout" in whole["r"].json()["error"]["message"]
    assert server.proc.wait(30) == 0 and "Traceback" not in server.log()


@options("--drain-timeout", "60")
def test_a_second_signal_stops_a_draining_server_at_once(server, endless):
    """SIGTERM, then SIGTERM again while a long stream drains: the stream ends at once with an error
    event naming the second signal, then [DONE], and the process exits (uvicorn re-raises the signal)."""
    client, r, data = _stream(server.url, {**endless, "max_tokens": 4000})
    first = next(data)
    server.proc.send_signal(signal.SIGTERM)
    _until_logged(server, "draining")
    server.proc.send_signal(signal.SIGTERM)
    rest = [first, *data]
    client.close()
    assert rest[-1] == "[DONE]" and "second signal" in json.loads(rest[-2])["error"]["message"]
    assert len(rest) < 4000 and server.proc.wait(30) in (0, -signal.SIGTERM) and "Traceback" not in server.log()


# -- B9: the API key --------------------------------------------------------------------------------

@options("--api-key", KEY)
def test_api_key(server):
    """With --api-key: /v1 and /metrics need the bearer key (401 in OpenAI's shape otherwise, the body
    not read), /health and the chat page do not; the official client passes it as api_key."""
    openai = pytest.importorskip("openai")
    body = {"prompt": [10, 11], "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 401 and err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param",
                                                                                          "code"}
        assert KEY not in r.text
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    ok = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(server.url + "/v1/completions", json=body, headers=ok, timeout=30).status_code == 200
    assert httpx.get(server.url + "/metrics", headers=ok, timeout=10).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).models.list().data


def test_serve_warns_without_a_key_off_loopback_and_checks_its_options(model, tmp_path):
    """Listening beyond loopback without --api-key: one warning line, first; bad bounds are one line
    each, before the model loads."""
    for extra, fragment in ((["--max-connections", "0"], "--max-connections must be a positive integer"),
                            (["--timeout-send", "0"], "--timeout-send must be a positive number"),
                            (["--timeout-header", "nan"], "--timeout-header must be a positive number"),
                            (["--drain-timeout", "-1"], "--drain-timeout must be"),
                            (["--api-key", " "], "--api-key must not be empty"),
                            (["--max-connections", "100000000"], "lower --max-connections")):
        r = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", "--model", str(tmp_path / "absent.gguf"),
                            "--port", str(_free_port()), *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and fragment in r.stderr, r.stderr
    with socket.socket() as taken:  # so that nothing listens beyond loopback: the warning, then the port's error
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", "--model", model, "--host", "0.0.0.0",
                            "--port", str(port)], capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and "WARNING" in lines[0] and "without --api-key" in lines[0] and "cannot listen" in lines[1]


def test_a_context_no_cache_can_index_is_refused_at_load(tmp_path):
    """A file that declares 2^32 - 1 positions of context: `mlxinfer serve` stops at load with one line
    naming the key (it loaded, and a chat turn without max_tokens was given the rest of that context)."""
    path = write_synthetic_model(tmp_path / "huge.gguf", **{**SHAPE, "context_length": 2**32 - 1})
    r = subprocess.run([sys.executable, "-m", "mlxinfer", "serve", "--model", str(path), "--backend", "cpu",
                        "--port", str(_free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "qwen3.context_length = 4294967295 is past the 2147483647 positions" in r.stderr
