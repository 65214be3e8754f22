"""observability: what an operator sees of the daemon.

Owns: `metrics` (Prometheus series with upstream's names, MM_METRICS), `tracing`
(OpenTelemetry set-up and the spans the request path opens), `logs` (text or JSON logs),
`payloads` (MM_PAYLOAD_PROCESSORS: request/response payloads to a logger or an HTTP endpoint).

May import: core, decisions, net.
"""
