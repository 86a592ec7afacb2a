"""vLLM's OpenAPI (``/openapi.json``, ``/docs``) documents the /v1/steering routes (server.schemas): every
path and method, request bodies naming the fields the routes accept, and response schemas that resolve
and name the keys of real answers (success and error) of the shared server."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.conftest import API_KEY, SAE_SLOT
from tests.sae_writers import random_sae, write_gemma_scope

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTES = {
    "/v1/steering": {"get"},
    "/v1/steering/modules": {"get", "post"},
    "/v1/steering/modules/{name}": {"get", "delete"},
    "/v1/steering/sae": {"get", "post"},
    "/v1/steering/sae/{name}": {"get", "delete"},
}
MODULE_FIELDS = {"name", "description", "replace", "steering_vectors", "prefill_steering_vectors",
                 "decode_steering_vectors", "steering_condition", "steering_projections",
                 "prefill_steering_projections", "decode_steering_projections", "as_ablation", "site_norms"}


@pytest.fixture(scope="module")
def base(api_server):
    return api_server[0]


@pytest.fixture(scope="module")
def spec(base):
    r = httpx.get(f"{base}/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def follow(spec: dict, schema: dict) -> dict:
    """``schema``, its ``$ref`` (if any) followed inside the document."""
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/"), ref
        schema = spec
        for part in ref[2:].split("/"):
            schema = schema[part]
    return schema


def body_schema(spec: dict, path: str, media: str) -> dict:
    return follow(spec, spec["paths"][path]["post"]["requestBody"]["content"][media]["schema"])


def answer_schema(spec: dict, path: str, method: str, status: int) -> dict:
    return follow(spec, spec["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"])


def items(spec: dict, schema: dict, key: str) -> dict:
    """The schema of the items of ``schema``'s list property ``key``."""
    return follow(spec, follow(spec, schema["properties"][key])["items"])


def assert_names(schema: dict, answer: dict) -> None:
    """A real answer's keys are the schema's properties, its required ones included."""
    assert set(answer) <= set(schema["properties"]), (sorted(answer), sorted(schema["properties"]))
    assert set(schema.get("required", ())) <= set(answer), (sorted(answer), schema.get("required"))


def assert_error(spec: dict, path: str, method: str, r: httpx.Response, status: int) -> None:
    """``r`` is a ``status`` answer in the error shape the route declares for it."""
    assert r.status_code == status, r.text
    schema = answer_schema(spec, path, method, status)
    assert_names(schema, r.json())
    assert_names(follow(spec, schema["properties"]["error"]), r.json()["error"])


def test_every_route_is_documented(base, spec):
    for path, methods in ROUTES.items():
        assert methods <= set(spec["paths"].get(path, {})), (path, sorted(spec["paths"].get(path, {})))
        for method in methods:
            assert "steering" in spec["paths"][path][method]["tags"]
    assert httpx.get(f"{base}/docs", timeout=30).status_code == 200


def test_parameters_are_declared_and_no_route_claims_a_422(spec):
    """The routes answer bad input with 400/404 in vLLM's error shape, never FastAPI's 422; the path's
    ``name`` and module registration's ``?replace=`` are declared parameters."""
    for path in ROUTES:
        for method, op in spec["paths"][path].items():
            assert "422" not in op["responses"], (method, path, sorted(op["responses"]))
            params = {(p["name"], p["in"]) for p in op.get("parameters", [])}
            assert (("name", "path") in params) == ("{name}" in path), (method, path, params)
    post = spec["paths"]["/v1/steering/modules"]["post"]
    assert ("replace", "query") in {(p["name"], p["in"]) for p in post["parameters"]}


def test_every_ref_resolves(spec):
    refs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            refs.extend([node["$ref"]] if isinstance(node.get("$ref"), str) else [])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk({p: spec["paths"][p] for p in ROUTES})
    walk(spec["components"])
    assert refs
    for ref in refs:
        follow(spec, {"$ref": ref})  # a KeyError names a $ref (e.g. into a $defs) that does not resolve


def test_request_bodies_name_the_accepted_fields(spec):
    module = body_schema(spec, "/v1/steering/modules", "application/json")
    assert set(module["properties"]) == MODULE_FIELDS and module["required"] == ["name"]
    assert module["additionalProperties"] is False  # unknown fields are a 400
    packed = follow(spec, module["properties"]["steering_vectors"]["anyOf"][0]["additionalProperties"]["anyOf"][1])
    assert {"dtype", "shape", "layer_indices", "data"} <= set(packed["properties"])
    form = body_schema(spec, "/v1/steering/modules", "multipart/form-data")
    assert set(form["properties"]) == {"file", "name", "description", "replace", "as_ablation", "site_norms"}
    assert form["properties"]["file"]["format"] == "binary" and set(form["required"]) == {"file", "name"}
    sae = body_schema(spec, "/v1/steering/sae", "application/json")
    assert set(sae["properties"]) == {"name", "path", "format", "site", "features", "replace", "reconstruct"}
    assert set(sae["required"]) == {"name", "path"}


def test_module_answers_match_their_schemas(base, spec):
    path, named = "/v1/steering/modules", "/v1/steering/modules/{name}"
    vec = np.linspace(-1, 1, 576, dtype=np.float32).tolist()
    r = httpx.post(f"{base}{path}", json={"name": "openapi-mod", "steering_vectors": {"post_mlp": {"3": vec}}},
                   headers=AUTH, timeout=60)
    assert r.status_code == 201, r.text
    try:
        assert_names(answer_schema(spec, path, "post", 201), r.json())
        one = httpx.get(f"{base}{path}/openapi-mod", timeout=30).json()
        assert_names(answer_schema(spec, named, "get", 200), one)
        listed = httpx.get(f"{base}{path}", timeout=30).json()
        schema = answer_schema(spec, path, "get", 200)
        assert_names(schema, listed)
        for entry in listed["data"]:
            assert_names(items(spec, schema, "data"), entry)
    finally:
        gone = httpx.delete(f"{base}{path}/openapi-mod", headers=AUTH, timeout=60)
    assert gone.status_code == 200, gone.text
    assert_names(answer_schema(spec, named, "delete", 200), gone.json())
    assert_error(spec, path, "post", httpx.post(f"{base}{path}", json={"name": "x", "colour": 1}, headers=AUTH,
                                                timeout=60), 400)
    assert_error(spec, path, "post", httpx.post(f"{base}{path}", json={"name": "x"}, timeout=60), 401)
    assert_error(spec, named, "get", httpx.get(f"{base}{path}/openapi-mod", timeout=30), 404)
    assert_error(spec, named, "delete", httpx.delete(f"{base}{path}/openapi-mod", headers=AUTH, timeout=30), 404)


def test_sae_and_status_answers_match_their_schemas(base, spec, sae_root):
    path, named = "/v1/steering/sae", "/v1/steering/sae/{name}"
    files = write_gemma_scope(str(sae_root / "openapi"), random_sae(576, 16, "jumprelu", seed=5))
    body = {"name": "openapi-sae", "path": files, "site": SAE_SLOT, "features": [1, 2]}
    r = httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 201, r.text
    try:
        assert_names(answer_schema(spec, path, "post", 201), r.json())
        assert_names(answer_schema(spec, named, "get", 200), httpx.get(f"{base}{path}/openapi-sae", timeout=30).json())
        listed = httpx.get(f"{base}{path}", timeout=30).json()
        schema = answer_schema(spec, path, "get", 200)
        assert_names(schema, listed)
        assert listed["data"] and listed["slots"]
        for key in ("data", "slots"):
            for entry in listed[key]:
                assert_names(items(spec, schema, key), entry)
    finally:
        gone = httpx.delete(f"{base}{path}/openapi-sae", headers=AUTH, timeout=60)
    assert gone.status_code == 200, gone.text
    assert_names(answer_schema(spec, named, "delete", 200), gone.json())
    outside = httpx.post(f"{base}{path}", json={**body, "path": "/etc/passwd"}, headers=AUTH, timeout=60)
    assert_error(spec, path, "post", outside, 403)
    assert_error(spec, named, "delete", httpx.delete(f"{base}{path}/fz", headers=AUTH, timeout=30), 409)
    assert_names(answer_schema(spec, "/v1/steering", "get", 200), httpx.get(f"{base}/v1/steering", timeout=30).json())


def test_the_completion_routes_document_the_steering_fields(spec):
    """vLLM's /v1/completions and /v1/chat/completions request models list every steering field, each with a
    description, and the vectors' packed form; vLLM's own fields are still there."""
    from vllm_steer.core.vectors import REQUEST_FIELDS

    for path, own in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        body = body_schema(spec, path, "application/json")
        props = body["properties"]
        assert set(REQUEST_FIELDS) <= set(props) and own in props and "max_tokens" in props, path
        assert all(props[f].get("description") for f in REQUEST_FIELDS), path
        assert "PackedRows" in json.dumps(props["steering_vectors"]) or "layer_indices" in json.dumps(
            props["steering_vectors"]), path
