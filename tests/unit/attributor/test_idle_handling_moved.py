"""Sharing idle cost to pods moved from the attributor to billing (services.billing.sharing): one place, on money.

The streaming attributor cannot configure billing, another process: ``--idle-handling spread`` (or
``GPUMETER_IDLE_HANDLING=spread``) stops it at start with the setting to use instead, rather than being ignored (which
would change what pods pay). ``keep`` is what the attributor does and stays accepted. ``gpumeter replay`` runs
billing too, so there ``--idle spread`` is billing's ``idle=weighted``."""

from __future__ import annotations

import argparse

import pytest

from gpumeter.errors import ConfigError, SettingError
from pipeline.cli import sharing_with_idle_handling
from services.attributor.settings import IDLE_SPREAD_MOVED, add_arguments, attributor_settings
from services.billing.sharing import ShareMethod


def _settings(argv, env=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return attributor_settings(parser.parse_args(argv), env or {})


def test_spread_stops_the_attributor_with_billings_setting_to_use():
    for argv, env, source in ((["--idle-handling", "spread"], {}, "--idle-handling"),
                              ([], {"GPUMETER_IDLE_HANDLING": "Spread"}, "GPUMETER_IDLE_HANDLING")):
        with pytest.raises(SettingError) as caught:
            _settings(argv, env)
        # The loader's one error shape: the setting's names and value, then the reason.
        assert caught.value.reason == IDLE_SPREAD_MOVED
        assert (caught.value.flag, caught.value.env, caught.value.source) == (
            "--idle-handling", ("GPUMETER_IDLE_HANDLING",), source)
        assert str(caught.value).endswith(IDLE_SPREAD_MOVED)
        assert "GPUMETER_BILLING_SHARING=idle=weighted" in str(caught.value)
    assert _settings(["--idle-handling", "keep"]).policy.describe() == "cost=memory mps=memory"
    with pytest.raises(ConfigError):
        _settings(["--idle-handling", "share"])


def test_replays_idle_spread_is_billings_idle_weighted_unless_sharing_says_otherwise():
    assert sharing_with_idle_handling("", "spread").idle is ShareMethod.WEIGHTED
    assert sharing_with_idle_handling("", "keep").describe() == "keep"
    assert sharing_with_idle_handling("idle=even,node_other=weighted", "spread").describe() == (
        "idle=even,node_other=weighted")
    with pytest.raises(ConfigError):
        sharing_with_idle_handling("", "sometimes")
