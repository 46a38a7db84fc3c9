"""The database URL as the reconciliation's JDBC reader takes it."""

from __future__ import annotations

import pytest

from outbox.spark.sources import jdbc_options


@pytest.mark.parametrize(("database_url", "jdbc_url"), [
    ("postgresql://app:pw@db:5433/shop", "jdbc:postgresql://db:5433/shop"),
    ("postgresql://app@db/shop?sslmode=require", "jdbc:postgresql://db:5432/shop?sslmode=require"),
    # an IPv6 host in brackets, as JDBC URLs write it (it lost them: ::1:5432 is no host)
    ("postgresql://app:pw@[::1]:5432/shop", "jdbc:postgresql://[::1]:5432/shop"),
    ("postgresql://app@[2001:db8::7]/shop", "jdbc:postgresql://[2001:db8::7]:5432/shop"),
    # several hosts, tried in order (it refused the URL: "needs a host")
    ("postgresql://app@/shop?host=standby:5433&host=primary&target_session_attrs=read-write",
     "jdbc:postgresql://standby:5433,primary:5432/shop?targetServerType=primary"),
    ("postgresql://app@/shop?host=[::1]:5433&host=::2&sslmode=require",
     "jdbc:postgresql://[::1]:5433,[::2]:5432/shop?sslmode=require"),
    # pgjdbc cuts the name at "?" and URL-decodes it ("+" is a space): it was put in raw
    ("postgresql://app@db/my%20db%3Fx", "jdbc:postgresql://db:5432/my%20db%3Fx"),
    ("postgresql://app@db/a+b%25c", "jdbc:postgresql://db:5432/a%2Bb%25c"),
])
def test_the_jdbc_url_names_the_same_server(database_url: str, jdbc_url: str) -> None:
    options = jdbc_options(database_url)
    assert options["url"] == jdbc_url
    assert options["user"] == "app"


def test_the_jdbc_connections_take_the_tcp_timeout_and_the_server_its_side() -> None:
    """pgjdbc had no timeout at all: a read from a silent server blocked for ever, and the
    session of a vanished executor lived on for the server's two hours."""
    options = jdbc_options("postgresql://app@db/shop?keepalives_count=5", tcp_timeout=30)
    assert options["url"] == "jdbc:postgresql://db:5432/shop"  # libpq's names left out
    assert (options["connectTimeout"], options["tcpKeepAlive"]) == ("30", "true")
    init = options["sessionInitStatement"]
    for setting in ("('tcp_keepalives_idle', '15')", "('tcp_keepalives_count', '5')",
                    "('tcp_user_timeout', '30000')", "('statement_timeout', '0')"):
        assert setting in init, init
