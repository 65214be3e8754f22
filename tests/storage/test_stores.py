"""The stores' request building, held against references: SigV4 against botocore's signer,
S3 path-style and virtual-host URLs."""

from __future__ import annotations

import datetime

from meshd.storage.stores import EMPTY_SHA256, S3Store, sigv4


def test_sigv4_matches_botocore() -> None:
    from botocore import auth, awsrequest, credentials  # boto3's, a dev dependency

    creds = ("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session-token")
    url = "https://127.0.0.1:9000/my-bucket/dir%20x/m%2Bodel.bin?list-type=2&prefix=a%2Fb"
    req = awsrequest.AWSRequest("GET", url, headers={"Range": "bytes=0-9"})
    auth.S3SigV4Auth(credentials.Credentials(*creds), "s3", "eu-west-1").add_auth(req)
    assert req.headers["X-Amz-Content-SHA256"] == EMPTY_SHA256
    now = datetime.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
    path, query = "/my-bucket/dir%20x/m%2Bodel.bin", "list-type=2&prefix=a%2Fb"
    ours = sigv4(creds, "eu-west-1", "GET", "127.0.0.1:9000", path, query, {"Range": "bytes=0-9"}, now, EMPTY_SHA256)
    assert ours["Authorization"] == req.headers["Authorization"]
    assert ours["x-amz-security-token"] == "session-token"


def test_s3_addressing_styles() -> None:
    path_style = S3Store({"bucket": "b", "endpoint_url": "http://minio:9000", "anonymous": "true"}, 5)
    assert path_style._url("dir/m x.bin") == ("minio:9000", "/b/dir/m%20x.bin", "")
    assert path_style._url("", {"prefix": "a/b", "list-type": "2"}) == ("minio:9000", "/b", "list-type=2&prefix=a%2Fb")
    virtual = S3Store({"bucket": "b", "endpoint_url": "https://s3.example.com", "virtual_host": "true"}, 5)
    assert virtual._url("m") == ("b.s3.example.com", "/m", "")
    aws = S3Store({"bucket": "b", "region": "eu-west-1"}, 5)
    assert aws._url("m") == ("b.s3.eu-west-1.amazonaws.com", "/m", "") and aws.scheme == "https"
