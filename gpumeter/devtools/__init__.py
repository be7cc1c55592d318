"""Development and test infrastructure: a real Kafka broker, PostgreSQL and Alertmanager on loopback, and the set-up
that gets them on a machine with only Python and make (docs/setup.md); and the generator of the Grafana dashboard
(``dashboard``, docs/billing.md)."""
