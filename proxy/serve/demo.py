"""``mmgate demo``'s stub backend: started in its own process, and the snippets printed once the proxy listens."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time

from proxy.settings import ConfigError, Settings


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
    assert stub.stdout is not None
    deadline = time.monotonic() + 30
    line = stub.stdout.readline()  # the stub prints one line once it listens
    if b"listening" not in line or time.monotonic() > deadline:
        stub.terminate()
        raise ConfigError(f"the demo stub backend did not start (said {line[:200]!r})")
    return stub, f"http://127.0.0.1:{port}"


def print_demo_help(settings: Settings, port: int) -> None:
    """Snippets to paste into another shell (the README's demo command installs the ``demo`` extra they need)."""
    base = f"http://127.0.0.1:{port}"
    print(
        f"""
mmgate demo: proxy on {base} -> stub backend at {settings.backend.upstream}

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "stub", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  # an image, made on the fly and sent inline (the openai SDK comes with the demo extra: pip install -e '.[demo]')
  python - <<'EOF'
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
