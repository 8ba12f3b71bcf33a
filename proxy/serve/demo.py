"""``mmgate demo``'s stub backend: started in its own process, and the snippets printed once the proxy listens.

The demo listens on ``DEMO_HOST`` (loopback) unless ``MMGATE_HOST`` or ``--host`` says otherwise: a first try
should not open a port to the network. The printed snippets run as pasted into a new shell: the Python one
with this mmgate's own interpreter (it has the demo extra's openai SDK), not whatever ``python`` that shell
finds first.
"""

from __future__ import annotations

import importlib.util
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from proxy.settings import ConfigError, Settings

DEMO_HOST = "127.0.0.1"
# Listen addresses that mean "every interface": the snippets reach such a proxy on loopback.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stub_backend() -> tuple[subprocess.Popen[bytes], str]:
    """The demo's backend, in its own process so its CPU and memory are its own."""
    # The stub needs numpy, which only the demo extra installs: say so in one line, not with a traceback.
    if importlib.util.find_spec("numpy") is None:
        raise ConfigError("mmgate demo needs the demo extra: pip install -e '.[demo]'")
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "demo.backend", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    line = _first_line(stub)  # the stub prints one line once it listens
    if b"listening" not in line or time.monotonic() > deadline:
        stub.terminate()
        raise ConfigError(f"the demo stub backend did not start (said {line[:200]!r})")
    return stub, f"http://127.0.0.1:{port}"


def _first_line(process: subprocess.Popen[bytes]) -> bytes:
    """The first line ``process`` prints (empty when it ends first, or its output is not a pipe)."""
    return process.stdout.readline() if process.stdout is not None else b""


def demo_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a proxy listening on ``host``: loopback for every interface."""
    if host in WILDCARD_HOSTS:
        host = DEMO_HOST
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def python_for_snippets() -> str:
    """This mmgate's interpreter, as a shell word: a new shell's ``python`` may be another one, without the
    demo extra (or none at all)."""
    return shlex.quote(sys.executable)


def venv_hint() -> str:
    """How to have this interpreter as ``python`` in a shell of one's own: activate its virtual environment."""
    activate = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix == sys.base_prefix or not activate.exists():
        return ""
    return f"\n  # (for plain `python` to be that one in a shell: . {shlex.quote(str(activate))})"


def print_demo_help(settings: Settings, port: int) -> None:
    """Snippets to paste into another shell, which work there as pasted (the module docstring says how)."""
    base = demo_url(settings.listen.host, port)
    where = " (listening on every interface)" if settings.listen.host in WILDCARD_HOSTS else ""
    print(
        f"""
mmgate demo: proxy on {base}{where} -> stub backend at {settings.backend.upstream}

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "stub", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  # an image, made on the fly and sent inline, run by mmgate's own Python, which has the openai SDK{venv_hint()}
  {python_for_snippets()} - <<'EOF'
import base64, io
from openai import OpenAI
from PIL import Image
png = io.BytesIO()
Image.new("RGB", (640, 480), "teal").save(png, "PNG")
image = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
client = OpenAI(base_url="{base}/v1", api_key="unused")
reply = client.chat.completions.create(model="stub", messages=[{{"role": "user", "content": [
    {{"type": "text", "text": "What is in this picture?"}},
    {{"type": "image_url", "image_url": {{"url": image}}}}]}}])
print(reply.choices[0].message.content)
EOF

  metrics: {base}/mmgate/metrics   dashboard: {base}/mmgate/dashboard   Ctrl-C to stop
""",
        flush=True,
    )
