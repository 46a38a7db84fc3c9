"""PySpark reconciliation of the outbox tables against the Kafka topics.

``reconcile.py`` is the job (``outbox reconcile``, also under spark-submit);
``queries.py`` holds its SQL, ``sources.py`` its JDBC and Kafka reads, ``kafka_source.py``
the Python data source over kafka-python, ``findings.py`` how each finding (named, with
its default threshold, in ``outbox/findings.py``) is found, ``report.py`` the short text
report, ``progress.py`` the lines a run logs while its Spark jobs work.
"""
