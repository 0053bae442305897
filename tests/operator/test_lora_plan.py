"""The adapters' decisions as pure functions: which pods can take adapters, what to unload and
load on one, status.loras from a pass's outcomes, the Events it posts, and the Degraded
condition the reconciler derives from status.loras."""

from __future__ import annotations

import copy
from typing import Any

from kvfleet.operator import conditions as c
from kvfleet.operator.lora_plan import (
    LoraPod,
    lora_pods,
    plan_pod,
    retry_delay,
    wanted_adapters,
)
from kvfleet.operator.lora_spec import LoraSpec
from kvfleet.operator.lora_status import PodOutcome, lora_problem, loras_status, pass_events
from kvfleet.operator.status import compute_status

SQL = LoraSpec(name="sql", source="hf://org/sql")
DOCS = LoraSpec(name="docs", source="pvc://team/docs")
WANTED = wanted_adapters([SQL, DOCS])
POD = LoraPod(
    name="chat-a", uid="u-a", ip="10.0.0.1", lora_enabled=True, claims=frozenset({"team"})
)


def test_wanted_adapters_carry_the_path_the_runtime_is_given_and_their_claim():
    sql, docs = WANTED
    assert (sql.path, sql.claim) == ("hf://org/sql", "")
    assert (docs.path, docs.claim) == ("/models/team/docs", "team")


def test_a_new_pod_gets_every_adapter():
    plan = plan_pod(POD, WANTED, listed={}, ours={}, held_back={})
    assert [w.name for w in plan.load] == ["sql", "docs"]
    assert plan.unload == () and plan.kept == {} and plan.waiting == {}


def test_loaded_adapters_stay_strays_go_and_a_new_source_is_reloaded():
    listed = {"sql": "hf://org/sql", "docs": "/models/team/docs-v0", "stray": "/x"}
    plan = plan_pod(POD, WANTED, listed=listed, ours={}, held_back={})
    assert plan.kept == {"sql": "hf://org/sql"}
    assert plan.unload == ("docs", "stray")
    assert [w.name for w in plan.load] == ["docs"]


def test_what_the_operator_loaded_wins_over_the_form_the_runtime_reports_it_in():
    # A runtime that reports the downloaded folder as root: no reload loop for it.
    listed = {"sql": "/cache/hub/models--org--sql/snapshots/abc"}
    plan = plan_pod(POD, WANTED[:1], listed=listed, ours={"sql": "hf://org/sql"}, held_back={})
    assert plan.kept == {"sql": "hf://org/sql"} and plan.unload == () and plan.load == ()


def test_a_held_back_refusal_is_not_tried_and_an_unmounted_claim_waits():
    pod = LoraPod(name="chat-b", uid="u-b", ip="10.0.0.2", lora_enabled=True, claims=frozenset())
    plan = plan_pod(pod, WANTED, listed={}, ours={}, held_back={"sql": "rank 64 > 16"})
    assert plan.load == ()
    assert plan.waiting == {
        "docs": "pod chat-b does not mount claim team yet (its replacement will)"
    }
    assert retry_delay(1) == 60 and retry_delay(2) == 120 and retry_delay(10) == 900


def pod(name: str, **over: Any) -> dict[str, Any]:
    obj = {
        "metadata": {"name": name, "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {"name": "runtime", "args": ["serve", "--enable-lora"],
                 "volumeMounts": [{"name": "model", "mountPath": "/models/base"},
                                  {"name": "scratch", "mountPath": "/models/other"}]},
                {"name": "sidecar", "args": []},
            ],
            "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "base"}},
                        {"name": "scratch", "persistentVolumeClaim": {"claimName": "elsewhere"}}],
        },
        "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip
    for path, value in over.items():
        section, key = path.split("__")
        obj[section][key] = value
    return obj


def test_only_ready_pods_with_an_ip_are_worked_on_and_their_flags_and_claims_read():
    plain = pod("c")
    plain["spec"]["containers"][0]["args"] = ["serve"]
    found = lora_pods(
        [
            pod("b"),
            plain,
            pod("d", status__conditions=[{"type": "Ready", "status": "False"}]),
            pod("e", metadata__deletionTimestamp="2026-01-01T00:00:00Z"),
            pod("f", status__podIP=""),
        ]
    )
    assert [(p.name, p.lora_enabled) for p in found] == [("b", True), ("c", False)]
    # A claim counts where the runtime mounts it at /models/<claim>.
    assert found[0].claims == frozenset({"base"}) and found[0].uid == "uid-b"


PATHS = {"sql": "hf://org/sql", "docs": "/models/team/docs"}


def test_status_says_where_each_adapter_is_and_why_not_elsewhere():
    outcomes = [
        PodOutcome("a", loaded=dict(PATHS)),
        PodOutcome("b", loaded={"sql": "hf://org/sql"}, waiting={"docs": "pod b: HTTP 503"}),
    ]
    sql, docs = loras_status([SQL, DOCS], PATHS, outcomes)
    assert sql == {
        "name": "sql",
        "source": "hf://org/sql",
        "loadedReplicas": 2,
        "pods": ["a", "b"],
        "state": "Loaded",
        "message": "",
    }
    assert (docs["state"], docs["loadedReplicas"], docs["pods"]) == ("Loading", 1, ["a"])
    assert docs["message"] == "loaded on 1 of 2 ready replicas; pod b: HTTP 503"
    (pending,) = loras_status([SQL], PATHS, [])
    assert (pending["state"], pending["loadedReplicas"]) == ("Pending", 0)
    # A pod that could not be read at all counts as one without it.
    (down,) = loras_status([SQL], PATHS, [PodOutcome("a", error="pod a: no answer")])
    assert (down["state"], down["message"]) == ("Loading", "loaded on 0 of 1 ready replicas; pod a: no answer")  # fmt: skip


def test_a_refusal_makes_the_adapter_rejected_with_the_runtimes_words():
    outcomes = [
        PodOutcome(p, refused={"sql": "its rank 64 is above --max-lora-rank 16"}) for p in "abcd"
    ]
    (sql,) = loras_status([SQL], PATHS, outcomes)
    assert sql["state"] == "Rejected"
    assert sql["message"] == (
        "pod a: its rank 64 is above --max-lora-rank 16; pod b: its rank 64 is above "
        "--max-lora-rank 16; pod c: its rank 64 is above --max-lora-rank 16 (and 1 more)"
    )


def test_degraded_names_each_refused_adapter_spec_loras_still_lists():
    reported = loras_status(
        [SQL, DOCS], PATHS, [PodOutcome("a", refused={"sql": "no adapter_config.json"}, loaded={"docs": PATHS["docs"]})]
    )  # fmt: skip
    problem = lora_problem([SQL, DOCS], reported)
    assert problem == c.Condition(
        c.DEGRADED,
        c.TRUE,
        "LoraAdapterRejected",
        "adapter sql (hf://org/sql) was refused: pod a: no adapter_config.json",
    )
    # Gone from spec.loras, or there from another source: no longer a problem.
    assert lora_problem([DOCS], reported) is None
    assert lora_problem([LoraSpec(name="sql", source="hf://org/sql-v2"), DOCS], reported) is None
    assert lora_problem([SQL], None) is None


def test_a_refusal_is_announced_once_and_loads_and_unloads_once_per_pass():
    sources = {"sql": SQL.source, "docs": DOCS.source}
    outcomes = [
        PodOutcome("a", refused={"sql": "rank 64"}, newly_loaded=("docs",), unloaded=("old",)),
        PodOutcome("b", refused={"sql": "rank 64"}, newly_loaded=("docs",)),
    ]
    events, announced = pass_events(outcomes, sources, set())
    assert events == [
        ("Warning", "LoraAdapterRejected", "adapter sql (hf://org/sql) refused by pod a: rank 64"),
        ("Normal", "LoraAdaptersLoaded", "loaded docs on pod a; docs on pod b"),
        ("Normal", "LoraAdaptersUnloaded", "unloaded old on pod a"),
    ]
    again, announced = pass_events(
        [PodOutcome("a", refused={"sql": "rank 64"})], sources, announced
    )
    assert again == []
    # Once loaded (or gone), a later refusal is news again.
    _, announced = pass_events([PodOutcome("a", loaded={"sql": SQL.source})], sources, announced)
    events, _ = pass_events([PodOutcome("a", refused={"sql": "rank 64"})], sources, announced)
    assert [e[1] for e in events] == ["LoraAdapterRejected"]


ISVC = {
    "metadata": {"name": "chat", "namespace": "ml", "generation": 2, "uid": "u"},
    "spec": {"model": {"uri": "bundled"}, "loras": [{"name": "sql", "source": "hf://org/sql"}]},
}
DEPLOYMENT = {
    "metadata": {"generation": 1, "annotations": {"kvfleet.dev/generation": "2"}},
    "spec": {"replicas": 1},
    "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1},
}  # fmt: skip


def test_the_reconciler_turns_a_rejected_adapter_into_degraded_and_keeps_ready():
    isvc = copy.deepcopy(ISVC)
    isvc["status"] = {"loras": [{"name": "sql", "source": "hf://org/sql", "state": "Rejected", "message": "pod a: rank 64"}]}  # fmt: skip
    conds = {x["type"]: x for x in compute_status(isvc, DEPLOYMENT, now="t")["conditions"]}
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == (
        "True",
        "LoraAdapterRejected",
    )
    assert conds["Degraded"]["message"] == "adapter sql (hf://org/sql) was refused: pod a: rank 64"
    assert conds["Ready"]["status"] == "True"  # the model and the other adapters still serve
    isvc["status"]["loras"][0]["state"] = "Loaded"
    conds = {x["type"]: x for x in compute_status(isvc, DEPLOYMENT, now="t")["conditions"]}
    assert conds["Degraded"]["status"] == "False"


def test_status_loras_goes_with_the_last_adapter():
    isvc = copy.deepcopy(ISVC)
    isvc["status"] = {"loras": [{"name": "sql", "state": "Loaded"}]}
    assert "loras" not in compute_status(isvc, DEPLOYMENT, now="t")  # the loop keeps it
    isvc["spec"]["loras"] = []
    assert compute_status(isvc, DEPLOYMENT, now="t")["loras"] is None  # a merge patch's delete
