"""The peers mmgate's text path is measured against, and the load generator that drives them (``bench/passthrough``):
nginx as a plain reverse proxy, and wrk posting one body over keep-alive connections.

- ``install``: nginx and wrk from Debian's packages where either is missing (``apt-get``).
- ``nginx_argv``: nginx in the foreground with one worker, HTTP/1.1 to a keep-alive upstream and the body
  buffered in memory as mmgate does (``NGINX_CONF``), its files under a folder of the caller's.
- ``wrk_script`` and ``run_wrk``: wrk POSTing one file's bytes, its summary as one JSON line (``WRK_LUA``);
  ``wrk_argv`` for a run the caller waits on itself.
- ``versions``: nginx's and wrk's, for the record.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"  # where apt-get puts it: off a plain user's PATH

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/client_body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  keepalive_requests 1000000;
  client_max_body_size 0;
  upstream backend {{
    server 127.0.0.1:{upstream};
    keepalive 128;
    keepalive_requests 1000000;
  }}
  server {{
    listen 127.0.0.1:{port};
    client_body_buffer_size 16m;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"""

WRK_LUA = """
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*a")
f:close()
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {{"requests":%d,"duration_us":%d,"bytes":%d,"p50_us":%d,"p90_us":%d,' ..
    '"p99_us":%d,"max_us":%d,"mean_us":%.1f,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\\n',
    summary.requests, summary.duration, summary.bytes, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def install() -> None:
    """nginx and wrk from Debian's packages, where either is missing."""
    if shutil.which("wrk") is None or not Path(NGINX).exists():
        print("installing nginx and wrk with apt-get ...", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "nginx", "wrk"], env=env, check=True, capture_output=True)


def nginx_argv(folder: Path, port: int, upstream: int) -> list[str]:
    """nginx proxying 127.0.0.1:``port`` to 127.0.0.1:``upstream``, its configuration and files in ``folder`` (which
    its workers, running as nobody, must be able to read)."""
    conf = folder / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=folder, port=port, upstream=upstream))
    return [NGINX, "-p", str(folder), "-e", str(folder / "error.log"), "-c", str(conf)]


def wrk_script(folder: Path, body: bytes) -> Path:
    """A wrk script that POSTs ``body`` (kept beside it in ``folder``) to /v1/chat/completions."""
    data = folder / f"body-{len(body)}.json"
    data.write_bytes(body)
    script = folder / f"post-{len(body)}.lua"
    script.write_text(WRK_LUA.format(body=data))
    return script


def wrk_argv(url: str, script: Path, conns: int, seconds: float, cpu: str) -> list[str]:
    """wrk on one thread pinned to ``cpu``, ``conns`` connections for ``seconds`` (a whole second at least)."""
    return ["taskset", "-c", cpu, "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency",
            "--timeout", "20s", "-s", str(script), url]


def run_wrk(url: str, script: Path, conns: int, seconds: float, cpu: str) -> dict[str, Any]:
    """One wrk run (``wrk_argv``): its summary (requests, duration, latency percentiles in µs, errors)."""
    out = subprocess.run(wrk_argv(url, script, conns, seconds, cpu), capture_output=True, text=True,
                         timeout=seconds + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {out.stdout}\n{out.stderr}")
    return dict(json.loads(line[len("WRKJSON "):]))


def versions() -> dict[str, str]:
    """nginx's and wrk's versions."""
    nginx = subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip()
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()
    return {"nginx": nginx.split("/")[-1], "wrk": wrk[1] if len(wrk) > 1 else "?"}
