"""Development and test infrastructure: a real Kafka broker and PostgreSQL server on loopback."""
