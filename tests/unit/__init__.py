"""Pure functions and the CLI's parsing, without PostgreSQL or a broker: `pytest tests/unit`."""
