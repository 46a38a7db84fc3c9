"""A writer process for the chaos test: random transactions, some rolled back, some with
several messages, some delayed; it records each message's outcome as JSON lines."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from datetime import timedelta

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.settings import sqlalchemy_url


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--url", "--schema", "--topic", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--at-least", type=int, default=0,
                        help="go on after --seconds until this many messages are committed "
                             "(a slow machine still reaches the volume; capped at 5x --seconds)")
    parser.add_argument("--sizes", default="1,1,2,3",
                        help="messages per transaction, one of these at random")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    engine = create_engine(sqlalchemy_url(args.url), pool_pre_ping=True)
    outbox = Outbox(schema=args.schema)
    sizes = [int(size) for size in args.sizes.split(",")]
    started = time.monotonic()
    end, cap = started + args.seconds, started + 5 * args.seconds
    committed = 0
    with open(args.out, "w") as out:
        while time.monotonic() < end or (committed < args.at_least and time.monotonic() < cap):
            tags = [uuid.uuid4().hex for _ in range(rng.choice(sizes))]
            # keys in a consistent order, as the docs advise: random orders deadlock on the
            # key locks of big transactions
            keys = sorted(f"key-{rng.randrange(100)}" for _ in tags)
            rollback = rng.random() < 0.25
            outcome = "rollback" if rollback else "commit"
            try:
                with Session(engine) as session:
                    session.begin()
                    for tag, key in zip(tags, keys, strict=True):
                        delay = timedelta(seconds=rng.uniform(0.2, 2)) if rng.random() < 0.1 \
                            else None
                        outbox.publish(session, args.topic, {"tag": tag},
                                       key=key, deliver_after=delay)
                    if rollback:
                        session.rollback()
                    else:
                        session.commit()
            except Exception as exc:  # PostgreSQL restarting: the outcome is not known here
                print(f"chaos writer: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                      file=sys.stderr)
                outcome = "uncertain"
                time.sleep(0.2)
            committed += len(tags) if outcome == "commit" else 0
            for tag in tags:
                out.write(json.dumps({"tag": tag, "outcome": outcome}) + "\n")
            out.flush()
            time.sleep(rng.uniform(0, 0.01))
    engine.dispose()


if __name__ == "__main__":
    main()
