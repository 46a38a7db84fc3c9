# The two commands of the README: `make demo` (the whole flow) and `make test`
# (`make unit`: the fast tier alone).
VENV := .venv

.PHONY: demo test unit lint bench clean

demo:
	@scripts/bootstrap.sh dev,spark
	@$(VENV)/bin/python examples/orders_demo.py

test:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/pytest -q

# Pure functions, settings, CLI parsing and import rules: seconds, no database or broker.
unit:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/pytest -q tests/unit

lint:
	@scripts/bootstrap.sh dev,spark
	$(VENV)/bin/ruff check .
	scripts/typecheck.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
