"""Helpers for tests, benchmarks and the demo: free ports and child processes stopped by PID."""
