# The two commands of the README: `make demo` (the whole flow) and `make test` (WORKERS xdist
# workers, each with its own PostgreSQL and broker, a test file at a time: about 12 minutes on
# 2 cores with 3, where 2 left the cores idle half the time and took 15). `make unit`: the fast
# tier alone; `make bench`: the benchmark table in BENCHMARKS.md.
VENV := .venv
WORKERS ?= 3

.PHONY: demo test unit lint bench soak clean

demo:
	@scripts/bootstrap.sh dev,spark
	@$(VENV)/bin/python examples/orders_demo.py

test:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# Pure functions, settings, CLI parsing and import rules: seconds, no database or broker.
unit:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/pytest -q tests/unit

# Issue 10's figures on fresh embedded services, one table of ratios from one run, written into
# BENCHMARKS.md (a few minutes; `make bench BENCH_ARGS=--quick` for smaller runs).
bench:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/python bench/run_all.py $(BENCH_ARGS)

# Issue 10's long figures: commit → ack latency per minute, retention under load (about 25 min;
# `make soak SOAK_ARGS="--minutes 3 --client confluent"`).
soak:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/python bench/soak.py $(SOAK_ARGS)

lint:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/ruff check .
	scripts/typecheck.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
