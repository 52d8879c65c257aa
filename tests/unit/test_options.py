"""Every engine option is declared once, on EngineConfig: the CLI flags come from it, and the
README's flag table and the Helm values schema are checked against it here."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from app.cli import add_engine_flags, build_parser, engine_args, flag_table
from app.config import EngineConfig, option_names, option_type

ROOT = Path(__file__).resolve().parents[2]
FIELDS = dataclasses.fields(EngineConfig)
WITH_CHOICES = [f for f in FIELDS if f.metadata["choices"]]


def test_readme_flag_table_is_generated_from_the_options():
    readme = (ROOT / "README.md").read_text()
    assert flag_table() in readme, (
        "README.md's flag table is stale: python -m app.cli --flag-table prints the current one"
    )


def test_every_option_has_help_and_a_cli_flag_of_its_type():
    parser = build_parser()
    for f in FIELDS:
        assert f.metadata["help"].endswith("."), f.name
        flag = "--" + f.name.replace("_", "-")
        typ = option_type(f)
        if typ is bool:
            argv = ["serve", flag]
            want = True
        else:
            sample = {int: 3, float: 0.5, str: "x"}[typ]
            want = f.metadata["choices"][-1] if f.metadata["choices"] else sample
            argv = ["serve", flag, str(want)]
        got = engine_args(parser.parse_args(argv))
        assert got == {f.name: want}, (f.name, got)
        EngineConfig.from_dict(got)


@pytest.mark.parametrize(
    "flag,field",
    [
        ("--pp", "pp_size"),
        ("--pipeline-parallel-size", "pp_size"),
        ("--seed", "seed"),
        ("--num-gpu-blocks-override", "num_kv_blocks"),
    ],
)
def test_vllm_flag_names(flag, field):
    got = engine_args(build_parser().parse_args(["serve", flag, "3"]))
    assert got == {field: 3}
    assert getattr(EngineConfig.from_dict({flag.lstrip("-"): 3}), field) == 3


def test_generate_keeps_seed_for_sampling():
    a = build_parser().parse_args(["generate", "hi", "--seed", "5"])
    assert a.sampling_seed == 5 and "seed" not in engine_args(a)


@pytest.mark.parametrize("f", WITH_CHOICES, ids=lambda f: f.name)
def test_choices_are_enforced_by_config_and_cli(f):
    with pytest.raises(ValueError, match=f.name):
        EngineConfig(**{f.name: "no-such-choice"})
    import argparse

    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_flags(p)
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        p.parse_args(["--" + f.name.replace("_", "-"), "no-such-choice"])


def test_helm_values_schema_matches_the_options():
    schema = json.loads((ROOT / "charts" / "ppserve" / "values.schema.json").read_text())
    engine = schema["properties"]["engine"]["properties"]
    names = option_names()
    assert {names[k] for k in engine} == {f.name for f in FIELDS}
    assert len(engine) == len(FIELDS), "one key per option"
    defs = schema["definitions"]
    for key, prop in engine.items():
        f = next(f for f in FIELDS if f.name == names[key])
        prop = defs[prop["$ref"].split("/")[-1]] if "$ref" in prop else prop
        if f.metadata["choices"]:
            assert set(prop["enum"]) - {None} == set(f.metadata["choices"]), key
            continue
        types = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
        json_type = {bool: "boolean", int: "integer", float: "number", str: "string"}
        assert json_type[option_type(f)] in types, key
        bounds = {k: prop[k] for k in ("minimum", "exclusiveMinimum", "maximum") if k in prop}
        assert bounds == f.metadata["bounds"], key


@pytest.mark.parametrize("f", [f for f in FIELDS if f.metadata["bounds"]], ids=lambda f: f.name)
def test_bounds_are_enforced_by_config(f):
    bounds = f.metadata["bounds"]
    bad = []
    if "minimum" in bounds:
        bad.append(bounds["minimum"] - 1)
    if "exclusiveMinimum" in bounds:
        bad.append(bounds["exclusiveMinimum"])
    if "maximum" in bounds:
        bad.append(bounds["maximum"] + 1)
    for value in bad:
        with pytest.raises(ValueError, match=f.name):
            EngineConfig(**{f.name: value})


@pytest.mark.parametrize(
    "name,value",
    [("chunk_size", "512"), ("pp_size", True), ("enable_prefix_caching", 1), ("device", None)],
)
def test_types_are_enforced_by_config(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: value})


def _tuple_literals(path: Path) -> set[tuple]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Tuple)
            and node.elts
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
        ):
            found.add(tuple(e.value for e in node.elts))
    return found


def test_each_tuple_of_choices_is_written_once():
    files = sorted(p for d in ("app", "stages") for p in (ROOT / d).rglob("*.py"))
    literals = {p: _tuple_literals(p) for p in files}
    for f in WITH_CHOICES:
        choices = tuple(c for c in f.metadata["choices"] if c != "auto")
        if len(choices) < 2:
            continue
        where = [
            p.relative_to(ROOT).as_posix()
            for p, lits in literals.items()
            if choices in lits or ("auto", *choices) in lits
        ]
        assert len(where) <= 1, f"{f.name}'s choices are written in {where}"
