"""The flags wrapper of `ft serve` / `ft generate` starts the FTW's read-ahead before it validates the settings (which
imports torch for `--device auto` / `cuda`: seconds on a cold disk that the read-ahead should already be using)."""

from __future__ import annotations

import inspect

import typer

from ft.cli import engine_flags as ef


def test_the_read_ahead_starts_before_the_settings_are_built(monkeypatch) -> None:
    @ef.engine_flags(exit_code=2)
    def command(ftw: str = typer.Option(..., "--ftw"), settings: ef.EngineSettings = None):
        return settings

    order = []
    monkeypatch.setattr(ef, "start_prefetch", lambda ftw: order.append(("read-ahead", ftw)))
    real = ef.EngineSettings
    monkeypatch.setattr(ef, "EngineSettings", lambda **kw: order.append(("settings", kw["device"])) or real(**kw))
    kw = {name: p.default.default for name, p in inspect.signature(command).parameters.items() if name != "ftw"}
    settings = command(ftw="/models/m.ftw", **{**kw, "device": "cpu"})
    assert order == [("read-ahead", "/models/m.ftw"), ("settings", "cpu")]
    assert settings.device == "cpu"
