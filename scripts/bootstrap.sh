#!/usr/bin/env bash
# Installs what the demo and the tests need on a fresh Debian machine: PostgreSQL's server
# binaries, Java, the PostgreSQL JDBC driver, promtool and Chromium (Debian packages, only if
# absent), a virtualenv in .venv and the project.
# Usage: scripts/bootstrap.sh [pip extras, e.g. dev,spark]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"

need=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || need+=(postgresql)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v setpriv >/dev/null || need+=(util-linux)
# The PostgreSQL JDBC driver for Spark reconciliation (outbox reconcile).
[ -f /usr/share/java/postgresql.jar ] || need+=(libpostgresql-jdbc-java)
# promtool checks and unit-tests the alert rules in deploy/prometheus (tests/unit/test_alert_rules.py).
command -v promtool >/dev/null || need+=(prometheus)
# A headless browser for the console's tests (tests/integration/test_console_browser.py).
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
# iptables silences chosen database connections (tests/blackhole.py).
command -v iptables >/dev/null || need+=(iptables)
# PgBouncer pools the test server in transaction and session mode (tests/pgbouncer.py).
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || need+=(pgbouncer)
# openssl makes the throwaway CA and certificates of the TLS tests (tests/certificates.py).
command -v openssl >/dev/null || need+=(openssl)
if [ "${#need[@]}" -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  "$python" -m venv .venv
fi
stamp=".venv/.installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing the project with extras [$extras] (first run takes a minute)"
  .venv/bin/pip install -q --disable-pip-version-check -e ".[$extras]"
  if [[ ",$extras," == *",dev,"* ]]; then
    # The Compose specification's JSON schema, for tests/test_compose.py: it ships in this
    # wheel, installed without its dependencies and never imported.
    .venv/bin/pip install -q --disable-pip-version-check --no-deps "docker-compose==1.29.2"
  fi
  touch "$stamp"
fi
# Byte-compile the project's own modules (pip compiled the installed packages): where
# PYTHONDONTWRITEBYTECODE is set, as on these machines, every process compiled each module it
# imported from source again, about 0.13 s of each outbox command's, relay's or sweeper's start.
.venv/bin/python -m compileall -q -j 0 outbox relay spark migrations tests examples bench
