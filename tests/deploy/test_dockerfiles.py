"""The images install what their side imports and nothing heavier, and start a command the CLI
really has. The operator image must never pull torch (docs/architecture.md, "Boundaries"). The
runtime images install through docker/install-runtime.sh, read here by running it dry."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
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

    def commands(self) -> list[list[str]]:
        """The words of each `&&`-joined command of the RUN instructions."""
        return [shlex.split(c) for args in self.all("RUN") for c in args.split("&&")]

    def pip_installs(self) -> list[list[str]]:
        """The argument lists of every `pip install` the image runs: in RUN instructions, and
        in docker/install-runtime.sh as the image calls it (run dry)."""
        installs = [words[2:] for words in self.commands() if words[:2] == ["pip", "install"]]
        for line in self.install_script_dry_run():
            words = shlex.split(line.removeprefix("+ "))
            if words[1:4] == ["-m", "pip", "install"]:
                installs.append(words[4:])
        return installs

    def install_script_call(self) -> tuple[dict[str, str], list[str]] | None:
        """(environment, arguments) of the RUN that calls docker/install-runtime.sh, ARG
        defaults substituted; None if the image does not."""
        args = {name: value for name, _, value in (a.partition("=") for a in self.all("ARG"))}
        for words in self.commands():
            if INSTALL_SCRIPT in words:
                at = words.index(INSTALL_SCRIPT)
                words = [substitute(w, args) for w in words]
                env = dict(w.partition("=")[::2] for w in words[: at - 1])
                return env, words[at + 1 :]
        return None

    def install_script_dry_run(self, compiler: bool = True) -> list[str]:
        """The commands docker/install-runtime.sh runs for this image (with or without a C
        compiler on the PATH), as DRY_RUN=1 prints them."""
        call = self.install_script_call()
        if call is None:
            return []
        env, args = call
        return dry_run_install_script(args, env, compiler)


INSTALL_SCRIPT = "docker/install-runtime.sh"


def substitute(word: str, args: dict[str, str]) -> str:
    for name, value in args.items():
        word = word.replace("${" + name + "}", value)
    return word


def dry_run_install_script(args: list[str], env: dict[str, str], compiler: bool) -> list[str]:
    """docker/install-runtime.sh's commands, printed, not run. Without `compiler` the PATH
    holds only the few tools the script needs, and no gcc."""
    path = os.environ["PATH"]
    if not compiler:
        tools = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"no-gcc-{os.getpid()}"
        tools.mkdir(exist_ok=True)
        for tool in ("sh", "mktemp", "dirname", "rm"):
            link = tools / tool
            if not link.exists():
                link.symlink_to(shutil.which(tool) or f"/bin/{tool}")
        path = str(tools)
    done = subprocess.run(
        ["sh", str(ROOT / INSTALL_SCRIPT), *args],
        env={**env, "PATH": path, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


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
            elif word in {"-c", "-r", "--constraint", "--requirement", "--index-url"}:
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
    dists = metadata.packages_distributions()
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
RUNTIME_CPU = parse_dockerfile(DOCKER / "runtime-cpu.Dockerfile")
OPERATOR = parse_dockerfile(DOCKER / "operator.Dockerfile")
RUNTIMES = pytest.mark.parametrize("image", [RUNTIME, RUNTIME_CPU], ids=["runtime", "runtime-cpu"])
IMAGES = pytest.mark.parametrize(
    "image", [RUNTIME, RUNTIME_CPU, OPERATOR], ids=["runtime", "runtime-cpu", "operator"]
)


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


@RUNTIMES
def test_runtime_image_installs_every_runtime_import_but_not_the_operator(image) -> None:
    reqs, local = requirements(image.pip_installs())
    assert local and all("--no-deps" in words for words in local)
    assert not OPERATOR_ONLY & reqs.keys()
    imports = third_party_imports("runtime", "kernels", "kvfleet")
    # The CPU image runs no Triton kernel (dispatch.py takes the C kernels and torch there).
    optional = {"triton"} if image is RUNTIME_CPU else set()
    missing = {d: sorted(f) for d, f in imports.items() if d not in reqs.keys() | optional}
    assert not missing, f"runtime image lacks packages its code imports: {missing}"


def test_gpu_image_pins_the_torch_and_triton_of_the_gpu_figures_and_a_c_compiler() -> None:
    reqs, _ = requirements(RUNTIME.pip_installs())
    assert str(reqs["torch"].specifier) == "==2.11.0"
    assert str(reqs["triton"].specifier) == "==3.6.0"
    env, args = RUNTIME.install_script_call() or ({}, [])
    assert args[0] == "cuda"
    assert env["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cu130"  # CUDA 13
    # Triton compiles a launcher per kernel at run time: without gcc in the base, the script
    # installs it; with one, it leaves it.
    without = RUNTIME.install_script_dry_run(compiler=False)
    assert "+ apt-get install -y --no-install-recommends gcc libc6-dev" in without
    assert not any("apt-get" in line for line in RUNTIME.install_script_dry_run())
    # Every later install is held to the pinned torch.
    later = [line for line in without if "pip install" in line and "torch==" not in line]
    assert later and all(" -c " in line or "--no-deps" in line for line in later)


def test_cpu_image_installs_the_cpu_torch_and_no_triton() -> None:
    installs = RUNTIME_CPU.pip_installs()
    reqs, _ = requirements(installs)
    env, args = RUNTIME_CPU.install_script_call() or ({}, [])
    assert args[0] == "cpu" and env["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "torch" in reqs and "triton" not in reqs
    # xgrammar is the one dependency that pulls Triton: the image installs it without its
    # dependencies, and every other one of them by name.
    with_deps = [words for words in installs if "--no-deps" not in words]
    assert "xgrammar" in reqs and "xgrammar" not in requirements(with_deps)[0]
    needed = {
        canonicalize_name(req.name)
        for req in map(Requirement, metadata.requires("xgrammar") or [])
        if req.marker is None or req.marker.evaluate({"extra": ""})
    }
    assert "triton" in needed, "xgrammar no longer needs Triton: install it with its deps"
    missing = needed - {"triton"} - reqs.keys()
    assert not missing, f"the CPU image lacks xgrammar's requirements {sorted(missing)}"
    lines = RUNTIME_CPU.install_script_dry_run(compiler=False)
    assert "+ apt-get install -y --no-install-recommends gcc libc6-dev" in lines


@pytest.mark.parametrize("name", ["runtime", "runtime-cpu", "operator"])
def test_image_copies_every_package_folder_it_installs(name: str) -> None:
    """`pip install .` needs every folder pyproject's package-dir names, in the build context
    (the image's .dockerignore lets it through) and copied before the install."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = set(setuptools["package-dir"].values())
    image = parse_dockerfile(DOCKER / f"{name}.Dockerfile")
    if image.install_script_call() is not None:
        folders.add(INSTALL_SCRIPT)
    copied = {shlex.split(args)[0].rstrip("/") for args in image.all("COPY")}
    assert folders <= copied, f"{name}.Dockerfile never copies {sorted(folders - copied)}"
    context = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().split()
    let_in = {line[1:].rstrip("/") for line in context if line.startswith("!")}
    assert folders <= let_in, f"{name}'s .dockerignore keeps out {sorted(folders - let_in)}"


@IMAGES
def test_image_pins_the_same_ranges_as_pyproject(image: Dockerfile) -> None:
    """The same ranges, or one version inside them (torch and Triton pinned for the GPUs)."""
    declared = pyproject_requirements()
    reqs, _ = requirements(image.pip_installs())
    for name, req in reqs.items():
        if name not in declared:
            continue
        pins = [spec.version for spec in req.specifier if spec.operator == "=="]
        if pins:
            assert declared[name].specifier.contains(pins[0]), f"{name}: {req} vs {declared[name]}"
        else:
            assert req.specifier == declared[name].specifier, f"{name}: {req} vs {declared[name]}"


@IMAGES
def test_image_runs_as_a_numeric_non_root_user(image: Dockerfile) -> None:
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    user = image.all("USER")[-1]
    assert all(part.isdigit() and int(part) != 0 for part in user.split(":")), user


@RUNTIMES
def test_runtime_image_has_a_model_cache_volume_and_no_healthcheck(image) -> None:
    env = image.env()
    volumes = [v for args in image.all("VOLUME") for v in json.loads(args)]
    assert volumes
    for key in ("KVFLEET_CACHE_DIR", "HF_HOME"):
        assert any(env[key].startswith(v) for v in volumes), f"{key} is not on a volume"
    assert not image.all("HEALTHCHECK") and not OPERATOR.all("HEALTHCHECK")


@pytest.mark.parametrize(
    "image,subcommand",
    [(RUNTIME, "serve"), (RUNTIME_CPU, "serve"), (OPERATOR, "operator")],
    ids=["runtime", "runtime-cpu", "operator"],
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
