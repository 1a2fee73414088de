"""Access control of the HTTP server: the API key guards /v1/* (not /health), a foreign Host header is refused (DNS
rebinding), browser cross-origin requests and non-JSON POST bodies are refused unless configured. No generation
runs: a request that passes the checks is answered by the route (200, or a 400 from request validation)."""

from __future__ import annotations

import asyncio

import pytest

from k3jax.inference.access import AccessPolicy, policy_from_flags
from k3jax.inference.scheduler import Scheduler
from tests.test_inference_cache import tiny_model
from tests.test_server import NAME, serving

BAD_FIELD = b'{"prompt": "x", "n": 0}'  # passes access control, then fails validation: 400 naming "n"


@pytest.fixture(scope="module")
def scheduler():
    return Scheduler(tiny_model(NAME), num_slots=1, max_len=32)


async def call(client, method, path, headers=None, data=None):
    """(status, error code or None, response headers)."""
    async with client.request(method, path, headers=headers or {}, data=data) as r:
        body = await r.json() if r.content_type == "application/json" else None
        code = body["error"]["code"] if isinstance(body, dict) and "error" in body else None
        return r.status, code, r.headers


def run(scheduler, tokenizer, policy, requests):
    async def go():
        async with serving(scheduler, tokenizer, access=policy) as (_, client, _, _):
            return [await call(client, *r) for r in requests]
    return asyncio.run(go())


JSON = {"Content-Type": "application/json"}


def test_api_key_is_required_on_v1_routes_but_not_on_health(scheduler, tokenizer):
    key = {"Authorization": "Bearer s3cret"}
    got = run(scheduler, tokenizer, AccessPolicy(api_key="s3cret"), [
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models", {"Authorization": "Bearer wrong"}),
        ("GET", "/v1/models", {"Authorization": "s3cret"}),
        ("GET", "/v1/models", key),
        ("POST", "/v1/completions", JSON, BAD_FIELD),
        ("POST", "/v1/chat/completions", JSON, BAD_FIELD),
        ("POST", "/v1/completions", {**JSON, **key}, BAD_FIELD),
    ])
    assert [(st, code) for st, code, _ in got] == [
        (200, None), (401, "invalid_api_key"), (401, "invalid_api_key"), (401, "invalid_api_key"), (200, None),
        (401, "invalid_api_key"), (401, "invalid_api_key"), (400, "invalid_value")]
    assert got[1][2]["WWW-Authenticate"] == "Bearer"


def test_foreign_host_headers_are_refused_unless_allowed(scheduler, tokenizer):
    hosts = ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost:8000", "127.0.0.1", "[::1]:80",
             "k3.internal:8000"]
    default = run(scheduler, tokenizer, AccessPolicy(), [("GET", "/v1/models", {"Host": h}) for h in hosts])
    allowed = run(scheduler, tokenizer, AccessPolicy(allowed_hosts=("k3.internal",)),
                  [("GET", "/health", {"Host": h}) for h in hosts])
    any_host = run(scheduler, tokenizer, AccessPolicy(allowed_hosts=("*",)), [("GET", "/health", {"Host": hosts[0]})])
    assert [(st, code) for st, code, _ in default] == [(421, "host_not_allowed")] * 3 + [(200, None)] * 3 + [
        (421, "host_not_allowed")]
    assert [st for st, _, _ in allowed] == [421] * 3 + [200] * 4
    assert any_host[0][0] == 200


def test_browser_cross_origin_requests_are_refused_unless_the_origin_is_allowed(scheduler, tokenizer):
    page = {"Origin": "http://evil.example"}
    refused = run(scheduler, tokenizer, AccessPolicy(), [
        ("POST", "/v1/completions", {**JSON, **page}, BAD_FIELD),
        ("GET", "/v1/models", page),
        ("OPTIONS", "/v1/completions", {**page, "Access-Control-Request-Method": "POST"}),
    ])
    assert [(st, code) for st, code, _ in refused] == [(403, "origin_not_allowed")] * 3
    assert all("Access-Control-Allow-Origin" not in h for _, _, h in refused)

    app = {"Origin": "http://app.example"}
    got = run(scheduler, tokenizer, AccessPolicy(allowed_origins=("http://app.example",)), [
        ("OPTIONS", "/v1/completions", {**app, "Access-Control-Request-Method": "POST",
                                        "Access-Control-Request-Headers": "authorization, content-type"}),
        ("POST", "/v1/completions", {**JSON, **app}, BAD_FIELD),
        ("POST", "/v1/completions", {**JSON, **page}, BAD_FIELD),
    ])
    (pre, _, pre_h), (post, code, post_h), (other, other_code, _) = got
    assert pre == 204 and pre_h["Access-Control-Allow-Origin"] == "http://app.example"
    assert "Authorization" in pre_h["Access-Control-Allow-Headers"]
    assert (post, code) == (400, "invalid_value") and post_h["Access-Control-Allow-Origin"] == "http://app.example"
    assert (other, other_code) == (403, "origin_not_allowed")


def test_non_json_post_bodies_are_refused_unless_configured(scheduler, tokenizer):
    kinds = ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
             "application/json; charset=utf-8", "application/merge-patch+json"]
    strict = run(scheduler, tokenizer, AccessPolicy(),
                 [("POST", "/v1/completions", {"Content-Type": k}, BAD_FIELD) for k in kinds])
    lax = run(scheduler, tokenizer, AccessPolicy(require_json=False),
              [("POST", "/v1/completions", {"Content-Type": k}, BAD_FIELD) for k in kinds[:2]])
    assert [(st, code) for st, code, _ in strict] == [(415, "unsupported_media_type")] * 3 + [
        (400, "invalid_value")] * 2
    assert [st for st, _, _ in lax] == [400, 400]


def test_policy_from_flags_reads_the_api_key_from_the_environment():
    p = policy_from_flags(None, "0.0.0.0", ["k3.internal"], [], True, {"K3JAX_API_KEY": "from-env"})
    assert p == AccessPolicy(api_key="from-env", bound_host="0.0.0.0", allowed_hosts=("k3.internal",))
    assert policy_from_flags("flag", "127.0.0.1", [], [], True, {"K3JAX_API_KEY": "env"}).api_key == "flag"
    assert policy_from_flags(None, "127.0.0.1", [], [], True, {"K3JAX_API_KEY": ""}).api_key is None
    with pytest.raises(ValueError, match="--api_key"):
        policy_from_flags(" ", "127.0.0.1", [], [], True, {})
