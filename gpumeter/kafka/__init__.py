"""Kafka plumbing shared by the services: topic administration, producing, consuming, dead letters."""
