# Shortcuts for scripts/dev.py, which needs only Python (the README uses it directly).
.PHONY: demo test quick bench protos clean
demo:
	python3 scripts/dev.py demo
test:
	python3 scripts/dev.py test
quick:
	python3 scripts/dev.py quick
bench:
	python3 scripts/dev.py bench
protos:
	python3 scripts/dev.py protos
clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
