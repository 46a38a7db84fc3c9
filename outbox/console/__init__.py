"""``outbox console``: the page an operator opens at 3 a.m. (the ``console`` extra).

``overview`` reads what the page shows through ``outbox.store``; ``scrape`` reads the relays'
and sweepers' metrics; ``guard`` holds the rules an action must pass; ``app`` serves it all.
"""
