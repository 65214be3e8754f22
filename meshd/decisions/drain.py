"""When a stopping instance's drain grace ends (pure).

After SIGTERM the instance says NOT_SERVING at once, yet keeps its ports open and serving for
the drain grace (MESHD_DRAIN_GRACE_MS): a load balancer or a kubelet probing every few seconds
moves its clients only that much later, and a port closed before then refuses them (issue 15).
With other instances in the mesh the grace runs its whole length: that is where the clients go.
With none there is nowhere to move them, so the grace serves only clients still sending: it
ends once no request has arrived for QUIET_S, and an idle lone instance stops at once.
"""

from __future__ import annotations

QUIET_S = 1.0  # a lone instance with no request for this long has no clients left to serve


def grace_over(now_s: float, until_s: float, others: bool, quiet_since_s: float) -> bool:
    """Whether the grace that runs to `until_s` is over at `now_s`; `others`: other instances
    are in the mesh; `quiet_since_s`: when the last request arrived (or the grace began)."""
    if now_s >= until_s:
        return True
    return not others and now_s - quiet_since_s >= QUIET_S
