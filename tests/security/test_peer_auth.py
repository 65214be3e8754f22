"""Who the internal port admits (meshd.security.peer_auth): the pure member rule, and the interceptor
on a real in-process grpc server with TLS, for every handler shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd.security import peer_auth, tls
from meshd.security.peer_auth import MemberRule, admits, leaf_der
from meshd.testing.certs import Issued, TestCA

PEER_NAME = "meshd-peers.test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA(d, "mesh")
    return {
        "ca": ca,
        "inst": ca.issue("inst", dns=(PEER_NAME, "localhost")),
        "pod": ca.issue("pod-b", dns=(PEER_NAME.upper(),)),  # a per-instance certificate
        "app": ca.issue("app"),  # a client application: shares `localhost` with inst
        "wildcard": ca.issue("wild", dns=("*.test",)),
    }


def der(issued: Issued) -> bytes:
    return leaf_der(issued.cert.read_bytes())


def test_leaf_der_takes_the_first_certificate_of_a_chain(pki: dict[str, Any]) -> None:
    inst, ca = pki["inst"], pki["ca"]
    chain = inst.cert.read_bytes() + ca.cert.read_bytes()
    assert leaf_der(chain) == der(inst) != leaf_der(ca.cert.read_bytes())
    assert der(inst).startswith(b"\x30")  # a DER SEQUENCE
    assert leaf_der(b"") == b""
    assert leaf_der(b"-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n") == b""


def test_this_instances_own_certificate_is_a_member(pki: dict[str, Any]) -> None:
    rule = MemberRule(der(pki["inst"]))
    assert admits(rule, der(pki["inst"]), [])
    # Same CA, a DNS name in common (localhost): not a member.
    assert not admits(rule, der(pki["app"]), ["localhost"])
    assert not admits(rule, der(pki["pod"]), [PEER_NAME])  # no peer name set: names do not count
    assert not admits(MemberRule(b""), b"", [])  # no certificate on either side


def test_with_a_peer_name_certificates_holding_exactly_that_name_are_members(pki: dict[str, Any]) -> None:
    rule = MemberRule(der(pki["inst"]), PEER_NAME)
    assert admits(rule, der(pki["inst"]), [])
    assert admits(rule, der(pki["pod"]), [PEER_NAME.upper()])  # DNS names compare case-insensitively
    assert not admits(rule, der(pki["app"]), ["localhost"])
    assert not admits(rule, der(pki["wildcard"]), ["*.test"])  # no wildcard matching
    assert not admits(rule, der(pki["app"]), [f"x.{PEER_NAME}", PEER_NAME + "."])


def test_refusal_names_what_would_be_admitted() -> None:
    assert "set MESHD_TLS_PEER_NAME" in peer_auth.refusal(MemberRule(b"x"), "CN=app")
    message = peer_auth.refusal(MemberRule(b"x", PEER_NAME), "")
    assert f"MESHD_TLS_PEER_NAME '{PEER_NAME}'" in message and "without a certificate" in message


# ---- on a real grpc server -----------------------------------------------------------------
UNARY, STREAM, COROUTINE_STREAM = "/t.T/Unary", "/t.T/Stream", "/t.T/Writes"


class Echo(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Every handler shape the internal port uses: unary, async-generator stream, and a
    unary-stream coroutine that writes (as health Watch does)."""

    def service(self, details: Any) -> Any:
        async def unary(request: bytes, context: Any) -> bytes:
            return request

        async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for r in requests:
                yield r

        async def writes(request: bytes, context: Any) -> None:
            await context.write(request)

        return {
            UNARY: grpc.unary_unary_rpc_method_handler(unary),
            STREAM: grpc.stream_stream_rpc_method_handler(stream),
            COROUTINE_STREAM: grpc.unary_stream_rpc_method_handler(writes),
        }.get(details.method)


async def calls(port: int, ca: TestCA, who: Issued) -> list[grpc.StatusCode | bytes]:
    creds = tls.client_credentials(ca.cert.read_bytes(), who.cert.read_bytes(), who.key.read_bytes())
    options = [("grpc.ssl_target_name_override", PEER_NAME)]
    results: list[grpc.StatusCode | bytes] = []
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=options) as ch:

        async def one_stream() -> AsyncIterator[bytes]:
            yield b"s"

        attempts = [
            lambda: ch.unary_unary(UNARY)(b"u", timeout=10),
            lambda: _first(ch.stream_stream(STREAM)(one_stream(), timeout=10)),
            lambda: _first(ch.unary_stream(COROUTINE_STREAM)(b"w", timeout=10)),
            lambda: ch.unary_unary("/t.T/Missing")(b"", timeout=10),
        ]
        for attempt in attempts:
            try:
                results.append(await attempt())
            except grpc.aio.AioRpcError as e:
                results.append(e.code())
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                    assert "admits mesh instances only: CN=" in (e.details() or "")
    return results


async def _first(call: Any) -> bytes:
    async for response in call:
        return bytes(response)
    return b""


@pytest.mark.parametrize("peer_name", [None, PEER_NAME])
async def test_members_only_guards_every_handler_shape(pki: dict[str, Any], tmp_path: Path, peer_name: str) -> None:
    ca, inst = pki["ca"], pki["inst"]
    settings = tls.parse_settings(str(inst.cert), str(inst.key), "NONE", str(ca.cert), None, peer_name)
    assert settings is not None
    material = tls.load(settings, PEER_NAME)
    [guard] = peer_auth.interceptors(material)
    assert peer_auth.interceptors(None) == []
    server = grpc.aio.server(interceptors=[guard])
    server.add_generic_rpc_handlers([Echo()])
    port = tls.bind(server, "127.0.0.1:0", material.internal_server_credentials())
    await server.start()
    try:
        member = await calls(port, ca, inst)
        app = await calls(port, ca, pki["app"])
        pod = await calls(port, ca, pki["pod"])
    finally:
        await server.stop(None)
    denied, missing = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED
    assert member == [b"u", b"s", b"w", missing]
    assert app == [denied, denied, denied, missing]
    assert pod == ([b"u", b"s", b"w", missing] if peer_name else [denied, denied, denied, missing])
    assert len(guard._verdicts) == 3  # one verdict per certificate, however many calls
