"""PySpark reconciliation of the outbox tables against the Kafka topics.

``reconcile.py`` is the job (``outbox reconcile``, also under spark-submit);
``queries.py`` holds its SQL, ``sources.py`` its JDBC and Kafka reads, ``kafka_source.py``
the Python data source over kafka-python, ``catalogue.py`` the findings and their
thresholds (no PySpark), ``findings.py`` how each is found, ``report.py`` the short text
report.
"""
