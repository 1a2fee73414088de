"""Who may use the HTTP server: an API key, a Host allow-list and a refusal of browser cross-origin requests.

Checked on every request, in this order (errors are OpenAI-style JSON, `openai_api.ApiError`):
- Host (421 `host_not_allowed`): the `Host` header must name this server: a localhost name or loopback address, the
  bound address, the address the connection arrived on, or an entry of `allowed_hosts` ("*": any). This stops DNS
  rebinding, where a web page's own domain name is pointed at 127.0.0.1. A request without Host (HTTP/1.0) passes.
- Origin (403 `origin_not_allowed`): a request carrying an `Origin` header (a browser page's fetch or form) is
  refused unless that origin is in `allowed_origins` ("*": any); allowed origins get CORS headers and preflights.
- API key (401 `invalid_api_key`, `WWW-Authenticate: Bearer`): with `api_key` set, every `/v1/*` request needs
  `Authorization: Bearer <api_key>`; `/health` stays open.
- Content type (415 `unsupported_media_type`): with `require_json`, a POST body labelled anything but JSON
  (`application/json`, `*/*+json`) is refused: text/plain, form and multipart bodies are what a browser may send
  cross-origin without asking first. A body without Content-Type passes.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress

from aiohttp import web

from k3jax.inference.openai_api import ApiError

API_KEY_ENV = "K3JAX_API_KEY"
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
PREFLIGHT_HEADERS = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                     "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600"}


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    """`api_key` None: no key needed. `bound_host`: the address the server listens on (--host)."""

    api_key: str | None = None
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    require_json: bool = True

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def check(self, request: web.Request) -> ApiError | None:
        """The first rule `request` breaks, as the error to answer with; None when it may proceed."""
        host = request.headers.get("Host")
        if host is not None and not self._host_allowed(host, request):
            return ApiError(421, f"Host {host!r} is not this server; start it with --allowed_hosts={_name(host)} to "
                                 "accept that name", None, "host_not_allowed")
        origin = request.headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin):
            return ApiError(403, f"cross-origin request from {origin!r} refused; start the server with "
                                 f"--allowed_origins={origin} to allow that page", None, "origin_not_allowed")
        if request.method == "OPTIONS":
            return None
        if self.api_key is not None and request.path.startswith("/v1/"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return ApiError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                                None, "invalid_api_key")
        ctype = request.headers.get("Content-Type")
        if self.require_json and request.method == "POST" and ctype is not None and not _is_json(ctype):
            return ApiError(415, f"request bodies must be JSON (Content-Type: application/json), got {ctype!r}",
                            None, "unsupported_media_type")
        return None

    def _host_allowed(self, host: str, request: web.Request) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = _name(host)
        if name in LOCAL_NAMES or name.endswith(".localhost") or _is_loopback(name):
            return True
        if name == _name(self.bound_host) or name in {_name(h) for h in self.allowed_hosts}:
            return True
        sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
        return bool(sock) and _same_ip(name, str(sock[0]))


def policy_from_flags(api_key: str | None, host: str, allowed_hosts, allowed_origins, require_json: bool,
                      environ) -> AccessPolicy:
    """serve.py's flags as a policy; the key from `--api_key`, else the environment's `API_KEY_ENV` (a key on the
    command line shows in process listings). Raises ValueError for a blank key."""
    key = api_key if api_key is not None else (environ.get(API_KEY_ENV) or None)
    if key is not None and not key.strip():
        raise ValueError("--api_key must not be blank")
    return AccessPolicy(api_key=key, bound_host=host, allowed_hosts=tuple(allowed_hosts),
                        allowed_origins=tuple(allowed_origins), require_json=require_json)


def cors_headers(policy: AccessPolicy, request: web.Request) -> dict[str, str]:
    """The CORS headers of a response to an allowed origin (none without an Origin header)."""
    origin = request.headers.get("Origin")
    if origin is None or not policy.origin_allowed(origin):
        return {}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


def _name(host: str) -> str:
    """The host name of a Host header value (port and IPv6 brackets removed), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _same_ip(a: str, b: str) -> bool:
    try:
        ia, ib = ipaddress.ip_address(a), ipaddress.ip_address(b.split("%")[0])
    except ValueError:
        return False
    ia = getattr(ia, "ipv4_mapped", None) or ia
    ib = getattr(ib, "ipv4_mapped", None) or ib
    return ia == ib


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))
