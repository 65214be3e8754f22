"""testing: helpers for tests, benchmarks and the demo: free ports, child processes stopped
by PID, a local mesh of real processes, certificates, cached venvs for third-party servers.

May import: anything in meshd (it sits beside the assembly, above every room).
"""
