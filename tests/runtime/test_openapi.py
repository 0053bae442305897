"""The server's OpenAPI document, /openapi.json: a valid OpenAPI 3.1 document that names every
field the parser reads, and that a live `kvfleet serve` keeps to. Schemathesis reads it from the
server and writes requests from it: each field's edge and wrong values (its coverage phase), then
random ones, valid and invalid; every answer is checked against the document."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import openapi_hooks
import pytest
import schemathesis
from kvfleet.runtime.server import fields
from kvfleet.runtime.server.app import OPEN_PATHS
from kvfleet.runtime.server.openapi import openapi_document
from server_fixtures import ServerProcess, request

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    # A request the document forbids is refused: the document promises no check the server
    # skips. (Not the converse, positive_data_acceptance: whether a prompt fits, or a token id
    # is in the vocabulary, is the model's to say, not the document's.)
    "negative_data_rejection",
)


def test_the_document_is_valid_openapi_3_1():
    doc = openapi_document(["tiny"])
    schemathesis.openapi.from_dict(doc).validate()  # against OpenAPI 3.1's own schema
    for name, schema in doc["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            pytest.fail(f"components/schemas/{name}: {exc.message}")


@pytest.mark.parametrize(
    ("schema_name", "parsed"),
    [("CompletionRequest", "COMPLETION_FIELDS"), ("ChatCompletionRequest", "CHAT_FIELDS")],
)
def test_each_request_schema_names_exactly_the_fields_the_parser_reads(schema_name, parsed):
    """Read from the parser when the test runs: a field added there and not here fails."""
    documented = set(openapi_document()["components"]["schemas"][schema_name]["properties"])
    known = set(getattr(fields, parsed))
    assert sorted(known - documented) == [], "read by the parser, missing from the document"
    # The server ignores a field it does not know: documenting one would promise an effect.
    assert sorted(documented - known) == [], "documented, unknown to the parser"


def test_the_hooks_clamp_only_what_the_document_allows():
    assert openapi_hooks.DOCUMENTED_INT_MAX == fields.INT64_MAX
    assert openapi_hooks.DOCUMENTED_MAX_N == fields.MAX_N


def test_only_the_api_asks_for_the_key():
    """With a key, the API's routes ask for it and may answer 401; the routes the server
    leaves open (/health, /metrics, /version, this document) never do."""
    paths = openapi_document(["tiny"], api_key=True)["paths"]
    assert "/openapi.json" in OPEN_PATHS and set(OPEN_PATHS) <= set(paths)
    for path, item in paths.items():
        for op in item.values():
            asks = op["security"] == [{"apiKey": []}]
            assert asks == (path not in OPEN_PATHS), path
            assert ("401" in op["responses"]) == asks, path


def test_openapi_json_is_served_and_names_the_model_served(tiny_server: ServerProcess):
    r = request(tiny_server.port, "GET", "/openapi.json")
    assert r.status == 200
    assert r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1.")
    served = request(tiny_server.port, "GET", "/v1/models").json()["data"][0]["id"]
    model = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model["anyOf"][0]["enum"] == [served]
    # This server was started without a key: its document asks for none.
    assert all(op["security"] == [] for item in doc["paths"].values() for op in item.values())


def test_a_live_server_keeps_to_its_document(tiny_server: ServerProcess, tmp_path: Path):
    """No 5xx whatever the request; every status, content type, header and body (streamed
    events too) as documented; every request the document forbids refused."""
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{tiny_server.url}/openapi.json"),
        *("--checks", ",".join(CHECKS)),
        *("--phases", "examples,coverage,fuzzing", "--mode", "all", "--max-examples", "25"),
        # Reproducible: the same requests on every run, sent one at a time.
        *("--generation-deterministic", "--workers", "1"),
        *("--request-timeout", "60", "--continue-on-failure"),
        *("--output-sanitize", "false", "--no-color"),
    ]
    here = str(Path(__file__).parent)
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": openapi_hooks.__name__,
        "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
    }
    # In tmp_path: the CLI's reports and caches stay out of the repository.
    run = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    # The report's failures, each with the curl command that reproduces it.
    report = run.stdout[max(run.stdout.find("=" * 10), 0) :]
    assert run.returncode == 0, f"{report[-20000:]}\n{run.stderr[-2000:]}"
