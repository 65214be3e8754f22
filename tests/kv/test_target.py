"""KV_STORE endpoints with IPv6 hosts (meshd.kv.target): `[v6]:port`, as in a URL."""

from __future__ import annotations

import json

import pytest

from meshd.kv.target import Endpoint, KVStoreError, parse_kv_store


def test_ipv6_endpoints_in_brackets_are_read_and_written_back_so() -> None:
    t = parse_kv_store("etcd:http://[fd00::7]:2379,[::1],etcd.modelmesh-serving:2379;rootPrefix=mm")
    assert t.endpoints == (
        Endpoint("fd00::7", 2379, "http"),
        Endpoint("::1", 2379, ""),
        Endpoint("etcd.modelmesh-serving", 2379, ""),
    )
    assert [str(e) for e in t.endpoints] == ["[fd00::7]:2379", "[::1]:2379", "etcd.modelmesh-serving:2379"]
    assert t.url == "http://[fd00::7]:2379" and t.root_prefix == "mm"
    assert parse_kv_store("etcd:" + json.dumps({"endpoints": "https://[fd00::7]:2379"})).url == "https://[fd00::7]:2379"
    with pytest.raises(KVStoreError):  # without brackets the port cannot be told from the address
        parse_kv_store("etcd:" + json.dumps({"endpoints": "http://fd00::7:2379"}))
