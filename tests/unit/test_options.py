"""Every engine option is declared once, on EngineConfig, and every server option on ServerConfig:
the CLI flags come from them, and the README's flag table and the Helm values schema are checked
against them here."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from app.cli import add_engine_flags, build_parser, engine_args, flag_table, options_args
from app.config import EngineConfig
from app.options import option_names, option_type
from app.server_config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
FIELDS = dataclasses.fields(EngineConfig)
WITH_CHOICES = [f for f in FIELDS if f.metadata["choices"]]
JSON_TYPE = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    tuple: "array",
    dict: "object",
}


def test_readme_flag_table_is_generated_from_the_options():
    readme = (ROOT / "README.md").read_text()
    assert flag_table() in readme, (
        "README.md's flag table is stale: python -m app.cli --flag-table prints the current one"
    )


# A CLI string for the flag and the value it stands for, per option type.
SAMPLES = {
    int: ("3", 3),
    float: ("0.5", 0.5),
    str: ("x", "x"),
    tuple: ("https://a.test, https://b.test", ("https://a.test", "https://b.test")),
    dict: ('{"min_replicas": 1}', {"min_replicas": 1}),
}


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_every_option_has_help_and_a_cli_flag_of_its_type(cls):
    parser = build_parser()
    for f in dataclasses.fields(cls):
        assert f.metadata["help"].endswith("."), f.name
        flag = "--" + f.name.replace("_", "-")
        typ = option_type(cls, f)
        if typ is bool:
            argv = ["serve", flag]
            want = True
        elif f.metadata["choices"]:
            want = f.metadata["choices"][-1]
            argv = ["serve", flag, want]
        else:
            text, want = SAMPLES[typ]
            argv = ["serve", flag, text]
        got = options_args(parser.parse_args(argv), cls)
        assert got == {f.name: want}, (f.name, got)
        cls.from_dict(got)


def test_server_options_default_as_before():
    """The flags `ppserve serve` had before ServerConfig, with the same defaults."""
    s = ServerConfig()
    assert (s.host, s.port, s.metrics_port, s.api_key, s.num_replicas) == (
        "127.0.0.1",
        8000,
        8080,
        None,
        1,
    )
    assert (s.max_request_bytes, s.allowed_origins, s.ingress_num_cpus) == (32 << 20, (), 0.1)
    assert s.prefix_routing_max_queue is s.num_cpus is s.address is s.autoscaling_config is None
    assert ServerConfig.from_dict({"allowed_origins": ["https://a.test"]}).allowed_origins == (
        "https://a.test",
    )
    with pytest.raises(ValueError, match="not_an_option"):
        ServerConfig.from_dict({"not_an_option": 1})


def test_generate_takes_only_the_cluster_options():
    a = build_parser().parse_args(["generate", "hi", "--num-cpus", "4", "--address", "auto"])
    assert options_args(a, ServerConfig) == {"num_cpus": 4, "address": "auto"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--port", "1"])


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
    names = option_names(EngineConfig)
    assert {names[k] for k in engine} == {f.name for f in FIELDS}
    assert len(engine) == len(FIELDS), "one key per option"
    for key, prop in engine.items():
        _check_schema(schema, EngineConfig, names[key], prop)


# Where the chart's values hold a ServerConfig option under another name; the others of its
# build_app options are `serve.<name>`, and the rest reach build_app through serve.extraArgs.
HELM_NAMES = {
    "api_key": ("apiKey", "value"),
    "port": ("serve", "port"),
    "metrics_port": ("metricsPort",),
    "autoscaling_config": ("serve", "autoscaling"),
}


def _check_schema(schema: dict, cls: type, name: str, prop: dict) -> None:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    prop = schema["definitions"][prop["$ref"].split("/")[-1]] if "$ref" in prop else prop
    if f.metadata["choices"]:
        assert set(prop["enum"]) - {None} == set(f.metadata["choices"]), name
        return
    types = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    assert JSON_TYPE[option_type(cls, f)] in types, name
    bounds = {k: prop[k] for k in ("minimum", "exclusiveMinimum", "maximum") if k in prop}
    assert bounds == f.metadata["bounds"], name


def test_helm_values_schema_matches_the_server_options():
    from app.server_config import APP_KEYS

    schema = json.loads((ROOT / "charts" / "ppserve" / "values.schema.json").read_text())
    serve = schema["properties"]["serve"]["properties"]
    chart_only = {"runtimeEnv", "extraArgs"}
    in_serve = set(serve) - chart_only - {"autoscaling", "port"}
    assert in_serve <= set(APP_KEYS), "serve.* keys are build_app's server options"
    for name in in_serve:
        _check_schema(schema, ServerConfig, name, serve[name])
    for name, path in HELM_NAMES.items():
        prop = schema
        for key in path:
            prop = prop["properties"][key]
        if name == "autoscaling_config":
            assert prop["type"] == "object"
        else:
            _check_schema(schema, ServerConfig, name, prop)


@pytest.mark.parametrize(
    "cls,f",
    [
        (c, f)
        for c in (EngineConfig, ServerConfig)
        for f in dataclasses.fields(c)
        if f.metadata["bounds"]
    ],
    ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")),
)
def test_bounds_are_enforced_by_config(cls, f):
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
            cls(**{f.name: value})


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


def test_build_app_splits_its_args_and_refuses_the_launch_options():
    """build_app takes the engine's options and ServerConfig's app_arg ones; host, port and the
    other options `ppserve serve` reads itself are an error there, not silently ignored."""
    from app.server import split_args

    engine, server = split_args({"pp": 1, "num-replicas": 2, "allowed_origins": ["https://a.test"]})
    assert (engine.pp_size, server.num_replicas, server.allowed_origins) == (
        1,
        2,
        ("https://a.test",),
    )
    for key in ("host", "port", "metrics_port", "num_cpus", "address"):
        with pytest.raises(ValueError, match=key):
            split_args({key: 1})
