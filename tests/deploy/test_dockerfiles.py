"""The two images install what their side imports and nothing heavier, and start a command the
CLI really has. The operator image must never pull torch (docs/architecture.md, "Boundaries")."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
HEAVY = {"torch", "triton", "transformers", "accelerate", "safetensors", "tokenizers", "gguf"}
OPERATOR_ONLY = {"kopf", "kubernetes"}


@dataclass(slots=True)
class Dockerfile:
    """The instructions that matter here, with line continuations joined."""

    froms: list[str] = field(default_factory=list)
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def exec_form(self, keyword: str) -> list[str]:
        args = self.all(keyword)
        assert args, f"no {keyword}"
        return json.loads(args[-1])

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for args in self.all("ENV"):
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
        return env

    def pip_installs(self) -> list[list[str]]:
        """The argument lists of every `pip install` in RUN instructions."""
        installs = []
        for args in self.all("RUN"):
            for command in args.split("&&"):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    installs.append(words[2:])
        return installs


def parse_dockerfile(path: Path) -> Dockerfile:
    df = Dockerfile()
    args: dict[str, str] = {}
    logical = path.read_text().replace("\\\n", " ")
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        if keyword == "FROM":
            for name, default in args.items():
                rest = rest.replace("${" + name + "}", default)
            df.froms.append(rest)
        df.instructions.append((keyword, rest))
    return df


def requirements(installs: list[list[str]]) -> tuple[dict[str, Requirement], list[list[str]]]:
    """(third-party requirements by canonical name, argument lists that install a local path)."""
    reqs: dict[str, Requirement] = {}
    local = []
    for words in installs:
        skip_next = False
        for word in words:
            if skip_next:
                skip_next = False
            elif word in {"-c", "-r", "--constraint", "--requirement"}:
                skip_next = True
            elif word.startswith("-"):
                continue
            elif word.startswith((".", "/")):
                local.append(words)
            else:
                req = Requirement(word)
                reqs[canonicalize_name(req.name)] = req
    return reqs, local


def third_party_imports(*folders: str, files: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Distribution name -> the .py files that import it, for every non-stdlib, non-kvfleet
    import (function-local ones too) in the given folders and their sub-folders."""
    dists = packages_distributions()
    found: dict[str, set[str]] = {}
    paths = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    paths += [ROOT / f for f in files]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in {"kvfleet", "__future__"}:
                    continue
                assert top in dists, (
                    f"{path.name} imports {top!r}, which no installed package provides"
                )
                for dist in dists[top]:
                    found.setdefault(canonicalize_name(dist), set()).add(path.name)
    return found


def pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["triton"]
    return {canonicalize_name(Requirement(r).name): Requirement(r) for r in listed}


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


RUNTIME = parse_dockerfile(DOCKER / "runtime.Dockerfile")
OPERATOR = parse_dockerfile(DOCKER / "operator.Dockerfile")


def test_operator_image_installs_no_torch_and_kvfleet_without_deps() -> None:
    reqs, local = requirements(OPERATOR.pip_installs())
    assert not HEAVY & reqs.keys(), f"operator image installs {sorted(HEAVY & reqs.keys())}"
    assert local, "operator image never installs kvfleet"
    assert all("--no-deps" in words for words in local), "kvfleet's own deps include torch"
    assert {"kopf", "kubernetes", "aiohttp", "prometheus-client", "pyyaml"} <= reqs.keys()
    assert "slim" in OPERATOR.froms[-1] and "python" in OPERATOR.froms[-1]


# `kvfleet demo autoscale` emulates a cluster (kmock) and plots (matplotlib): it runs from a
# source checkout with the dev extra, never in the operator image, which stays small.
SOURCE_CHECKOUT_ONLY = {"cmd_demo.py": {"kmock", "matplotlib"}}


def test_operator_image_installs_every_operator_import() -> None:
    reqs, _ = requirements(OPERATOR.pip_installs())
    # runtime/cli.py is the console script's entry point, so the operator image runs it too,
    # and it imports every command module to build its parser, `kvfleet demo`'s included.
    cli = ("runtime/cli.py", "devcluster/demo/cmd_demo.py")
    imports = third_party_imports("operator", "kvfleet", files=cli)
    for file, dists in SOURCE_CHECKOUT_ONLY.items():
        for dist in dists:
            imports.get(dist, set()).discard(file)
    missing = {d: sorted(f) for d, f in imports.items() if f and d not in reqs}
    assert not missing, f"operator image lacks packages its code imports: {missing}"


def test_runtime_image_installs_every_runtime_import_but_not_the_operator() -> None:
    reqs, local = requirements(RUNTIME.pip_installs())
    assert local and all("--no-deps" in words for words in local)
    assert not OPERATOR_ONLY & reqs.keys()
    # torch comes with the base image, so it must not be installed again over it.
    assert "torch" not in reqs
    imports = third_party_imports("runtime", "kernels", "kvfleet")
    missing = {d: sorted(f) for d, f in imports.items() if d not in reqs and d != "torch"}
    assert not missing, f"runtime image lacks packages its code imports: {missing}"
    assert "triton" in reqs


@pytest.mark.parametrize("name", ["runtime", "operator"])
def test_image_copies_every_package_folder_it_installs(name: str) -> None:
    """`pip install .` needs every folder pyproject's package-dir names, in the build context
    (the image's .dockerignore lets it through) and copied before the install."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = set(setuptools["package-dir"].values())
    image = parse_dockerfile(DOCKER / f"{name}.Dockerfile")
    copied = {shlex.split(args)[0].rstrip("/") for args in image.all("COPY")}
    assert folders <= copied, f"{name}.Dockerfile never copies {sorted(folders - copied)}"
    context = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().split()
    let_in = {line[1:].rstrip("/") for line in context if line.startswith("!")}
    assert folders <= let_in, f"{name}'s .dockerignore keeps out {sorted(folders - let_in)}"


@pytest.mark.parametrize("image", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_image_pins_the_same_ranges_as_pyproject(image: Dockerfile) -> None:
    declared = pyproject_requirements()
    reqs, _ = requirements(image.pip_installs())
    for name, req in reqs.items():
        if name in declared:
            assert req.specifier == declared[name].specifier, f"{name}: {req} vs {declared[name]}"


def test_runtime_base_image_has_cuda_torch() -> None:
    base = RUNTIME.froms[-1]
    assert base.startswith("pytorch/pytorch:") and "cuda" in base and "runtime" in base


@pytest.mark.parametrize("image", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_image_runs_as_a_numeric_non_root_user(image: Dockerfile) -> None:
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    user = image.all("USER")[-1]
    assert all(part.isdigit() and int(part) != 0 for part in user.split(":")), user


def test_runtime_image_has_a_model_cache_volume_and_no_healthcheck() -> None:
    env = RUNTIME.env()
    volumes = [v for args in RUNTIME.all("VOLUME") for v in json.loads(args)]
    assert volumes
    for key in ("KVFLEET_CACHE_DIR", "HF_HOME"):
        assert any(env[key].startswith(v) for v in volumes), f"{key} is not on a volume"
    assert not RUNTIME.all("HEALTHCHECK") and not OPERATOR.all("HEALTHCHECK")


@pytest.mark.parametrize(
    "image,subcommand", [(RUNTIME, "serve"), (OPERATOR, "operator")], ids=["runtime", "operator"]
)
def test_entrypoint_is_a_kvfleet_subcommand(image: Dockerfile, subcommand: str) -> None:
    from kvfleet.runtime import cli

    entrypoint = image.exec_form("ENTRYPOINT")
    assert entrypoint == ["kvfleet", subcommand]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["kvfleet"] == "kvfleet.runtime.cli:main"
    module = next((m for m in cli.COMMAND_MODULES if m.endswith(f".cmd_{subcommand}")), None)
    assert module is not None, f"no cmd_{subcommand} in COMMAND_MODULES"
    if importlib.util.find_spec(module) is not None:
        assert subcommand in subcommands(cli.build_parser())
