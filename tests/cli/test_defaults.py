"""Each command's option defaults are its settings dataclass's defaults: `--help` shows what runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
import pytest

from cli.collect_cmd import collect
from cli.learn_cmd import learn
from cli.options import setting_default
from cli.proxy_cmd import proxy
from collectors.collect.settings import CollectSettings
from learner.settings import LearnSettings

RENAMED = {"poll_interval": "poll_interval_s"}  # collect's --poll-interval is CollectSettings.poll_interval_s


def proxy_config() -> type[Any]:
    from collectors.proxy import ProxyConfig

    return ProxyConfig


@pytest.mark.parametrize("command, settings", [(learn, lambda: LearnSettings), (collect, lambda: CollectSettings),
                                               (proxy, proxy_config)], ids=["learn", "collect", "proxy"])
def test_every_option_default_is_the_settings_default(command: click.Command, settings: Any) -> None:
    fields = {f.name: f.default for f in dataclasses.fields(settings()) if f.default is not dataclasses.MISSING}
    ctx = click.Context(command)
    compared = 0  # options without a default of their own (click's unset marker, None, ()) are not compared
    for param in command.params:
        name = RENAMED.get(param.name or "", param.name or "")
        default = param.get_default(ctx)
        given = isinstance(default, (int, float, str)) and not isinstance(default, bool)
        if isinstance(param, click.Option) and not param.is_flag and name in fields and given:
            assert default == fields[name], f"{command.name} --{param.name}: {default} != {fields[name]}"
            compared += 1
    assert compared >= 3, f"{command.name}: only {compared} options compared; did the option names change?"


def test_setting_default_reads_a_field_and_refuses_what_has_none() -> None:
    assert setting_default(LearnSettings, "lr") == LearnSettings.__dataclass_fields__["lr"].default
    with pytest.raises(TypeError, match="has no default"):
        setting_default(LearnSettings, "store")
    with pytest.raises(TypeError, match="has no field"):
        setting_default(LearnSettings, "no_such_knob")
