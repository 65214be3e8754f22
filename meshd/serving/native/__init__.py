"""native: the optional native data plane (MESHD_DATAPLANE=native), with meshd as its control plane.

HAProxy carries warm requests, the bytes only; every decision stays in Python. `haproxy_config`
renders its configuration and reads its tables (pure), `routes` decides which models it may
carry and where (pure), `haproxy` runs the process and speaks its runtime API, and `plane`
keeps its maps equal to what this instance knows: the local copies it may serve, the peers
that hold the rest, the vmodels' targets; it feeds the proxy's counters back to the cache.
"""
