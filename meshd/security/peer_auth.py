"""Who the internal (peer) port admits when TLS is on: mesh members, told apart by their
certificate, not only by the CA that signed it.

The TLS handshake on the internal port only proves a caller holds a certificate the mesh's
trust signed; that CA usually also signs application client certificates
(MM_TLS_CLIENT_AUTH=REQUIRE). A caller is a member when its certificate is

- byte-identical to this instance's certificate (pods sharing one Secret; the handshake
  proved the caller holds the same private key), or
- when MESHD_TLS_PEER_NAME is set, holds that exact DNS name (case-insensitive, no
  wildcards). Peers already accept any server holding that name as a mesh instance, so
  admitting it as a client trusts no one new.

Sharing some other DNS name with this instance's certificate is not enough: names like
`localhost` or a namespace wildcard are common to many certificates from one CA.

`admits` is the pure rule; `MembersOnly` applies it to every call on the internal server
(grpc.aio interceptors cannot see the peer certificate, so it wraps the method handler)
and remembers each certificate's verdict, so a forwarded call pays one dict lookup.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from meshd.security.tls import PEER_NAME_ENV, MeshTls

log = logging.getLogger(__name__)

PEM_BEGIN = b"-----BEGIN CERTIFICATE-----"
PEM_END = b"-----END CERTIFICATE-----"
MAX_REMEMBERED = 1024  # distinct caller certificates whose verdict is kept


@dataclass(frozen=True, slots=True)
class MemberRule:
    """What makes a caller a mesh member: this instance's leaf certificate (DER) and the
    peer name (MESHD_TLS_PEER_NAME), if any."""

    certificate: bytes
    peer_name: str | None = None

    @classmethod
    def of(cls, tls: MeshTls) -> MemberRule:
        return cls(leaf_der(tls.cert_chain), tls.settings.peer_name)


def leaf_der(pem: bytes) -> bytes:
    """The first certificate of a PEM chain (the leaf), as DER; b"" when there is none."""
    start = pem.find(PEM_BEGIN)
    end = pem.find(PEM_END, start + 1)
    if start < 0 or end < 0:
        return b""
    try:
        return base64.b64decode(b"".join(pem[start + len(PEM_BEGIN) : end].split()), validate=True)
    except (binascii.Error, ValueError):
        return b""


def admits(rule: MemberRule, caller_der: bytes, caller_dns: Iterable[str]) -> bool:
    """Whether a caller whose (already verified) leaf certificate is `caller_der`, holding
    DNS names `caller_dns`, is a mesh member."""
    if caller_der and caller_der == rule.certificate:
        return True
    if rule.peer_name:
        wanted = rule.peer_name.lower()
        return any(name.lower() == wanted for name in caller_dns)
    return False


def refusal(rule: MemberRule, caller_subject: str) -> str:
    """The one-line reason a non-member is given."""
    who = caller_subject or "a caller without a certificate"
    if rule.peer_name:
        needs = f"this instance's certificate or one naming {PEER_NAME_ENV} {rule.peer_name!r}"
    else:
        needs = f"this instance's certificate (set {PEER_NAME_ENV} for per-instance certificates)"
    return f"the internal port admits mesh instances only: {who} is not {needs}"


Behaviour = Callable[..., Any]


class MembersOnly(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses (PERMISSION_DENIED) every call on the internal server from a non-member."""

    def __init__(self, rule: MemberRule) -> None:
        self.rule = rule
        self._verdicts: dict[bytes, bool] = {}
        self._guarded: dict[Any, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return handler
        guarded = self._guarded.get(handler)
        if guarded is None:
            guarded = self._wrap(handler)
            if len(self._guarded) < MAX_REMEMBERED:  # services hand out the same handler per method
                self._guarded[handler] = guarded
        return guarded

    def _wrap(self, handler: Any) -> grpc.RpcMethodHandler:
        """The same kind of handler, (de)serializers and behaviour, behind the member check."""
        h = handler
        if h.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._guard(h.unary_unary), h.request_deserializer, h.response_serializer
            )
        if h.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._guard(h.unary_stream), h.request_deserializer, h.response_serializer
            )
        if h.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._guard(h.stream_unary), h.request_deserializer, h.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            self._guard(h.stream_stream), h.request_deserializer, h.response_serializer
        )

    def member(self, auth: dict[str, list[bytes]]) -> bool:
        """Whether the caller of a call with this TLS auth context is a mesh member."""
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        verdict = self._verdicts.get(pem)
        if verdict is None:
            dns = [name.decode(errors="replace") for name in auth.get("peer_dns", [])]
            verdict = admits(self.rule, leaf_der(pem), dns)
            if len(self._verdicts) >= MAX_REMEMBERED:
                self._verdicts.clear()
            self._verdicts[pem] = verdict
            if not verdict:
                log.warning("refused on the internal port: %s", refusal(self.rule, _subject(auth)))
        return verdict

    def _guard(self, behaviour: Behaviour) -> Behaviour:
        if inspect.isasyncgenfunction(behaviour):

            async def guarded_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                await self._check(context)
                async for response in behaviour(request, context):
                    yield response

            return guarded_stream
        if inspect.iscoroutinefunction(behaviour):

            async def guarded(request: Any, context: Any) -> Any:
                await self._check(context)
                return await behaviour(request, context)

            return guarded
        # A synchronous behaviour would run on grpc's thread pool, where the async abort
        # cannot be awaited; every internal-port service is async.
        raise TypeError(f"internal-port handlers must be async (got {behaviour!r})")

    async def _check(self, context: Any) -> None:
        auth = context.auth_context()
        if not self.member(auth):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(self.rule, _subject(auth)))


def _subject(auth: dict[str, list[bytes]]) -> str:
    return b",".join(auth.get("x509_subject", [])).decode(errors="replace")


def interceptors(tls: MeshTls | None) -> list[grpc.aio.ServerInterceptor]:
    """The internal server's interceptors: members only with TLS on; none without."""
    return [MembersOnly(MemberRule.of(tls))] if tls is not None else []


__all__: Sequence[str] = ["MemberRule", "MembersOnly", "admits", "interceptors", "leaf_der", "refusal"]
