"""The placement simulator (issue "Simulator"): not built yet.

It will drive meshd.placement and meshd.cache, unchanged, on a virtual clock with
meshd.kv.memory.MemoryStore; nothing here runs today.
"""
