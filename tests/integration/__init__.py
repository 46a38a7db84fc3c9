"""Behaviour against the real PostgreSQL and broker the session starts (tests/conftest.py)."""
