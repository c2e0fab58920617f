"""Helpers for the deploy/ checks: paths, YAML, a small Dockerfile reader, settings names.

Nothing here needs a Docker engine or a cluster: the files are read and checked against the
code they deploy (the `Settings` class, the routes of `create_app`, the `serve` command).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from kvhandoff.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
UNIT = DEPLOY / "systemd" / "kvhandoff.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "kvhandoff.env.example"

ENV_PREFIX = str(Settings.model_config.get("env_prefix", ""))
# a name, or a family written as PREFIX_FAULT_* in prose
ENV_RE = re.compile(rf"\b{re.escape(ENV_PREFIX)}[A-Z0-9_]*[A-Z0-9](?:_\*)?")
DEFAULT_PORT: int = Settings.model_fields["port"].default


def setting_env_names() -> dict[str, str]:
    """KVHANDOFF_<FIELD> -> field name, for every field of Settings."""
    return {f"{ENV_PREFIX}{name}".upper(): name for name in Settings.model_fields}


def load_deploy_module(relpath: str) -> ModuleType:
    """Import a script of deploy/ (not a package) by path."""
    path = DEPLOY / relpath
    name = "deploy_" + re.sub(r"\W", "_", relpath.removesuffix(".py"))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path, doc) for doc in yaml_docs(path)]
    return out


def k8s_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in k8s_objects() if doc.get("kind") == kind]


def compose() -> dict[str, Any]:
    docs = yaml_docs(COMPOSE)
    assert len(docs) == 1
    doc: dict[str, Any] = docs[0]
    return doc


# -- Dockerfile ---------------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse_dockerfile(text: str) -> Dockerfile:
    """Instructions per stage (continuations joined, comments dropped). Enough for our file."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continuation
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "dangling line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {line!r}"
            key, _, value = rest.partition("=")
            global_args[key] = value.strip('"')
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(global_args=global_args, stages=stages)


def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def dockerfile_env(stage: Stage) -> dict[str, str]:
    """ENV key=value pairs of a stage (the `ENV a=1 b=2` form)."""
    env: dict[str, str] = {}
    for rest in stage.args("ENV"):
        for token in rest.split():
            key, sep, value = token.partition("=")
            assert sep, f"use the ENV key=value form: {rest!r}"
            env[key] = value.strip('"')
    return env


def dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Whether `path` (relative to the context) reaches the builder: last matching rule wins.

    Covers the rule shapes our file uses: ``*``, ``!name``, ``!dir/``, ``**/glob``.
    """
    import fnmatch

    allowed = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if hit:
            allowed = negate
    return allowed


def dockerignore_patterns() -> list[str]:
    return [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()
            if ln.strip() and not ln.strip().startswith("#")]
