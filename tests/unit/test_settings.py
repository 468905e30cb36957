"""Settings are declared once (router/settings.py): the launcher's command line, its environment variables and
the router's configuration all come from that declaration. Pure: typer's test runner, no server."""
import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from launcher.main import app as launcher_app
from router.server import api_key
from router.settings import ENV, Settings, settings_command


def flags() -> list[str]:
    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(Settings)]


@pytest.mark.parametrize("width", [40, 80])
def test_every_flag_is_shown_whole_at_any_width(width):
    out = CliRunner().invoke(launcher_app, ["--help"], terminal_width=width)
    assert out.exit_code == 0, out.output
    for flag in flags():
        assert flag in out.output.split(), f"{flag} is cut in --help at {width} columns"


def recorder(**kwargs):
    app, seen = typer.Typer(), {}

    @app.command()
    @settings_command(**kwargs)
    def main(settings, label: str = "x"):
        seen.update(settings=settings, label=label)

    return app, seen


def test_flags_and_environment_variables_come_from_the_declaration():
    app, seen = recorder()
    out = CliRunner().invoke(app, ["--max-batch-size", "3", "--no-prefix-caching", "--label", "y"],
                             env={"SCHEDULER": "prefill_first", "MAX_BATCH_SIZE": "9"})
    assert out.exit_code == 0, out.output
    s = seen["settings"]
    assert (s.max_batch_size, s.prefix_caching, s.scheduler, seen["label"]) == (3, False, "prefill_first", "y")
    assert s.margin == 0.0 and Settings().margin == 0.15  # the policy's own default, unless given
    assert s == dataclasses.replace(Settings(), max_batch_size=3, prefix_caching=False, scheduler="prefill_first")


def test_a_choice_outside_the_declared_ones_is_refused():
    app, _ = recorder()
    out = CliRunner().invoke(app, ["--scheduler", "lifo"])
    assert out.exit_code == 2 and "lifo" in out.output


def test_optional_settings_are_none_unless_given():
    app, seen = recorder(names=("max_batch_size", "prefix_caching"), optional=True)
    out = CliRunner().invoke(app, ["--no-prefix-caching"], env={"MAX_BATCH_SIZE": "9"})
    assert out.exit_code == 0, out.output
    assert seen["settings"] == {"max_batch_size": None, "prefix_caching": False}


def test_the_router_receives_exactly_what_the_launcher_settled_on(monkeypatch):
    chosen = Settings(max_batch_size=5, api_key="s3cret", served_model_name="m", safety_margin=0.5)
    monkeypatch.setenv(ENV, chosen.to_json())
    assert Settings.from_env() == chosen and Settings.from_env().model_name == "m"
    monkeypatch.delenv(ENV)
    assert Settings.from_env() == Settings() and Settings().model_name == "smollm2"


def test_the_api_key_comes_from_the_flag_its_variable_or_a_file(tmp_path):
    app, seen = recorder()
    assert CliRunner().invoke(app, [], env={"API_KEY": "a"}).exit_code == 0
    assert api_key(seen["settings"]) == "a"
    path = tmp_path / "key"
    path.write_text("  from-file\n")
    assert CliRunner().invoke(app, [], env={"API_KEY_FILE": str(path)}).exit_code == 0
    assert seen["settings"].api_key is None and api_key(seen["settings"]) == "from-file"
    assert api_key(Settings()) is None


@pytest.mark.parametrize("settings, reason", [
    (dict(api_key="a", api_key_file="key"), "both given"),
    (dict(api_key_file="missing"), "cannot read it"),
    (dict(api_key_file="empty"), "is empty"),  # an empty key would leave every route open
])
def test_an_api_key_file_that_cannot_be_used_is_refused(tmp_path, settings, reason):
    (tmp_path / "key").write_text("k")
    (tmp_path / "empty").write_text("\n")
    settings["api_key_file"] = str(tmp_path / settings["api_key_file"])
    with pytest.raises(ValueError, match=reason):
        api_key(Settings(**settings))
