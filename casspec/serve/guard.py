"""What the server lets in, before a call's fields are looked at: the Host a request names (against DNS rebinding),
a POST's content type, its body (read as it comes, up to a size and within a time), and clients that stall; and
what it lets out of an unexpected error (a generic 500, one log line). Starlette and uvicorn do the HTTP."""
from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .calls import ApiError
from .scheduler import internal_error

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # Host names always accepted (DNS rebinding cannot use them)
ANY_HOST = "*"  # the allowed_hosts entry that turns the Host check off


def hostname(host: str) -> str:
    """The name in a Host header (or an allowed host): lower case, without its port, IPv6 brackets or final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:  # name:port (more colons: an IPv6 address)
        host = host.partition(":")[0]
    return host.rstrip(".")


def check_json(request: HttpRequest) -> None:
    """415 unless the body is declared JSON (a web page's form or text/plain POST is not: no CORS preflight)."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, "send the body as JSON, with 'Content-Type: application/json' (got "
                       f"{kind[:60] or 'none'!r})", "unsupported_media_type")


async def read_body(request: HttpRequest, cap: int, timeout: float) -> bytes:
    """The body, read as it comes: 413 once it is over `cap` bytes, or declares so (the rest is not read here: uvicorn
    discards what the client still sends, until its HeadTimeoutProtocol closes the connection), 408 (and the
    connection closed) when the client stalls `timeout` seconds."""
    too_large = ApiError(413, f"the request body is over this server's limit of {cap} bytes (--max-body-bytes)",
                         "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not come within {timeout:g} s", "request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ApiError(499, "the client went away", "client_disconnected") from None
    return b"".join(chunks)


class Guard:
    """The app's outer ASGI layer: the Host check (DNS rebinding: a web page's script reaching this server under the
    page's own name, then reading the answers), and whatever exception the app lets through answered as a generic
    500 with one log line (uvicorn would print its traceback)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = Headers(scope=scope).get("host", "")
        if self.hosts is not None and hostname(host) not in self.hosts:
            error = ApiError(421, f"this server does not answer for the host {host[:60]!r}: add it to the server's "
                             "--allowed-hosts", "invalid_host")
            return await error.response()(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            error = internal_error(e, f"{scope['method']} {scope['path'][:200]}")
            if not started:
                await error.response()(scope, receive, send)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that has no request under way `head_timeout` seconds after
    it opened or after its last response (uvicorn waits for ever on a client that sends nothing, or half a request
    head: each would hold one of the max_connections places)."""

    def __init__(self, *args, head_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.loop.call_later(self.head_timeout, self._head_late, self.cycle)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.loop.call_later(self.head_timeout, self._head_late, self.cycle)

    def _head_late(self, cycle: object) -> None:
        if self.cycle is cycle and (cycle is None or self.cycle.response_complete):  # no request since
            self.transport.close()
