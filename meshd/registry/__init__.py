"""registry: the mesh's shared state in etcd, as the daemon reads and changes it.

Owns: `models` (model records: register, unregister, add and remove copies under
compare-and-set, max copies enforced in the CAS), `vmodels` (vmodel records and their
transitions), `instances` (writing this instance's record on its lease, and writing it back when
it changed behind meshd's back; what it says and when is `decisions.publishing`).
The store seam under it is `meshd.kv`; leader election is `meshd.kv.election`.

May import: core, decisions, kv.
"""
