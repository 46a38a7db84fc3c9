# The outbox CLI as images, used by docker-compose.yml. Three targets:
#   outbox     relay, sweeper, migrations, status (small: no Java, no Spark);
#   console    the same plus the console extra, for `outbox console`;
#   reconcile  the same plus Java 17, the PostgreSQL JDBC driver and the spark extra, for
#              `outbox reconcile` (local[*] inside the container, or --master of a cluster).
FROM python:3.11-slim-bookworm AS outbox
WORKDIR /app
COPY pyproject.toml README.md ./
COPY outbox ./outbox
COPY relay ./relay
COPY migrations ./migrations
COPY spark ./spark
RUN pip install --no-cache-dir . && useradd --system --uid 10001 outbox
USER outbox
ENTRYPOINT ["outbox"]
CMD ["--help"]

FROM outbox AS console
USER root
RUN pip install --no-cache-dir '.[console]'
USER outbox
EXPOSE 8089
CMD ["console", "--help"]

FROM outbox AS reconcile
USER root
# Debian's JDBC jar lands at /usr/share/java/postgresql.jar, OUTBOX_RECONCILE_JDBC_JAR's default.
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir '.[spark]' \
    && install -d -o outbox /var/lib/outbox /var/lib/outbox/reconcile
ENV HOME=/var/lib/outbox OUTBOX_RECONCILE_OUTPUT_DIR=/var/lib/outbox/reconcile
USER outbox
CMD ["reconcile", "--help"]
