"""Server-side apply and field ownership (`metadata.managedFields`), after the API server's
structured-merge-diff, small enough to read.

A field set is a set of paths; a path's elements are `("f", name)` for an object field,
`("k", '{"name":"runtime"}')` for the item of a map-list with those key values, and
`("v", '"x"')` for the item of a set-list. Members are the leaves (scalars, atomic lists and
maps, empty objects) and the list items themselves, as in the server's FieldsV1 encoding.

Lists merge as their schema says (`Shape.list_type`): `map` lists (containers and env by
name, ports by containerPort+protocol, volumes by name, volumeMounts by mountPath,
ownerReferences by uid, conditions by type, topologySpreadConstraints...) merge item by item;
`set` lists (finalizers) merge by value; every other list (args, command, tolerations, and
any list a CRD does not mark) is atomic: replaced whole, owned whole.

Apply (`PATCH`, `application/apply-patch+yaml`, `fieldManager=M`):
1. merge the applied configuration into the live object;
2. remove what M applied last time and no longer applies, unless another manager owns it;
3. a field M changes that another manager owns is a conflict: 409, or with `force=true` the
   other manager loses it;
4. M's Apply entry becomes exactly the applied configuration's field set.
Any other write (create, update, merge/JSON patch, scale) makes its manager (the `fieldManager`
parameter, else the User-Agent's product name) own what it changed, taking it from others.
"""

from __future__ import annotations

import copy
import datetime
import json
from dataclasses import dataclass, field
from typing import Any

from kvfleet.devcluster.apiserver.api_status import ApiError, Cause
from kvfleet.devcluster.apiserver.builtin_schemas import Shape

Element = tuple[str, str]
Path = tuple[Element, ...]
ITEM = object()  # a list item's own path: its contents are compared through its fields
# Fields the server owns; never part of anyone's field set (as the API server strips them).
SERVER_META = (
    "name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
    "managedFields", "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds",
)  # fmt: skip


def _key(item: Any, shape: Shape) -> str:
    if shape.list_type == "map" and isinstance(item, dict):
        keys = {k: item[k] for k in shape.list_keys if k in item}
        return json.dumps(keys, sort_keys=True, separators=(",", ":"))
    return json.dumps(item, sort_keys=True, separators=(",", ":"))


def _element(item: Any, shape: Shape) -> Element:
    return ("k" if shape.list_type == "map" else "v", _key(item, shape))


def _granular_list(value: Any, shape: Shape) -> bool:
    return isinstance(value, list) and bool(value) and shape.list_type in ("map", "set")


def flatten(value: Any, shape: Shape, prefix: Path = ()) -> dict[Path, Any]:
    """Every member path of `value` with its value (list items map to ITEM)."""
    out: dict[Path, Any] = {}
    _flatten(value, shape, prefix, out)
    return out


def _flatten(value: Any, shape: Shape, prefix: Path, out: dict[Path, Any]) -> None:
    if isinstance(value, dict) and value and not shape.atomic:
        for k, v in value.items():
            _flatten(v, shape.field(k), (*prefix, ("f", k)), out)
    elif _granular_list(value, shape):
        for item in value:
            path = (*prefix, _element(item, shape))
            if shape.list_type == "set":
                out[path] = item
                continue
            out[path] = ITEM
            for k, v in item.items():
                _flatten(v, shape.item().field(k), (*path, ("f", k)), out)
    elif prefix:
        out[prefix] = value


def strip(obj: dict[str, Any], subresource: str | None, has_status: bool) -> dict[str, Any]:
    """The part of `obj` whose fields are tracked for a write to `subresource`."""
    if subresource == "status":
        return {"status": obj["status"]} if "status" in obj else {}
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    if has_status:
        out.pop("status", None)
    if "metadata" in out:
        out["metadata"] = {k: v for k, v in out["metadata"].items() if k not in SERVER_META}
        if not out["metadata"]:
            del out["metadata"]
    return out


# --- merging ----------------------------------------------------------------------------------
def merge(live: Any, applied: Any, shape: Shape) -> Any:
    """`applied` merged into `live`: objects field by field, map/set lists item by item."""
    if isinstance(live, dict) and isinstance(applied, dict) and not shape.atomic:
        out = copy.deepcopy(live)
        for k, v in applied.items():
            out[k] = merge(live[k], v, shape.field(k)) if k in live else copy.deepcopy(v)
        return out
    if isinstance(live, list) and isinstance(applied, list) and shape.list_type != "atomic":
        return _merge_list(live, applied, shape)
    return copy.deepcopy(applied)


def _merge_list(live: list[Any], applied: list[Any], shape: Shape) -> list[Any]:
    """structured-merge-diff's order: applied items in applied order; live-only items keep
    their place relative to the items around them."""
    lk = [_key(x, shape) for x in live]
    rk = [_key(x, shape) for x in applied]
    lmap, rmap = dict(zip(lk, live, strict=True)), dict(zip(rk, applied, strict=True))
    shared = [k for k in rk if k in lmap]
    next_shared = shared.pop(0) if shared else None
    done: set[str] = set()
    out: list[Any] = []
    li = ri = 0

    def take(k: str) -> None:
        nonlocal next_shared
        done.add(k)
        both = k in lmap and shape.list_type == "map"
        out.append(merge(lmap[k], rmap[k], shape.item()) if both else copy.deepcopy(rmap[k]))
        if k == next_shared:
            next_shared = shared.pop(0) if shared else None

    while li < len(lk) or ri < len(rk):
        if li < len(lk) and ri < len(rk):
            if lk[li] == rk[ri]:
                take(rk[ri])
                li, ri = li + 1, ri + 1
                continue
            if lk[li] in rmap and next_shared is not None and next_shared != lk[li]:
                li += 1  # a shared item, placed later in applied order
                continue
        if li < len(lk):
            if lk[li] not in rmap:
                out.append(copy.deepcopy(live[li]))
                li += 1
                continue
            if lk[li] in done:
                li += 1
                continue
        if ri < len(rk):
            take(rk[ri])
            ri += 1
    return out


def remove(obj: dict[str, Any], path: Path) -> None:
    """Delete the member at `path`, and any object or list that removal leaves empty."""
    trail: list[tuple[Any, Any]] = []  # (container, index or key) from the root down
    node: Any = obj
    for kind, name in path:
        if kind == "f" and isinstance(node, dict) and name in node:
            trail.append((node, name))
            node = node[name]
        elif kind in "kv" and isinstance(node, list):
            index = _find(node, kind, name)
            if index is None:
                return
            trail.append((node, index))
            node = node[index]
        else:
            return  # already gone
    while trail:
        container, where = trail.pop()
        del container[where]
        if container or not trail:
            return


def _find(items: list[Any], kind: str, key: str) -> int | None:
    want = json.loads(key)
    for i, item in enumerate(items):
        if kind == "v" and item == want:
            return i
        if (
            kind == "k"
            and isinstance(item, dict)
            and all(item.get(k) == v for k, v in want.items())
        ):
            return i
    return None


# --- managedFields ----------------------------------------------------------------------------
@dataclass(slots=True)
class Entry:
    """One managedFields entry: who, how (Apply or Update), through which subresource."""

    manager: str
    operation: str
    subresource: str | None
    api_version: str
    time: str
    fields: set[Path] = field(default_factory=set)

    @property
    def identity(self) -> tuple[str, str, str | None]:
        return (self.manager, self.operation, self.subresource)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(self.fields),
        }
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for kind, name in path:
            node = node.setdefault(f"{kind}:{name}", {})
        if path and path[-1][0] == "k":
            node["."] = {}
    return tree


def from_fields_v1(tree: dict[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, sub in tree.items():
        if key == ".":
            out.add(prefix)
            continue
        kind, _, name = key.partition(":")
        path = (*prefix, (kind, name))
        if sub:
            out |= from_fields_v1(sub, path)
        else:
            out.add(path)
    return out


def read_entries(obj: dict[str, Any] | None) -> list[Entry]:
    entries = []
    for e in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        entries.append(
            Entry(
                e["manager"],
                e["operation"],
                e.get("subresource"),
                e.get("apiVersion", ""),
                e.get("time", ""),
                from_fields_v1(e.get("fieldsV1") or {}),
            )
        )
    return entries


def write_entries(obj: dict[str, Any], entries: list[Entry]) -> None:
    kept = [e.as_dict() for e in entries if e.fields]
    if kept:
        obj["metadata"]["managedFields"] = kept
    else:
        obj["metadata"].pop("managedFields", None)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _entry(entries: list[Entry], identity: tuple[str, str, str | None], api_version: str) -> Entry:
    for e in entries:
        if e.identity == identity:
            return e
    entry = Entry(*identity, api_version=api_version, time=_now())
    entries.append(entry)
    return entry


def _changes(before: dict[Path, Any], after: dict[Path, Any]) -> tuple[set[Path], set[Path]]:
    """(added or modified, removed) member paths between two flattened objects."""
    changed = {p for p, v in after.items() if p not in before or (v is not ITEM and before[p] != v)}
    return changed, set(before) - set(after)


def record_update(
    old: dict[str, Any] | None,
    new: dict[str, Any],
    manager: str,
    subresource: str | None,
    shape: Shape,
    has_status: bool,
) -> None:
    """Give `manager` (operation Update) the fields this write changed, taking them from others."""
    tracked = "status" if subresource == "status" else None
    before = flatten(strip(old or {}, tracked, has_status), shape)
    after = flatten(strip(new, tracked, has_status), shape)
    changed, removed = _changes(before, after)
    if subresource == "scale":
        changed &= {(("f", "spec"), ("f", "replicas"))}
    entries = read_entries(old)
    if changed:
        mine = _entry(entries, (manager, "Update", subresource), new.get("apiVersion", ""))
        for e in entries:
            e.fields -= removed if e is mine else changed | removed
        mine.fields |= changed
        mine.time = _now()
    else:
        for e in entries:
            e.fields -= removed
    write_entries(new, entries)


def apply(
    live: dict[str, Any] | None,
    applied: dict[str, Any],
    manager: str,
    *,
    force: bool,
    subresource: str | None,
    shape: Shape,
    has_status: bool,
) -> dict[str, Any]:
    """The object after `manager` applies `applied`, managedFields included; ApiError 409 on
    conflicts without `force`."""
    config = strip(applied, subresource, has_status)
    applied_set = set(flatten(config, shape))
    entries = read_entries(live)
    identity = (manager, "Apply", subresource)
    last = next((e.fields for e in entries if e.identity == identity), set())
    others = [e for e in entries if e.identity != identity]
    base = copy.deepcopy(live) if live is not None else {}
    new = merge(base, config, shape) if live is not None else copy.deepcopy(applied)
    if live is None and subresource != "status":
        new.pop("status", None) if has_status else None
    owned_elsewhere = set().union(*(e.fields for e in others)) if others else set()
    keep = applied_set | owned_elsewhere
    removed: list[Path] = []
    for path in sorted(last - applied_set, key=lambda p: (len(p), p)):  # items first
        if any(path[: len(r)] == r for r in removed):
            continue  # went with its parent
        # Still applied, or owned (it or something below it) by another manager: kept.
        if any(p[: len(path)] == path for p in keep) or _is_item_key(path):
            continue
        remove(new, path)
        removed.append(path)
    before = flatten(strip(live or {}, subresource, has_status), shape)
    after = flatten(strip(new, subresource, has_status), shape)
    changed, _ = _changes(before, after)
    conflicts = [(e, e.fields & changed & applied_set) for e in others]
    conflicts = [(e, c) for e, c in conflicts if c]
    if conflicts and not force:
        raise _conflict(conflicts)
    for e, lost in conflicts:
        e.fields -= lost
    mine = _entry(entries, identity, applied.get("apiVersion", ""))
    if mine.fields != applied_set:
        mine.fields, mine.time = applied_set, _now()
    new.setdefault("metadata", {})
    write_entries(new, entries)
    return new


def _is_item_key(path: Path) -> bool:
    """A key field of a map-list item: it stays as long as the item does."""
    return (
        len(path) >= 2
        and path[-2][0] == "k"
        and path[-1][0] == "f"
        and path[-1][1] in json.loads(path[-2][1])
    )


def render_path(path: Path) -> str:
    """A path as the API server prints it: .spec.containers[name="runtime"].image"""
    out = ""
    for kind, name in path:
        if kind == "f":
            out += f".{name}"
        elif kind == "k":
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(name).items()) + "]"
        else:
            out += f"[{name}]"
    return out


def _conflict(conflicts: list[tuple[Entry, set[Path]]]) -> ApiError:
    causes = [
        Cause(
            render_path(p),
            "FieldManagerConflict",
            f'conflict with "{e.manager}"' + (f" using {e.api_version}" if e.api_version else ""),
        )
        for e, paths in conflicts
        for p in sorted(paths)
    ]
    n = len(causes)
    lines = "\n".join(f"- {c.message}: {c.field}" for c in causes)
    message = f"Apply failed with {n} conflict{'s' if n > 1 else ''}: {lines}"
    err = ApiError(409, "Conflict", message)
    err.details = {
        "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]
    }
    return err
