"""Every study's flags come from its config dataclass: one flag per field, `--quick` the
study's preset (a `dataclasses.replace` of its defaults) with given flags on top, options
shared between studies defined once (same default, same help), no hand-written flags.

    python -m pytest -q tests/experiments/test_study_options.py
"""

import dataclasses
from pathlib import Path

import pytest

from experiments.__main__ import COMMANDS, STUDIES
from experiments.cli import build_parser, flag, options_from_args
from experiments.options import BenchOptions
from jaxpar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# The same meaning in every study that has them (a study's batch size or model is its design).
SHARED = ("iters", "warmup", "val_size", "seed", "max_epochs", "timeout", "dataset")


def parse(*argv):
    args = build_parser(COMMANDS).parse_args(list(argv))
    study = STUDIES[args.command]
    return options_from_args(args, study.quick if args.quick else study.config())


@pytest.mark.parametrize("name", list(STUDIES))
def test_every_field_is_a_flag_and_quick_is_the_preset(name):
    study = STUDIES[name]
    assert dataclasses.is_dataclass(study.config) and study.config.__dataclass_params__.frozen
    assert type(study.quick) is study.config and study.quick != study.config()
    assert parse(name) == study.config()
    assert parse(name, "--quick") == study.quick
    assert parse(name, "--quick", "--out", "elsewhere") == dataclasses.replace(study.quick, out="elsewhere")
    for f in dataclasses.fields(study.config):  # each field's flag sets that field
        value = getattr(study.quick, f.name)
        if value is None or value == getattr(study.config(), f.name):
            continue
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        argv = [flag(f.name) if value is not False else "--no-" + flag(f.name)[2:]]
        argv += [] if isinstance(value, bool) else [text]
        assert getattr(parse(name, *argv), f.name) == value, f.name


def test_options_shared_by_studies_have_one_default_and_one_help():
    for option in SHARED:
        fields = [f for s in STUDIES.values() for f in dataclasses.fields(s.config) if f.name == option]
        fields += [f for f in dataclasses.fields(BenchOptions) if f.name == option]
        assert len(fields) > 1 and len({f.default for f in fields}) == 1, option
        assert len({f.metadata["help"] for f in fields}) == 1, option


def test_list_flags_are_checked_naming_the_flag():
    assert parse("scaling", "--device-counts", "1, 2").device_counts == (1, 2)
    with pytest.raises(ConfigError, match="--device-counts takes comma-separated ints"):
        parse("scaling", "--device-counts", "1,two")
    with pytest.raises(ConfigError, match="--models 'mlp,gpt': unknown gpt; choices: mlp, cnn"):
        parse("scaling", "--models", "mlp,gpt")


def test_no_study_writes_its_own_flags():
    """argparse calls live in the CLI's generator alone."""
    hand_written = [p.name for p in (ROOT / "experiments").rglob("*.py")
                    if p.name != "cli.py" and "add_argument(" in p.read_text()]
    assert hand_written == []
