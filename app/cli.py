"""`ppserve`: serve (OpenAI endpoint on Ray Serve), generate (one-off), bench (GPU bench and
`bench serve`, a load client for a running endpoint)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from app.config import DTYPES, KV_ADMISSIONS, OUTPUT_POSTS, SKIP_MODES

# (flag, EngineConfig field, type, help). Defaults come from EngineConfig, so None = its default.
ENGINE_FLAGS = [
    ("--model", "model", str, "Local Hugging Face directory (config.json, *.safetensors, "
     "tokenizer.json). Default: a small built-in random Llama with a byte tokenizer."),
    ("--served-model-name", "served_model_name", str, "Model name the API answers to "
     "(default: the --model path, or 'ppserve-random')."),
    ("--pp", "pp_size", int, "Pipeline stages, each a Ray actor with a contiguous range of "
     "layers (default 2)."),
    ("--device", "device", str, "cpu or cuda; cuda puts each stage on its own GPU (default cpu)."),
    ("--dtype", "dtype", str, f"Weights and activations, one of {DTYPES}; auto = float32 on "
     "CPU, bfloat16 on CUDA."),
    ("--chunk-size", "chunk_size", int, "Prefill tokens of one request per microbatch: long "
     "prompts are cut into chunks of this size (default 512)."),
    ("--pp-output-skip", "pp_output_skip", str, "When the last stage sends sampled tokens back "
     "to stage 0: off = always; sglang = SGLang's rule (lone prefill-only chunk); auto = "
     "whenever no row's token is needed at stage 0 (default auto)."),
    ("--output-post", "output_post", str, "Where stage 0 posts the output recv: early = at "
     "dispatch; late = just before its consumer (default early)."),
    ("--max-model-len", "max_model_len", int, "Longest prompt + completion in tokens "
     "(default: the model's max_position_embeddings). Longer prompts get a 400."),
    ("--max-num-seqs", "max_num_seqs", int, "Most requests running at once (default 64)."),
    ("--max-waiting-requests", "max_waiting_requests", int, "Most requests waiting for "
     "admission; past it new requests get a 429 with Retry-After (default: no bound)."),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "Token budget of one "
     "microbatch (default: --chunk-size)."),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "Fraction of each GPU a "
     "stage may use for weights + KV cache (default 0.9)."),
    ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", int, "KV cache bytes per stage on "
     "CPU (default 1 GiB)."),
    ("--block-size", "block_size", int, "Tokens per KV cache block (default 64)."),
    ("--max-inflight", "max_inflight", int, "Microbatches in flight across the pipeline "
     "(default: --pp, or 2 x --pp with --run-ahead)."),
    ("--run-ahead", "run_ahead", bool, "Plan a request's next decode step as soon as its "
     "previous one is dispatched (stage 0 reads the token from the output channel), at least "
     "--pp microbatches later, instead of waiting for the token to return to the host."),
    ("--kv-admission", "kv_admission", str, "reserve = admit a request once the KV pool can "
     "reserve its prompt + max_tokens (default, never preempts); on-demand = admit on its "
     "prompt's blocks, allocate as it grows, and preempt (recompute) the youngest request when "
     "blocks run out."),
    ("--enable-dynamic-chunking", "enable_dynamic_chunking", bool, "Size each chunk of a long "
     "prompt to cost about what its first chunk (--chunk-size tokens) costs, from the model's "
     "FLOPs: chunks shrink as attention over the cached prefix grows, so a pipeline drains "
     "sooner (SGLang's --enable-dynamic-chunking). For --pp > 1."),
    ("--dynamic-chunk-smooth", "dynamic_chunk_smooth", float, "With dynamic chunking: 1 = "
     "equal-cost chunks, 0 = fixed --chunk-size, between = a blend (default 0.75)."),
    ("--warmup-len", "warmup_len", int, "At startup, build the attention kernels (cuDNN graphs, "
     "~50 ms per chunk shape on H200) for every chunk of a prompt this long, so the first long "
     "requests do not pay for them (default: the longest prompt that fits; 0 = none)."),
    ("--placement-strategy", "placement_strategy", str, "Ray placement group strategy for a "
     "pipeline's stages: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD (default PACK)."),
    ("--load-format", "load_format", str, "auto = read the checkpoint's weights; dummy = "
     "its config.json's shapes with seeded random weights (benchmarks)."),
    ("--linear-backend", "linear_backend", str, "Linear layers: auto (cuBLAS via torch), torch, "
     "triton-persistent (grid = SMs) or triton-persistent-sm1 (grid = SMs - 1); CUDA only "
     "for the Triton ones."),
    ("--attention-backend", "attention_backend", str, "Attention: auto or torch (SDPA with a "
     "bottom-right causal mask over the paged prefix)."),
    ("--channel-check", "channel_check", bool, "Test mode: every channel message carries a "
     "checked header (microbatch, sequence, bytes), and on CUDA a device sync while a recv is "
     "posted fails the stage."),
    ("--stage-num-cpus", "stage_num_cpus", float, "Logical Ray CPUs per stage on CPU "
     "(default 1)."),
]


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    choices = {"device": ("cpu", "cuda"), "dtype": DTYPES, "pp_output_skip": SKIP_MODES,
               "kv_admission": KV_ADMISSIONS,
               "output_post": OUTPUT_POSTS, "load_format": ("auto", "dummy")}
    for flag, dest, typ, help_ in ENGINE_FLAGS:
        if typ is bool:
            g.add_argument(flag, dest=dest, action="store_true", default=None, help=help_)
            continue
        g.add_argument(flag, dest=dest, type=typ, default=None, help=help_,
                       choices=choices.get(dest))
    g.add_argument("--num-cpus", type=int, default=None, help="Logical CPUs of the local Ray "
                   "cluster ppserve starts (default: enough for the stages, at least the "
                   "machine's cores). Ignored with --address.")
    g.add_argument("--address", default=None, help="Join an existing Ray cluster (e.g. 'auto' "
                   "or 'ray://head:10001') instead of starting a local one.")


def engine_args(a: argparse.Namespace) -> dict:
    return {dest: getattr(a, dest) for _, dest, _, _ in ENGINE_FLAGS
            if getattr(a, dest) is not None}


def _init_ray(a, metrics_port: int | None = None) -> None:
    import ray

    if a.address:
        ray.init(address=a.address)
        return
    pp = a.pp_size or 2
    need = int(pp * (a.stage_num_cpus or 1.0) + 2)
    kwargs = {"_metrics_export_port": metrics_port} if metrics_port else {}
    ray.init(num_cpus=a.num_cpus or max(os.cpu_count() or 1, need), include_dashboard=False,
             **kwargs)


def _interrupt(*_):
    raise KeyboardInterrupt


def cmd_serve(a) -> int:
    from ray import serve

    from app.server import build_app

    args = engine_args(a)
    if a.api_key:
        args["api_key"] = a.api_key
    if a.num_replicas:
        args["num_replicas"] = a.num_replicas
    if a.max_request_bytes is not None:
        args["max_request_bytes"] = a.max_request_bytes
    app = build_app(args)  # validates the flags before anything starts
    _init_ray(a, a.metrics_port)
    # SIGTERM (docker stop, kill) shuts down as cleanly as Ctrl-C.
    # SIGINT too: a shell that backgrounds the process would otherwise leave it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(app, name="ppserve", route_prefix="/")
        host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
        print(f"ppserve: OpenAI API at http://{host}:{a.port}/v1 "
              f"(model {args.get('served_model_name') or args.get('model') or 'ppserve-random'})")
        if not a.address:
            print(f"ppserve: Prometheus metrics at http://{host}:{a.metrics_port}/metrics")
        print("ppserve: Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("ppserve: shutting down", flush=True)
    finally:
        import ray

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def cmd_generate(a) -> int:
    from app.config import EngineConfig
    from app.engine import Engine
    from app.request import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos,
                            stop=tuple(a.stop or ()))
    if a.address:
        import ray

        ray.init(address=a.address)
    engine = Engine(EngineConfig.from_dict(engine_args(a)), num_cpus=a.num_cpus)
    try:
        for out in engine.generate([a.prompt], params):
            print(out.text)
            print(f"[{out.completion_tokens} tokens, finish_reason={out.finish_reason}]",
                  file=sys.stderr)
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ppserve", description="Pipeline-parallel LLM serving "
                                "on Ray, OpenAI-compatible, built for long prompts.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="Serve the OpenAI API (Ray Serve).",
                       description="Start (or join) a Ray cluster and serve the OpenAI API: "
                       "/v1/completions, /v1/chat/completions, /v1/models, /health.")
    add_engine_flags(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address the HTTP server binds to; "
                   "0.0.0.0 to accept other machines (default 127.0.0.1).")
    g.add_argument("--port", type=int, default=8000, help="HTTP port of the API (default 8000).")
    g.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus metrics "
                   "export port (http://HOST:PORT/metrics; names start with ray_ppserve_; "
                   "default 8080). Ignored with --address: the cluster's own port serves them.")
    g.add_argument("--api-key", default=os.environ.get("PPSERVE_API_KEY"), help="Require "
                   "'Authorization: Bearer KEY' on /v1/* (default: $PPSERVE_API_KEY, or none).")
    g.add_argument("--num-replicas", type=int, default=None, help="Pipelines (Serve replicas "
                   "of PipelineServer) to run (default 1).")
    g.add_argument("--max-request-bytes", type=int, default=None, help="Largest request body "
                   "accepted; larger ones get a 413 (default 32 MiB).")
    s.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="Generate once from a prompt, without a server.")
    gen.add_argument("prompt")
    add_engine_flags(gen)
    g = gen.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate.")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    g.add_argument("--top-k", type=int, default=0, help="Sample from the k best (0 = all).")
    g.add_argument("--seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--ignore-eos", action="store_true", help="Keep going past EOS.")
    g.add_argument("--stop", action="append", help="Stop string (repeatable).")
    gen.set_defaults(func=cmd_generate)

    # Listed for --help only: main() hands everything after `bench` to the bench's own parser.
    sub.add_parser("bench", add_help=False, help="'bench serve': load a running endpoint; "
                   "'bench engine' (the default), 'bench contention', 'bench load', "
                   "'bench attention': GPU benches. "
                   "'ppserve bench serve --help' etc. for their flags.")
    return p


def cmd_bench(rest: list[str]) -> int:
    """serve: load a running endpoint; engine / contention (GPU benches); else the engine."""
    benches = {"serve": "app.bench_serve", "engine": "app.bench",
               "contention": "app.bench_contention", "load": "app.bench_load",
               "attention": "app.bench_attention"}
    which = rest[0] if rest and rest[0] in benches else "engine"
    if rest and rest[0] == which:
        rest = rest[1:]
    module = benches[which]
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
    sys.exit(main())
