"""The daemons: the relay (prepare rows → Kafka) and, later, the check-back sweeper."""
