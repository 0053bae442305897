"""The API server's rules for object metadata that no schema states: names per kind (a
Service name is a DNS-1035 label, most others DNS-1123 subdomains), label keys and values,
annotation keys. Messages follow the server's wording."""

from __future__ import annotations

import re
from typing import Any

from kvfleet.devcluster.apiserver.api_status import Cause, quote

DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = rf"{DNS1123_LABEL}(\.{DNS1123_LABEL})*"
DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_VALUE = rf"({QUALIFIED_NAME})?"
# Names are DNS-1123 subdomains except for these kinds.
NAME_RULES = {
    "Service": ("DNS-1035 label", DNS1035_LABEL, 63, "start with an alphabetic character"),
    "Namespace": ("RFC 1123 label", DNS1123_LABEL, 63, "start with an alphanumeric character"),
}
SUBDOMAIN_RULE = (
    "RFC 1123 subdomain",
    DNS1123_SUBDOMAIN,
    253,
    "start with an alphanumeric character",
)


def name_error(value: str, rule: tuple[str, str, int, str]) -> str | None:
    what, pattern, limit, start = rule
    if len(value) > limit:
        return f"must be no more than {limit} characters"
    if not re.fullmatch(pattern, value):
        chars = "'-' or '.'" if "." in pattern else "'-'"
        return (
            f"a {what} must consist of lower case alphanumeric characters or {chars}, {start}, "
            f"and end with an alphanumeric character (regex used for validation is '{pattern}')"
        )
    return None


def _qualifiedname_error(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not re.fullmatch(DNS1123_SUBDOMAIN, prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not re.fullmatch(QUALIFIED_NAME, name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character, and be no more than 63 characters"
        )
    return None


def check_labels(labels: Any, path: str) -> list[Cause]:
    causes = []
    for key, value in (labels or {}).items():
        if err := _qualifiedname_error(key):
            causes.append(Cause(path, "FieldValueInvalid", f"Invalid value: {quote(key)}: {err}"))
        if not isinstance(value, str) or len(value) > 63 or not re.fullmatch(LABEL_VALUE, value):
            causes.append(
                Cause(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {quote(value)}: a valid label must be an empty string or consist "
                    "of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character, and be no more than 63 characters",
                )
            )
    return causes


def check_metadata(obj: dict[str, Any], path: str = "metadata") -> list[Cause]:
    meta = obj.get("metadata") or {}
    causes = []
    name = meta.get("name")
    if path == "metadata":
        if not name and not meta.get("generateName"):
            causes.append(
                Cause(
                    "metadata.name",
                    "FieldValueRequired",
                    "Required value: name or generateName is required",
                )
            )
        elif name:
            kind = obj.get("kind", "")
            if kind == "Event":  # events only need a name usable in a URL path
                err = "may not contain '/' or '%'" if re.search(r"[/%]", name) else None
            else:
                err = name_error(name, NAME_RULES.get(kind, SUBDOMAIN_RULE))
            if err:
                causes.append(
                    Cause(
                        "metadata.name", "FieldValueInvalid", f"Invalid value: {quote(name)}: {err}"
                    )
                )
    causes += check_labels(meta.get("labels"), f"{path}.labels")
    for key in meta.get("annotations") or {}:
        if err := _qualifiedname_error(key):
            causes.append(
                Cause(
                    f"{path}.annotations",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(key)}: {err}",
                )
            )
    return causes
