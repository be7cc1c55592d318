"""Subcommands of ``gpumeter`` that are tools rather than services."""
