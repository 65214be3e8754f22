# One image for both containers of a meshd "pod": `meshd serve` and the reference runtime.
# Debian 13 (trixie): its HAProxy is 3.0 LTS. Debian 12's 2.6.12 resets a busy runtime connection on
# gRPC trailers, so meshd would give it a connection per request (docs/native.md, "HAProxy versions").
FROM python:3.11-slim-trixie
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY meshd ./meshd
# tls: cryptography, for encrypted keys and a self-signed /metrics certificate (MM_METRICS scheme=https)
RUN pip install --no-cache-dir -c constraints.txt ".[otel,tls]"
# HAProxy for the optional native data plane (MESHD_DATAPLANE=native; docs/native.md).
RUN apt-get update && apt-get install -y --no-install-recommends haproxy && rm -rf /var/lib/apt/lists/*
# Upstream's pre-stop script path: a modelmesh-serving pod's mm container calls `stop.sh wait`.
COPY deploy/image/stop.sh /opt/kserve/mmesh/stop.sh
# gRPC, peers, KServe HTTP (not 8008: rest-proxy's in a modelmesh-serving pod), probes, prestop, metrics
EXPOSE 8033 8080 8091 8089 8090 2112
ENTRYPOINT ["meshd"]
CMD ["serve"]
