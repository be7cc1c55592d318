"""One processing contract (``contract``), one runner (``runner``) and the drivers that run processors: the
in-memory broker (``memory``) for replay and tests; the Kafka drivers live with the services that use them."""
