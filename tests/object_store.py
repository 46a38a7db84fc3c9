"""An S3-compatible object store on loopback (moto's server), where a Tansu broker started with
``--storage-engine s3://BUCKET/`` keeps its topics: they outlive a broker restart.

The embedded broker is built without its PostgreSQL storage engine (see
tests/integration/test_broker_modes.py), so an object store is its only durable storage here.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
from moto.server import ThreadedMotoServer

from outbox.dev.services import free_port

REGION = "eu-west-2"


@dataclass(frozen=True)
class ObjectStore:
    endpoint: str
    bucket: str

    @property
    def storage_engine(self) -> str:
        return f"s3://{self.bucket}/"

    def env(self) -> dict[str, str]:
        """What the broker needs to reach the store (moto accepts any key)."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": REGION}


@contextlib.contextmanager
def object_store() -> Iterator[ObjectStore]:
    """A fresh store with one empty bucket, stopped when the block ends (moto keeps its
    buckets per Python process, so each store's bucket has a new name)."""
    bucket = f"tansu-{uuid.uuid4().hex[:12]}"
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        store = ObjectStore(f"http://127.0.0.1:{port}", bucket)
        env = store.env()
        boto3.client("s3", endpoint_url=store.endpoint, region_name=REGION,
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
        yield store
    finally:
        server.stop()
