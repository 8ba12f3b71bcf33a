"""The text-only load ``bench/passthrough.py`` and ``bench/front.py`` start (``testkit/text_load.py``): the
upstream reads the body and answers the fixed completion, and the SSE client counts the tokens of its streams;
real processes on loopback, as the benches start them."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

from testkit.load import free_port, stop, wait_http
from testkit.text_load import ANSWER, ROLE, text_body

REPO = Path(__file__).resolve().parents[2]


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
