# The outbox CLI (relay, migrations) as an image, used by docker-compose.yml.
FROM python:3.11-slim-bookworm
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
