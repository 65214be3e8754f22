"""The placement simulator: meshd's decision code (meshd.decisions.placement, meshd.decisions.cache) on a virtual clock.

Modules: `workloads` (catalogues, synthetic request streams, CSV trace replay), `policies`
(upstream / meshd / random), `engine` (the discrete-event mesh), `single` (one cache: Che's
approximation, Belady, libCacheSim yardsticks), `report` (tables and plots), `llm` and
`llm_engine` (copies of one language model routed by load and prompt prefix, `python -m sim
llm`), `__main__` (`python -m sim`). Nothing here decides anything the daemon does not decide the same way.
"""
