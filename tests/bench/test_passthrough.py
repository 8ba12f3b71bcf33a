"""The text-only load ``bench/passthrough.py`` starts (``testkit/text_load.py``, shared with front, pacing and
scale): the upstream reads the body and answers the fixed completion, the minimal proxy relays it, and the SSE
client counts the tokens of its streams; real processes on loopback, as the benches start them."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

from testkit.load import free_port, stop, wait_http
from testkit.text_load import ANSWER, ROLE, text_body

REPO = Path(__file__).resolve().parents[2]


def test_the_minimal_proxy_relays_the_upstream_answer() -> None:
    port, proxy_port = free_port(), free_port()
    upstream = subprocess.Popen([*ROLE, "upstream", "--port", str(port)], cwd=REPO)
    proxy = subprocess.Popen([*ROLE, "minimal-proxy", "--port", str(proxy_port), "--upstream",
                              f"http://127.0.0.1:{port}"], cwd=REPO)
    try:
        wait_http(f"http://127.0.0.1:{port}/", upstream)
        wait_http(f"http://127.0.0.1:{proxy_port}/", proxy)
        request = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/v1/chat/completions", data=text_body(1 << 20))
        with urllib.request.urlopen(request, timeout=5) as answer:
            assert answer.read() == ANSWER
    finally:
        stop(proxy)
        stop(upstream)


def test_the_text_upstream_reads_the_body_and_the_sse_client_counts_its_tokens() -> None:
    port = free_port()
    upstream = subprocess.Popen([*ROLE, "upstream", "--port", str(port), "--sse-tokens", "5", "--sse-delay", "0.01"],
                                cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = text_body(4096)
        assert len(body) == 4096 and json.loads(body)["messages"]
        wait_http(f"http://127.0.0.1:{port}/", upstream)
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=5) as answer:
            assert answer.read() == ANSWER
        client = subprocess.run([*ROLE, "sse-client", "--url", url, "--streams", "4", "--warmup", "0.2",
                                 "--duration", "0.5", "--period", "0.1"], cwd=REPO, capture_output=True,
                                timeout=60, check=True)
        start, line = client.stdout.decode().splitlines()[:2]
        report = json.loads(line)
        assert start == "START" and report["tokens"] > 0 and report["errors"] == 0
    finally:
        stop(upstream)
