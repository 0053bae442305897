"""One uid and gid for every kvfleet container: kvfleet.contract.KVFLEET_UID. The images create
that user, and every pod — the operator's (chart, kustomize) and the runtime pods the operator
renders — runs as it. A pod running as another uid has no passwd entry (kopf's getpass fails)
and cannot write what the image made its own (the model cache)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from shipped_objects import ROOT, VALUES_ALL, chart_objects, manifest_objects, runtime_children

from kvfleet import contract

UID = contract.KVFLEET_UID
ID_FIELDS = ("runAsUser", "runAsGroup", "fsGroup")
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def ids_in(obj: object, where: str = "") -> list[tuple[str, int]]:
    """Every runAsUser / runAsGroup / fsGroup in an object, with where it was found."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ID_FIELDS:
                found.append((f"{where}.{key}", value))
            else:
                found += ids_in(value, f"{where}.{key}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found += ids_in(item, f"{where}[{i}]")
    return found


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    ]


SOURCES = {
    "chart": chart_objects({}) + chart_objects(VALUES_ALL),
    "manifests": manifest_objects(),
    "operator's runtime pods": runtime_children(),
}


@pytest.mark.parametrize("source", SOURCES)
def test_every_pod_runs_as_the_one_uid(source: str) -> None:
    specs = pod_specs(SOURCES[source])
    assert specs, f"{source}: no pod template"
    for name, spec in specs:
        security = spec.get("securityContext") or {}
        assert security.get("runAsUser") == UID, f"{source} {name}: runAsUser"
        assert security.get("runAsGroup") == UID, f"{source} {name}: runAsGroup"
        others = [(w, v) for w, v in ids_in(spec, name) if v != UID]
        assert not others, f"{source}: ids other than {UID}: {others}"


def test_runtime_pods_volumes_belong_to_the_uid() -> None:
    # fsGroup makes mounted volumes (the model cache) writable by the runtime's group.
    for name, spec in pod_specs(runtime_children()):
        assert spec["securityContext"]["fsGroup"] == UID, name


def dockerfile_ids(path: Path) -> dict[str, list[str]]:
    """The uids and gids a Dockerfile names: useradd/groupadd, chown and USER."""
    text = path.read_text().replace("\\\n", " ")
    owners = re.findall(r"chown\s+(?:-\S+\s+)*(\S+)", text)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    return {
        "useradd/groupadd": re.findall(r"--(?:uid|gid)\s+(\S+)", text),
        "chown": [i for owner in owners for i in owner.split(":")],
        "USER": [i for user in users for i in user.split(":")],
    }


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_create_and_run_as_the_one_uid(dockerfile: Path) -> None:
    ids = dockerfile_ids(dockerfile)
    assert ids["useradd/groupadd"] and ids["USER"], f"{dockerfile.name}: no user created/used"
    for what, values in ids.items():
        assert all(v == str(UID) for v in values), f"{dockerfile.name} {what}: {values}"
    # uid and gid both: a USER without a group runs with the user's primary group, which
    # useradd picks by itself unless --gid says it.
    assert len(ids["USER"]) == 2 and "--gid" in dockerfile.read_text()


def test_the_chart_defines_the_uid_once() -> None:
    # Every template takes the uid from one helper, so a change is one edit (and this test).
    templates = (ROOT / "charts" / "kvfleet" / "templates").glob("*.yaml")
    literal = [p.name for p in templates if re.search(r"\b(runAsUser|runAsGroup|fsGroup):\s*\d", p.read_text())]  # fmt: skip
    assert not literal, f'uid written out in {literal} instead of include "kvfleet.uid"'
