"""deploy/: every manifest parses and agrees with the code it deploys.

Checked against the code, not against copies of it: routes come from `create_app`, setting
names from `Settings.model_fields`, the entrypoint from the `kvhandoff` typer app, the port from
the `Settings` default. Kubernetes objects are validated against the Kubernetes JSON schema
(kubernetes-validate ships it, so this runs offline) in strict mode: an unknown or misspelt
field fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
from deploy_helpers import (
    COMPOSE,
    DEFAULT_PORT,
    DEPLOY,
    DOCKERFILE,
    ENV_EXAMPLE,
    ENV_PREFIX,
    ENV_RE,
    K8S,
    REPO,
    compose,
    dockerfile,
    dockerfile_env,
    dockerignore_allows,
    dockerignore_patterns,
    k8s_kind,
    k8s_objects,
    setting_env_names,
    yaml_docs,
)
from fastapi.testclient import TestClient
from pydantic import ValidationError

from kvhandoff.bootstrap_server import create_app
from kvhandoff.settings import Settings

# oldest Kubernetes minor we claim to support (internalTrafficPolicy is GA since 1.26) + newest
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
SIDECAR_COMMAND = ["kvhandoff", "serve"]


def _text_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _daemonset() -> dict[str, Any]:
    (ds,) = k8s_kind("DaemonSet")
    return ds


def _container() -> dict[str, Any]:
    (c,) = _daemonset()["spec"]["template"]["spec"]["containers"]
    return c


def _env_from_compose(values: dict[str, Any]) -> dict[str, str]:
    """Compose environment with ${VAR:?msg} / ${VAR:-default} interpolation filled in."""
    def fill(v: Any) -> str:
        return re.sub(r"\$\{([A-Z0-9_]+)(?::?[-?][^}]*)?\}", "interpolated-value", str(v))
    return {k: fill(v) for k, v in values.items()}


@pytest.fixture(scope="module")
def app_client() -> TestClient:
    return TestClient(create_app(Settings(auth_token=None)))


# -- parsing ------------------------------------------------------------------------------------

def test_the_shipped_files_exist() -> None:
    for rel in ("Dockerfile", "Dockerfile.dockerignore", "docker-compose.yml", "README.md",
                "systemd/kvhandoff.service", "systemd/kvhandoff.env.example",
                "k8s/daemonset.yaml", "k8s/service.yaml", "k8s/configmap.yaml",
                "k8s/secret.example.yaml", "k8s/namespace.yaml", "k8s/kustomization.yaml"):
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize("path", sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]),
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_manifest_parses(path: Path) -> None:
    docs = yaml_docs(path)
    assert docs, f"{path} holds no document"
    assert all(isinstance(d, dict) for d in docs)


_K8S_OBJECTS = [(p, d) for p, d in k8s_objects() if d.get("kind") != "Kustomization"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "path,obj", _K8S_OBJECTS,
    ids=[f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in _K8S_OBJECTS])
def test_k8s_objects_validate_against_the_kubernetes_schema(
        path: Path, obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_rejects_a_misspelt_field() -> None:
    # the check above must be able to fail: a typo in a probe is not silently accepted
    broken = json.loads(json.dumps(_daemonset()))
    probe = broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["httpGet"]["pth"] = probe["httpGet"].pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_but_the_secret_example() -> None:
    (kust,) = yaml_docs(K8S / "kustomization.yaml")
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"secret.example.yaml"}
    assert all((K8S / r).is_file() for r in listed)


def test_k8s_objects_share_one_namespace_and_it_is_created() -> None:
    (ns,) = k8s_kind("Namespace")
    name = ns["metadata"]["name"]
    for path, obj in _K8S_OBJECTS:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == name, path


# -- probes point at routes the app serves ------------------------------------------------------

def _probe_paths() -> dict[str, list[str]]:
    """Every HTTP path a deploy file probes or scrapes, by what it is for."""
    c = _container()
    out: dict[str, list[str]] = {"liveness": [], "readiness": [], "scrape": []}
    out["liveness"] += [c["startupProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]]
    out["readiness"] += [c["readinessProbe"]["httpGet"]["path"]]
    for obj in (_daemonset()["spec"]["template"], *k8s_kind("Service")):
        ann = obj["metadata"].get("annotations", {})
        if "prometheus.io/path" in ann:
            out["scrape"].append(ann["prometheus.io/path"])
    # Docker HEALTHCHECK and compose healthchecks that use kvhandoff-probe
    for rest in dockerfile().final.args("HEALTHCHECK"):
        m = re.search(r'"kvhandoff-probe",\s*"([^"]+)"', rest)
        assert m, f"HEALTHCHECK should run kvhandoff-probe: {rest!r}"
        out["liveness"].append(m.group(1))
    for svc in compose()["services"].values():
        test = svc["healthcheck"]["test"]
        if "kvhandoff-probe" in test:
            out["liveness"].append(test[test.index("kvhandoff-probe") + 1])
    return out


def test_probe_paths_are_get_routes_of_the_app(app_client: TestClient) -> None:
    openapi_get = {p for p, ops in app_client.app.openapi()["paths"].items() if "get" in ops}
    paths = _probe_paths()
    assert all(paths.values()), paths
    for kind, ps in paths.items():
        for p in ps:
            assert p in openapi_get, f"{kind} probe {p!r} is not a GET route of the app"
            status = app_client.get(p).status_code
            assert status not in (404, 405), f"{kind} probe {p!r} answered {status}"


def test_liveness_passes_and_readiness_fails_on_a_sidecar_without_ranks(
        app_client: TestClient) -> None:
    # liveness must not restart a sidecar that merely waits for its engines; readiness must
    # keep it out of service until they registered
    paths = _probe_paths()
    for p in paths["liveness"]:
        assert app_client.get(p).status_code == 200, p
    for p in paths["readiness"]:
        resp = app_client.get(p)
        assert resp.status_code == 503, p
        assert resp.json()["ready"] is False


def test_scrape_path_serves_prometheus_text(app_client: TestClient) -> None:
    for p in _probe_paths()["scrape"]:
        resp = app_client.get(p)
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        assert "# TYPE" in resp.text


def test_named_probe_and_target_ports_resolve_to_a_container_port() -> None:
    names = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        port = _container()[probe]["httpGet"]["port"]
        assert port in names or port in names.values(), (probe, port)
    for svc in k8s_kind("Service"):
        for sp in svc["spec"]["ports"]:
            assert sp["targetPort"] in names or sp["targetPort"] in names.values()


# -- env vars are real settings -----------------------------------------------------------------

def test_every_env_var_named_in_deploy_files_is_a_setting() -> None:
    known = setting_env_names()
    seen: dict[str, set[str]] = {}
    for path in _text_files():
        for name in ENV_RE.findall(path.read_text(errors="replace")):
            seen.setdefault(name, set()).add(str(path.relative_to(REPO)))
    def real(name: str) -> bool:
        if name.endswith("_*"):  # a family: some setting must carry that prefix
            return any(k.startswith(name[:-1]) for k in known)
        return name in known

    unknown = {n: sorted(f) for n, f in seen.items() if not real(n)}
    assert not unknown, f"not a Settings field: {unknown}"
    # the scan found the variables it must find (so an empty scan cannot pass)
    assert {f"{ENV_PREFIX}AUTH_TOKEN", f"{ENV_PREFIX}PORT", f"{ENV_PREFIX}REQUIRE_RDMA",
            f"{ENV_PREFIX}BOOTSTRAP_URL"} <= set(seen)


def _env_sources() -> dict[str, dict[str, str]]:
    """Every place that sets KVHANDOFF_* values, as name -> {var: value}."""
    out: dict[str, dict[str, str]] = {}
    (cm,) = k8s_kind("ConfigMap")
    out["k8s ConfigMap"] = dict(cm["data"])
    (secret,) = k8s_kind("Secret")
    out["k8s Secret"] = dict(secret["stringData"])
    for name, svc in compose()["services"].items():
        out[f"compose {name}"] = _env_from_compose(svc.get("environment", {}))
    env: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    out["systemd env"] = env
    out["Dockerfile ENV"] = {k: v for k, v in dockerfile_env(dockerfile().final).items()
                             if k.startswith(ENV_PREFIX)}
    return out


@pytest.mark.parametrize("source", sorted(_env_sources()))
def test_every_configured_value_is_valid_for_its_setting(
        source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _env_sources()[source]
    assert values, source
    for var in list(setting_env_names()):
        monkeypatch.delenv(var, raising=False)
    for var, value in values.items():
        assert var in setting_env_names(), (source, var)
        monkeypatch.setenv(var, value)
    try:
        settings = Settings()
    except ValidationError as e:  # pragma: no cover - the message is the point
        pytest.fail(f"{source}: {e}")
    for var, value in values.items():
        got = getattr(settings, setting_env_names()[var])
        got = got.get_secret_value() if hasattr(got, "get_secret_value") else got
        # a value the model silently ignored would come back as the default
        assert str(got).lower() == value.lower() or float(got) == float(value), (var, got, value)


def test_configmap_holds_no_secret_and_the_secret_holds_the_token() -> None:
    (cm,) = k8s_kind("ConfigMap")
    (secret,) = k8s_kind("Secret")
    secret_fields = {f"{ENV_PREFIX}{n}".upper() for n, f in Settings.model_fields.items()
                     if "Secret" in str(f.annotation)}
    assert secret_fields, "Settings has SecretStr fields (auth_token, hmac_secret)"
    assert not secret_fields & set(cm["data"])
    assert f"{ENV_PREFIX}AUTH_TOKEN" in secret["stringData"]


# -- ports agree --------------------------------------------------------------------------------

def _ports() -> dict[str, int]:
    """Every place that names the sidecar's port."""
    out: dict[str, int] = {}
    final = dockerfile().final
    (expose,) = final.args("EXPOSE")
    out["Dockerfile EXPOSE"] = int(expose.split("/")[0])
    out["Dockerfile ENV"] = int(dockerfile_env(final)[f"{ENV_PREFIX}PORT"])
    svc = compose()["services"]
    out["compose bootstrap env"] = int(svc["bootstrap"]["environment"][f"{ENV_PREFIX}PORT"])
    for i, mapping in enumerate(svc["bootstrap"]["ports"]):
        out[f"compose ports[{i}] container"] = int(str(mapping).rsplit(":", 1)[1])
    for name in ("prefill", "decode"):
        url = svc[name]["environment"][f"{ENV_PREFIX}BOOTSTRAP_URL"]
        port = urlsplit(url).port
        assert port is not None, url
        out[f"compose {name} bootstrap url"] = port
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.startswith(f"{ENV_PREFIX}PORT="):
            out["systemd env"] = int(line.split("=", 1)[1])
    (cm,) = k8s_kind("ConfigMap")
    out["k8s ConfigMap"] = int(cm["data"][f"{ENV_PREFIX}PORT"])
    for p in _container()["ports"]:
        out[f"k8s containerPort {p['name']}"] = p["containerPort"]
        out[f"k8s hostPort {p['name']}"] = p["hostPort"]
    for s in k8s_kind("Service"):
        for sp in s["spec"]["ports"]:
            out[f"k8s Service {s['metadata']['name']}"] = sp["port"]
    for obj in (_daemonset()["spec"]["template"], *k8s_kind("Service")):
        port = obj["metadata"].get("annotations", {}).get("prometheus.io/port")
        if port is not None:
            out[f"prometheus.io/port on {obj['metadata'].get('name', 'pod template')}"] = int(port)
    return out


def test_ports_agree_across_files_and_equal_the_settings_default() -> None:
    ports = _ports()
    assert len(ports) >= 12, ports  # every place above was found
    wrong = {where: p for where, p in ports.items() if p != DEFAULT_PORT}
    assert not wrong, f"expected port {DEFAULT_PORT} (Settings.port default) everywhere: {wrong}"


def test_probe_script_defaults_to_the_settings_port() -> None:
    from deploy_helpers import load_deploy_module

    probe = load_deploy_module("bin/probe.py")
    assert int(probe.DEFAULT_PORT) == DEFAULT_PORT


# -- the container runs as non-root -------------------------------------------------------------

def test_dockerfile_final_stage_runs_as_a_numeric_non_root_user() -> None:
    users = dockerfile().final.args("USER")
    assert users, "the runtime stage must set USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert gid.isdigit() and int(gid) != 0, users[-1]
    # the user is created with that uid in the same stage
    runs = " ".join(dockerfile().final.args("RUN"))
    assert re.search(rf"useradd\b[^&]*--uid {uid}\b", runs), "useradd --uid must match USER"


def test_k8s_pod_runs_as_the_images_non_root_user() -> None:
    uid = int(dockerfile().final.args("USER")[-1].split(":")[0])
    pod = _daemonset()["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == uid
    csc = _container()["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert csc.get("privileged", False) is False


def test_compose_services_do_not_override_the_user() -> None:
    for name, svc in compose()["services"].items():
        assert str(svc.get("user", "10001")).split(":")[0] not in ("0", "root"), name


# -- Dockerfile ---------------------------------------------------------------------------------

def test_dockerfile_is_multi_stage_with_a_cpu_default_base_and_the_makefile_torch() -> None:
    df = dockerfile()
    assert len(df.stages) >= 2
    base_arg = df.stages[0].base.strip("${}")
    assert base_arg in df.global_args, "the base image is a build arg"
    assert "cuda" not in df.global_args[base_arg].lower(), "CPU is the default"
    assert all(s.base == df.stages[0].base for s in df.stages), "both stages share the base"
    torch_args = [a for s in df.stages for a in s.args("ARG") if a.startswith("TORCH_SPEC=")]
    assert torch_args, "TORCH_SPEC build arg"
    spec = torch_args[0].split("=", 1)[1].strip('"')
    makefile = (REPO / "Makefile").read_text()
    m = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", makefile, re.M)
    assert m, "Makefile TORCH_SPEC"
    assert spec == m.group(1), "the image pins the torch the Makefile pins"


def test_dockerfile_entrypoint_is_the_serve_command() -> None:
    import typer

    from kvhandoff.commands import serve

    (entry,) = dockerfile().final.args("ENTRYPOINT")
    assert json.loads(entry) == SIDECAR_COMMAND
    # the console script the image calls, and the command name serve registers
    scripts = re.search(r"\[project\.scripts\]\s*\n(.*?)(?:\n\[|\Z)",
                        (REPO / "pyproject.toml").read_text(), re.S)
    assert scripts and re.search(rf"^{SIDECAR_COMMAND[0]}\s*=", scripts.group(1), re.M)
    app = typer.Typer()
    app.callback()(lambda: None)
    serve.register(app)
    assert SIDECAR_COMMAND[1] in typer.main.get_command(app).commands  # type: ignore[attr-defined]


def test_dockerfile_copies_only_what_the_dockerignore_lets_through() -> None:
    patterns = dockerignore_patterns()
    sources: list[str] = []
    for stage in dockerfile().stages:
        for rest in stage.args("COPY"):
            words = [w for w in rest.split() if not w.startswith("--")]
            if "--from=" in rest:
                continue
            sources += words[:-1]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY source {src} does not exist in the repo"
        assert dockerignore_allows(patterns, src.rstrip("/")), f"{src} is excluded from the context"
    assert dockerignore_allows(patterns, "src/kvhandoff/settings.py")
    for excluded in (".venv/bin/python", ".git/HEAD", "tests/deploy/test_deploy_manifests.py",
                     "src/kvhandoff/__pycache__/settings.cpython-311.pyc"):
        assert not dockerignore_allows(patterns, excluded), excluded


def test_compose_entrypoints_are_installed_by_the_dockerfile() -> None:
    installed = {rest.split()[-1].rsplit("/", 1)[-1]
                 for rest in dockerfile().final.args("COPY") if "/usr/local/bin/" in rest}
    for name, svc in compose()["services"].items():
        for cmd in (svc.get("entrypoint", []), svc["healthcheck"]["test"]):
            tools = [w for w in cmd if w.startswith("kvhandoff-")]
            assert all(t in installed for t in tools), (name, tools, installed)


# -- docker compose -----------------------------------------------------------------------------

def test_compose_runs_a_sidecar_and_two_engines_that_wait_for_it() -> None:
    doc = compose()
    svc = doc["services"]
    assert set(svc) == {"bootstrap", "prefill", "decode"}
    assert "entrypoint" not in svc["bootstrap"], "the sidecar runs the image's kvhandoff serve"
    build = svc["bootstrap"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    for name in ("prefill", "decode"):
        s = svc[name]
        assert s["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        url = urlsplit(s["environment"][f"{ENV_PREFIX}BOOTSTRAP_URL"])
        assert url.hostname == "bootstrap"
        assert s["command"][s["command"].index("--role") + 1] == name
    for name, s in svc.items():
        assert s["healthcheck"]["test"][0] == "CMD", name
        assert s["ulimits"]["memlock"] == -1, name
        assert s["read_only"] is True, name


def test_compose_requires_a_token_instead_of_shipping_one() -> None:
    for name, s in compose()["services"].items():
        token = s["environment"][f"{ENV_PREFIX}AUTH_TOKEN"]
        assert re.fullmatch(rf"\$\{{{ENV_PREFIX}AUTH_TOKEN:\?[^}}]+\}}", token), (name, token)


# -- Kubernetes ---------------------------------------------------------------------------------

def test_daemonset_is_set_up_for_rdma_on_gpu_nodes() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    c = _container()
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["nodeSelector"], "scheduled on GPU nodes only"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/infiniband"]]["hostPath"]["path"] == "/dev/infiniband"
    rdma = {k: v for k, v in c["resources"]["requests"].items() if k.startswith("rdma/")}
    assert rdma, "an RDMA device-plugin resource is requested"
    # extended resources must be requested and limited alike
    assert {k: c["resources"]["limits"][k] for k in rdma} == rdma
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]


def test_daemonset_reads_settings_from_the_configmap_and_the_secret() -> None:
    (cm,) = k8s_kind("ConfigMap")
    (secret,) = k8s_kind("Secret")
    refs = {next(iter(e)): e[next(iter(e))]["name"] for e in _container()["envFrom"]}
    assert refs == {"configMapRef": cm["metadata"]["name"],
                    "secretRef": secret["metadata"]["name"]}
    assert "args" not in _container() and "command" not in _container()
    assert cm["data"][f"{ENV_PREFIX}REQUIRE_RDMA"] == "true"
    assert cm["data"][f"{ENV_PREFIX}HOST"] == "0.0.0.0"


def test_selectors_match_the_pod_labels_and_scrape_is_on() -> None:
    ds = _daemonset()
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for s in k8s_kind("Service"):
        assert s["spec"]["selector"].items() <= labels.items(), s["metadata"]["name"]
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
