"""The deploy/ files agree with the code: env var names, probe paths, ports, drain timing, metric names.

These files are not run by the unit tests (no Docker, no cluster here), so drift would only show in
production: a renamed MMGATE_* variable silently ignored, a probe on a path that 404s, a Grafana panel over
a metric that no longer exists, a grace period that SIGKILLs a drain halfway. Every check here reads the
real file and compares it with the real code (Settings fields, build_app() routes, Metrics() exposition).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")

from proxy.edge.connections import PROBE_LINE  # noqa: E402
from proxy.ops.metrics import Metrics  # noqa: E402
from proxy.settings import SPEC, Settings, env_name  # noqa: E402
from testkit import worst_case_docs as worst_case  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DEFAULT_PORT = 8080
# Prometheus' own series that rules may use besides mmgate's exposition.
PROMETHEUS_BUILTINS = {"up"}
# Margin (s) between mmgate's own drain (grace + timeout) and Kubernetes' SIGKILL.
GRACE_MARGIN = 5


# ---------------------------------------------------------------- helpers


def require_heavy() -> bool:
    return os.environ.get("MMGATE_REQUIRE_HEAVY") == "1"


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@cache
def setting_env_names() -> frozenset[str]:
    return frozenset(env_name(name) for name in SPEC)


@cache
def admin_paths() -> frozenset[str]:
    """GET paths the real app answers locally (the proxy's catch-all route excluded)."""
    from proxy.app import build_app

    app = build_app(Settings.from_env({}, upstream="http://127.0.0.1:9"), admin=True)
    return frozenset(r.canonical for r in app.router.resources() if r.canonical.startswith("/mmgate/"))


@cache
def exposition_names() -> frozenset[str]:
    """Every series name a fresh Metrics() can expose: samples present now plus the suffixes of each family."""
    text = Metrics().exposition().decode()
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind == "counter":  # the TYPE line has the _total suffix or not, by client version
                name = name.removesuffix("_total")
                names |= {name + "_total", name + "_created"}
            elif kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
            elif kind == "summary":
                names |= {name, name + "_sum", name + "_count", name + "_created"}
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return frozenset(names)


@cache
def metric_labels() -> dict[str, frozenset[str]]:
    """Series name -> label names mmgate sets on it (Prometheus adds job and instance; buckets add le)."""
    metrics = Metrics()
    out: dict[str, frozenset[str]] = {}
    for value in vars(metrics).values():
        name = getattr(value, "_name", None)
        kind = getattr(value, "_type", None)
        if not name or kind is None:
            continue
        labels = frozenset(getattr(value, "_labelnames", ()))
        if kind == "counter":
            out[name.removesuffix("_total") + "_total"] = labels
        elif kind == "histogram":
            out[name + "_bucket"] = labels | {"le"}
            out[name + "_sum"] = out[name + "_count"] = labels
        else:
            out[name] = labels
    return out


_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                    "group_left", "group_right", "inf", "nan", "Inf", "NaN"}


def promql_selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names matched) for every vector selector in a PromQL expression."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, label_replace args)
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery durations, Grafana $__rate_interval
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", e):
        name, matchers, call = m.groups()
        if call or name in _PROMQL_KEYWORDS:
            continue
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers or ""))
        yield name, labels


def check_promql(expr: str, where: str) -> list[str]:
    problems = []
    for name, labels in promql_selectors(expr):
        if name in PROMETHEUS_BUILTINS:
            continue
        if name not in exposition_names():
            problems.append(f"{where}: metric {name!r} is not exposed by proxy.metrics.Metrics")
            continue
        known = metric_labels().get(name, frozenset()) | {"job", "instance"}
        for label in labels - known:
            problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(known)})")
    return problems


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with backslash continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buffer = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        keyword, _, args = buffer.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buffer = ""
    return out


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions:
        if keyword == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def sleep_seconds(container: dict[str, Any]) -> float:
    """Seconds a container's preStop hook sleeps (exec ``sleep N``, ``sh -c 'sleep N'`` or ``sleep.seconds``)."""
    pre_stop = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = " ".join(str(c) for c in (pre_stop.get("exec") or {}).get("command", []))
    match = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)", command)
    return float(match.group(1)) if match else 0.0


def arg_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


quantity_bytes = worst_case.quantity_bytes  # a Kubernetes memory quantity in bytes


def quantity_cpus(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def k8s() -> dict[str, Any]:
    docs = load_yaml_docs(DEPLOY / "k8s" / "deployment.yaml") + load_yaml_docs(DEPLOY / "k8s" / "configmap.yaml")
    by_kind: dict[str, Any] = {}
    for doc in docs:
        assert doc["kind"] not in by_kind, f"one {doc['kind']} expected"
        by_kind[doc["kind"]] = doc
    assert {"Deployment", "Service", "ConfigMap"} <= set(by_kind)
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    by_kind["pod"] = pod
    by_kind["mmgate"] = containers["mmgate"]
    by_kind["backend"] = next(c for name, c in containers.items() if name != "mmgate")
    by_kind["env"] = {k: str(v) for k, v in by_kind["ConfigMap"]["data"].items()}
    return by_kind


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def compose_env(compose: dict[str, Any]) -> dict[str, str]:
    env = compose["services"]["mmgate"]["environment"]
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


@pytest.fixture(scope="module")
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    assert rules
    return rules


@pytest.fixture(scope="module")
def grafana() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "mmgate.json").read_text())


# ---------------------------------------------------------------- env var names and values


def test_every_mmgate_variable_in_deploy_files_is_a_setting() -> None:
    """A misspelt MMGATE_* variable is silently ignored at run time: catch it here."""
    unknown = {}
    for path in [DEPLOY / "Dockerfile", DEPLOY / "compose.yaml", *sorted((DEPLOY / "k8s").glob("*.yaml"))]:
        names = set(re.findall(r"\bMMGATE_[A-Z0-9_]+\b", path.read_text()))
        if bad := names - setting_env_names():
            unknown[path.name] = sorted(bad)
    assert not unknown, f"not Settings fields: {unknown}"


def test_configmap_and_compose_values_are_accepted_by_settings(
    k8s: dict[str, Any], compose_env: dict[str, str]
) -> None:
    """The values themselves pass Settings' validation (a bad one would stop start-up with exit 2)."""
    for env in (k8s["env"], compose_env):
        settings = Settings.from_env(env)
        assert settings.backend.upstream


def test_dockerfile_env_is_valid_and_consistent() -> None:
    instructions = dockerfile_instructions(DEPLOY / "Dockerfile")
    env = {k: v for k, v in dockerfile_env(instructions).items() if k.startswith("MMGATE_")}
    assert set(env) <= setting_env_names()
    Settings.from_env({"MMGATE_UPSTREAM": "http://backend:8000", **env})


# ---------------------------------------------------------------- Dockerfile


def _survives_the_connection_cap(method: str, path: str) -> bool:
    """Whether ``connections.GuardedConnection`` serves this probe when MMGATE_MAX_CONNECTIONS is reached."""
    return PROBE_LINE.fullmatch(f"{method} {path} HTTP/1.1\r\n".encode()) is not None


def test_dockerfile_base_user_port_healthcheck_entrypoint() -> None:
    instructions = dockerfile_instructions(DEPLOY / "Dockerfile")
    by = {}
    for keyword, args in instructions:
        by.setdefault(keyword, []).append(args)
    assert by["FROM"] == ["python:3.11-slim"]
    user = by["USER"][-1].split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    env = dockerfile_env(instructions)
    exposed = {int(p.split("/")[0]) for args in by["EXPOSE"] for p in args.split()}
    assert int(env.get("MMGATE_PORT", DEFAULT_PORT)) in exposed
    assert json.loads(by["ENTRYPOINT"][-1]) == ["mmgate"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^mmgate\s*=\s*"proxy\.cli:main"', pyproject, re.M), "ENTRYPOINT mmgate is the package's script"
    healthcheck = by["HEALTHCHECK"][-1]
    paths = set(re.findall(r"/mmgate/[a-z]+", healthcheck))
    assert paths == {"/mmgate/health"} and paths <= admin_paths()
    assert "urllib" in healthcheck and "MMGATE_ADMIN_PORT" in healthcheck
    # Without an admin port it probes the main port: its request line is one answered over the connection cap.
    assert "u.urlopen(" in healthcheck and "data=" not in healthcheck  # urllib: GET, HTTP/1.1
    assert all(_survives_the_connection_cap("GET", path) for path in paths)
    for keyword, args in instructions:
        if keyword == "COPY":
            for source in shlex.split(args)[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_dockerfile_copies_everything_the_package_installs() -> None:
    """``pip install .`` in the image builds the wheel from what was COPYed before it: every package
    [tool.setuptools] names, each file its package-data and the project's readme name, else the build fails
    ("package directory ... does not exist") or installs a proxy without its dashboard."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    instructions = dockerfile_instructions(DEPLOY / "Dockerfile")
    install = next(i for i, (keyword, args) in enumerate(instructions)
                   if keyword == "RUN" and re.search(r"\bpip install\b", args))
    copied: dict[str, str] = {}  # destination in the build folder -> source in the repository
    workdir = "/"
    for keyword, args in instructions[:install]:
        if keyword == "WORKDIR":
            workdir = args
        elif keyword == "COPY":
            *sources, destination = shlex.split(args)
            assert not any(s.startswith("--") for s in sources), "COPY flags are not checked here"
            for source in sources:
                target = destination.rstrip("/") + "/" + Path(source).name if destination.endswith("/") else destination
                copied[os.path.normpath(os.path.join(workdir, target))] = source
    build = os.path.normpath(workdir)

    def in_image(relative: str) -> Path | None:
        """Where ``relative`` (to the project root) comes from in the repository, if it was copied."""
        for destination, source in copied.items():
            inside = os.path.relpath(os.path.join(build, relative), destination)
            if inside == "." or not inside.startswith(".."):
                return ROOT / source / ("" if inside == "." else inside)
        return None

    packages = [name.replace(".", "/") for name in setuptools["packages"]]  # a subpackage is a folder inside
    wanted = ["pyproject.toml", project["project"]["readme"], *packages]
    missing = [name for name in wanted if in_image(name) is None]
    assert not missing, f"pip install runs before these are copied: {missing}"
    for package in packages:
        source = in_image(package)
        assert source is not None and (source / "__init__.py").is_file(), f"{package}: not a package where copied"
    for package, patterns in setuptools.get("package-data", {}).items():
        source = in_image(package)
        assert source is not None, f"package data of {package}: the package is not copied"
        for pattern in patterns:
            assert list(source.glob(pattern)), f"package data {package}/{pattern}: nothing there in the image"


# ---------------------------------------------------------------- compose


def test_compose_ports_upstream_and_mounts(compose: dict[str, Any], compose_env: dict[str, str]) -> None:
    services = compose["services"]
    settings = Settings.from_env(compose_env)
    mmgate = services["mmgate"]
    assert mmgate["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (DEPLOY / mmgate["build"]["context"] / mmgate["build"]["dockerfile"]).is_file()
    container_ports = {int(str(p).rsplit(":", 1)[1].split("/")[0]) for p in mmgate["ports"]}
    assert container_ports == {settings.listen.port}

    upstream = urlsplit(settings.backend.upstream)
    backend = services[upstream.hostname]  # MMGATE_UPSTREAM names a compose service ...
    assert backend["image"].startswith("vllm/vllm-openai")
    assert arg_value(backend["command"], "--port") == str(upstream.port)  # ... on the port it listens on
    assert "ports" not in backend, "the backend is reached through mmgate only"
    assert "SmolVLM" in (arg_value(backend["command"], "--model") or "")
    # The backend outlives mmgate's drain on `docker compose down`.
    grace = settings.drain.drain_grace + settings.drain.drain_timeout
    assert float(str(backend["stop_grace_period"]).rstrip("s")) > grace
    assert float(str(mmgate["stop_grace_period"]).rstrip("s")) > grace

    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"


def test_prometheus_scrapes_mmgate_metrics_route(compose_env: dict[str, str]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    settings = Settings.from_env(compose_env)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["mmgate"]  # alerts.yml selects job="mmgate"
    assert job["metrics_path"] in admin_paths() and job["metrics_path"] == "/mmgate/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"mmgate:{settings.listen.admin_port or settings.listen.port}"]
    for rule_file in config["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file()


def test_grafana_provisioning_matches_compose_mounts(compose: dict[str, Any], grafana: dict[str, Any]) -> None:
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    source = datasources["datasources"][0]
    assert source["type"] == "prometheus"
    assert urlsplit(source["url"]).hostname in compose["services"]
    variable = next(v for v in grafana["templating"]["list"] if v["type"] == "datasource")
    assert variable["current"]["value"] == source["uid"]
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/mmgate.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    mounts = [v.split(":") for v in compose["services"]["grafana"]["volumes"]]
    assert any(src.endswith("mmgate.json") and dst.startswith(path + "/") for src, dst, *_ in mounts)


# ---------------------------------------------------------------- Kubernetes


def _port(container: dict[str, Any], ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    return next(p["containerPort"] for p in container["ports"] if p["name"] == ref)


def test_k8s_mmgate_reads_the_configmap(k8s: dict[str, Any]) -> None:
    refs = [e["configMapRef"]["name"] for e in k8s["mmgate"].get("envFrom", []) if "configMapRef" in e]
    assert refs == [k8s["ConfigMap"]["metadata"]["name"]]
    for item in k8s["mmgate"].get("env", []):
        assert item["name"] in setting_env_names() | {"HF_HOME"}


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: str(item.get("value", "")) for item in container.get("env", [])}


def test_k8s_the_sidecar_reads_the_servers_model_from_its_cache_read_only(k8s: dict[str, Any]) -> None:
    """MMGATE_MODEL=auto (the default) finds the model vLLM serves in the Hugging Face cache vLLM downloads it
    to: the same volume, at the same HF_HOME, mounted read-only into mmgate."""
    backend, mmgate = k8s["backend"], k8s["mmgate"]
    assert Settings.from_env(k8s["env"]).decode.model == "auto"
    home = _env(backend)["HF_HOME"]
    assert _env(mmgate)["HF_HOME"] == home
    served, seen = _mounts(backend)[home], _mounts(mmgate)[home]
    assert seen["name"] == served["name"] and seen.get("readOnly") is True and not served.get("readOnly")
    model = arg_value(backend["args"], "--model") or ""
    assert not model.startswith("/"), "a Hub id: looked up in the cache (a path needs MMGATE_MODEL_DIRS)"
    # MMGATE_MM_PROCESSOR_KWARGS writes its overlay under /tmp, which a read-only root file system needs mounted.
    assert mmgate["securityContext"]["readOnlyRootFilesystem"] and "/tmp" in _mounts(mmgate)


def test_the_model_mode_ships_in_the_core_package_and_the_image() -> None:
    """transformers is a core dependency (the image installs the core package), imported only once a model is
    found: importing mmgate does not load it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dependency.startswith("transformers") for dependency in project["dependencies"])
    assert "model" not in (DEPLOY / "Dockerfile").read_text().split("ARG EXTRAS=")[1].split("\n")[0]
    child = subprocess.run([sys.executable, "-c", "import sys, proxy.app, proxy.cli; "
                            "print(sorted(m for m in ('transformers', 'huggingface_hub', 'tokenizers') "
                            "if m in sys.modules))"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert child.stdout.strip() == "[]"


def test_k8s_ports_and_service(k8s: dict[str, Any]) -> None:
    settings = Settings.from_env(k8s["env"])
    mmgate = k8s["mmgate"]
    ports = {p["containerPort"] for p in mmgate["ports"]}
    assert settings.listen.port in ports
    if settings.listen.admin_port:
        assert settings.listen.admin_port in ports
    service = k8s["Service"]
    labels = k8s["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        assert _port(mmgate, port["targetPort"]) == settings.listen.port, "the Service targets mmgate's proxy port"
    # The backend listens where MMGATE_UPSTREAM points, on loopback only (mmgate is the only way in).
    upstream = urlsplit(settings.backend.upstream)
    backend_args = k8s["backend"]["args"]
    assert arg_value(backend_args, "--port") == str(upstream.port)
    assert arg_value(backend_args, "--host") == upstream.hostname == "127.0.0.1"
    annotations = k8s["Deployment"]["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) == (settings.listen.admin_port or settings.listen.port)
        assert annotations["prometheus.io/path"] in admin_paths()


def test_k8s_probes_hit_admin_routes_on_the_right_port(k8s: dict[str, Any]) -> None:
    settings = Settings.from_env(k8s["env"])
    mmgate = k8s["mmgate"]
    readiness, liveness = mmgate["readinessProbe"]["httpGet"], mmgate["livenessProbe"]["httpGet"]
    assert readiness["path"] == "/mmgate/ready" and liveness["path"] == "/mmgate/health"
    assert {readiness["path"], liveness["path"]} <= admin_paths()
    # httpGet sends GET over HTTP/1.1; on whichever port, these are answered over the connection cap.
    assert all(_survives_the_connection_cap("GET", probe["path"]) for probe in (readiness, liveness))
    # With MMGATE_ADMIN_PORT set, /mmgate/* is served only there.
    expected = settings.listen.admin_port or settings.listen.port
    assert _port(mmgate, readiness["port"]) == expected
    assert _port(mmgate, liveness["port"]) == expected


def test_k8s_termination_grace_covers_the_drain(k8s: dict[str, Any]) -> None:
    """SIGKILL must not land mid-drain, and the backend must outlive every request mmgate still drains."""
    settings = Settings.from_env(k8s["env"])
    grace = float(k8s["pod"]["terminationGracePeriodSeconds"])
    drain = settings.drain.drain_grace + settings.drain.drain_timeout
    assert grace >= sleep_seconds(k8s["mmgate"]) + drain + GRACE_MARGIN
    backend_sleep = sleep_seconds(k8s["backend"])
    assert backend_sleep >= sleep_seconds(k8s["mmgate"]) + drain, "the backend stops before mmgate drained"
    assert grace > backend_sleep


def test_k8s_resources_fit_the_configured_limits(k8s: dict[str, Any]) -> None:
    """The memory limit keeps the headroom docs/deploy.md claims over the worst case the ConfigMap allows, with the
    decode mode mmgate picks on the container's CPUs (not this machine's); decode workers fit the CPU limit."""
    limits = k8s["mmgate"]["resources"]["limits"]
    settings, read_limits = worst_case.k8s_sidecar()
    assert read_limits == limits
    assert settings == worst_case.pod_settings(k8s["env"], quantity_cpus(str(limits["cpu"])))
    assert settings.decode.decode_mode == "process"  # the pod's 2 CPUs: worker processes, counted in the bound
    bound = settings.worst_case_memory_bytes()["total"]
    assert quantity_bytes(limits["memory"]) >= worst_case.HEADROOM * bound
    assert settings.decode.decode_workers <= quantity_cpus(str(limits["cpu"]))
    security = k8s["mmgate"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["allowPrivilegeEscalation"] is False


def test_docs_worst_case_figures_are_generated_from_the_code() -> None:
    """The docs' worst-case memory figures are what --print-config prints (``python -m testkit.worst_case_docs``)."""
    files = worst_case.rewritten()
    assert set(files) == {worst_case.DOCS / "tuning.md", worst_case.DOCS / "deploy.md"}
    for path, (text, generated) in files.items():
        assert generated == text, f"{path.name}'s worst-case memory figures disagree with the code: run python -m " \
            "testkit.worst_case_docs"
    texts = worst_case.current((worst_case.DOCS / "tuning.md").read_text(), ("defaults",))
    defaults = worst_case.default_settings()
    total = f"{defaults.worst_case_memory_bytes()['total'] / 2**20:.0f} MiB"
    assert total in texts["defaults"] and defaults.decode.decode_mode == "process"
    assert worst_case.main(["--check"]) == 0


# ---------------------------------------------------------------- metric names in Grafana and alerts


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_grafana_queries_use_exposed_metrics(grafana: dict[str, Any]) -> None:
    problems: list[str] = []
    exprs = 0
    for panel in _panels(grafana):
        for target in panel.get("targets", []):
            exprs += 1
            problems += check_promql(target["expr"], f"panel {panel['title']!r}")
    for variable in grafana["templating"]["list"]:
        if variable["type"] == "query":
            problems += check_promql(re.sub(r"label_values\((.*),\s*\w+\)", r"\1", variable["definition"]),
                                     f"variable {variable['name']}")
    assert exprs >= 10 and not problems, "\n".join(problems)
    used = {name for p in _panels(grafana) for t in p.get("targets", []) for name, _ in promql_selectors(t["expr"])}
    for family in ("mmgate_requests_total", "mmgate_request_duration_seconds_bucket",
                   "mmgate_stage_duration_seconds_bucket", "mmgate_event_loop_lag_seconds_bucket",
                   "mmgate_gate_in_use", "mmgate_gate_waiting", "mmgate_media_bytes_inflight",
                   "mmgate_media_bytes_live", "process_resident_memory_bytes", "mmgate_cache_hits_total",
                   "mmgate_cache_misses_total", "mmgate_cache_bytes", "mmgate_image_tokens_inflight",
                   "mmgate_image_tokens_bucket", "mmgate_fetches_total", "mmgate_decode_worker_exits_total",
                   "mmgate_requests_reading", "mmgate_gate_reading",
                   "mmgate_idle_connections_closed_total"):
        assert family in used, f"no panel shows {family}"


def test_grafana_panels_are_well_formed(grafana: dict[str, Any]) -> None:
    ids = [p["id"] for p in _panels(grafana)]
    assert len(ids) == len(set(ids))
    for panel in _panels(grafana):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
    for expr in (t["expr"] for p in _panels(grafana) for t in p.get("targets", [])):
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), expr


def test_alert_rules_are_complete(alert_rules: list[dict[str, Any]]) -> None:
    names = [rule["alert"] for rule in alert_rules]
    assert len(names) == len(set(names))
    for rule in alert_rules:
        assert rule["expr"].strip() and rule["for"], rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    exprs = " ".join(rule["expr"] for rule in alert_rules)
    for needed in ("mmgate_gate_waiting", 'reason="queue_full"', 'code="429"', "mmgate_event_loop_lag_seconds_bucket",
                   "mmgate_upstream_errors_total", "process_resident_memory_bytes"):
        assert needed in exprs, f"no alert on {needed}"


def test_alert_rules_use_exposed_metrics(alert_rules: list[dict[str, Any]]) -> None:
    problems = [p for rule in alert_rules for p in check_promql(rule["expr"], rule["alert"])]
    assert not problems, "\n".join(problems)


def test_promql_selector_parser() -> None:
    """The metric-name check above is only as good as this parser: pin what it sees."""
    expr = ('histogram_quantile(0.99, sum by (le, stage) (rate(mmgate_stage_duration_seconds_bucket'
            '{instance=~"$instance"}[$__rate_interval]))) > 2.5e-1 and on (instance) up{job="x"} == 1')
    assert list(promql_selectors(expr)) == [
        ("mmgate_stage_duration_seconds_bucket", {"instance"}), ("up", {"job"}),
    ]
    assert check_promql('rate(mmgate_request_total[5m])', "t")  # misspelt name
    assert check_promql('mmgate_rejected_total{code="x"}', "t")  # label the metric does not have
    assert not check_promql('sum by (reason) (rate(mmgate_rejected_total{reason="queue_full"}[5m]))', "t")


# ---------------------------------------------------------------- promtool (Debian package `prometheus`)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not installed (Debian: apt-get install --no-install-recommends prometheus)"
        if require_heavy():
            pytest.fail(f"MMGATE_REQUIRE_HEAVY=1 and {message}", pytrace=False)
        pytest.skip(message)
    return path


@pytest.mark.parametrize("args", [
    ["check", "rules", "alerts.yml"],
    ["check", "config", "prometheus.yml"],
    ["test", "rules", "alerts_test.yml"],
], ids=["check-rules", "check-config", "test-rules"])
def test_promtool(promtool: str, args: list[str]) -> None:
    result = subprocess.run([promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_draws_the_gate_limit_as_it_moves(grafana: dict[str, Any]) -> None:
    """MMGATE_MAX_MM_CONCURRENCY=auto moves mmgate_gate_limit: the Gate panel plots it over time."""
    panels = [p for p in grafana["panels"] if p.get("title", "").startswith("Gate, queue")]
    assert len(panels) == 1 and panels[0]["type"] == "timeseries"
    assert any(t["expr"].startswith("sum(mmgate_gate_limit{") for t in panels[0]["targets"])


def test_inference_pool_targets_mmgate_on_the_deployments_pods(k8s: dict[str, Any]) -> None:
    """The endpoint picker must route to, and scrape, mmgate's port: the merged /metrics lives there."""
    (pool,) = load_yaml_docs(DEPLOY / "k8s" / "inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    settings = Settings.from_env(k8s["env"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [settings.listen.port]
    labels = k8s["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] != settings.listen.port


def test_dockerignore_keeps_the_context_to_what_the_image_copies() -> None:
    """A local .venv (hundreds of MB) or .git never goes into the build context, and nothing the Dockerfile
    copies is left out of it."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert {".git", ".venv"} <= set(patterns)
    copied = [source for keyword, args in dockerfile_instructions(DEPLOY / "Dockerfile") if keyword == "COPY"
              for source in shlex.split(args)[:-1]]
    assert copied
    for source in copied:
        assert not any(Path(source).match(pattern) or source.startswith(pattern.rstrip("/") + "/")
                       for pattern in patterns), f"{source} is copied but .dockerignore leaves it out"


def test_the_deploy_page_builds_the_image_the_manifest_runs_and_reaches_the_host(k8s: dict[str, Any]) -> None:
    page = (ROOT / "docs" / "deploy.md").read_text()
    tags = re.findall(r"docker build -f deploy/Dockerfile -t (\S+) \.", page)
    assert tags and set(tags) == {k8s["mmgate"]["image"]}
    for command in re.findall(r"docker run [^\n]*(?:\\\n[^\n]*)*", page):
        if "host.docker.internal" in command and "--print-config" not in command:
            assert "--add-host=host.docker.internal:host-gateway" in command, command
    # The dashboard is on the admin port, which the Service does not expose: both pages say how to reach it.
    admin, name = k8s["env"]["MMGATE_ADMIN_PORT"], k8s["Deployment"]["metadata"]["name"]
    forward = f"kubectl port-forward deploy/{name} {admin}:{admin}"
    for text in (page, (ROOT / "README.md").read_text()):
        assert forward in text and f"http://127.0.0.1:{admin}/mmgate/dashboard" in text
