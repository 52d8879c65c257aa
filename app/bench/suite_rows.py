"""The benchmark manifest: every headline figure of docs/PERFORMANCE.md as one row, the bench
module and arguments that measure it, its hardware and the target it is read against.

`ppserve bench suite` runs rows as subprocesses (`python -m app.bench.MODULE ARGS --out F`).
A row's args never hold --out: the suite picks the file. Subsets name groups of rows:
`smoke` (tiny shapes on CPU, run by `make test`), `h200-headline` (meant for one 8-minute
device call on one H200: 505 s at 8eda428), `h200` (every 1 x H200 row), `h200x2` (the two-GPU
rows: PP=2, and one stage of --tp 2). Each row's JSON is written when it ends, so a call cut
short keeps the rows it finished.
"""

from __future__ import annotations

from dataclasses import dataclass

HARDWARE = ("cpu", "1xH200", "2xH200")
KINDS = ("ttft", "decode")  # which figures the suite reads from the bench's JSON


@dataclass(frozen=True)
class Row:
    name: str
    shape: str  # --model-shape of the bench (app.bench.target.MODEL_SHAPES)
    module: str  # app.bench.<module>
    args: tuple[str, ...]
    hardware: str
    kind: str
    target: str  # what the figure is read against
    subsets: tuple[str, ...] = ()


def _ttft(
    shape: str, runs: str, *extra: str, linear: str = "auto", reps: int = 1
) -> tuple[str, ...]:
    return (
        "--model-shape", shape, "--pp", "1", "--linear", linear, "--runs", runs,
        "--modes", "auto", "--reps", str(reps), *extra,
    )  # fmt: skip


def _decode(shape: str, rows: int | str, tokens: int, *extra: str) -> tuple[str, ...]:
    return (
        "--model-shape", shape, "--pp", "1", "--device", "cuda", "--parts", "decode",
        "--decode-concurrency", str(rows), "--decode-tokens", str(tokens), "--reps", "1",
        "--decode-modes", "auto", "--run-ahead", "--no-reference", *extra,
    )  # fmt: skip


FP8 = ("--quantization", "fp8", "--kv-cache-dtype", "fp8")
BF16 = ("--quantization", "none", "--kv-cache-dtype", "auto")
SHORT = "65536:8192,131072:8192"
LONG = SHORT + ",262144:8192"
HEAD = ("h200", "h200-headline")

ROWS: tuple[Row, ...] = (
    # smoke: the built-in tiny model on CPU, seconds each; keeps every code path of the suite
    # (subprocess, both JSON readers, distance, report) under `make test`.
    Row("smoke-ttft", "tiny", "engine",
        ("--model-shape", "tiny", "--pp", "1", "--device", "cpu", "--linear", "torch",
         "--runs", "256:64", "--modes", "auto", "--reps", "1"),
        "cpu", "ttft", "runs at all", ("smoke",)),
    Row("smoke-decode", "tiny", "load",
        ("--model-shape", "tiny", "--pp", "1", "--device", "cpu", "--parts", "decode",
         "--decode-concurrency", "2,4", "--decode-tokens", "8", "--reps", "1",
         "--decode-modes", "auto"),
        "cpu", "decode", "runs at all", ("smoke",)),
    # TTFT per model shape and length, PP=1, bf16 (medians over reps)
    Row("ttft-llama8b", "llama8b", "engine", _ttft("llama8b", SHORT, linear="torch"),
        "1xH200", "ttft", "128K 11.57 s (05f87ab); PP=2 must beat it 1.8x", HEAD),
    Row("ttft-llama8b-256k", "llama8b", "engine", _ttft("llama8b", "262144:8192", linear="torch"),
        "1xH200", "ttft", "no slower per token than 128K's growth predicts", ("h200",)),
    Row("ttft-qwen3-30b-a3b", "qwen3-30b-a3b", "engine", _ttft("qwen3-30b-a3b", SHORT),
        "1xH200", "ttft", "128K 13.93 s (session 3)", HEAD),
    Row("ttft-qwen3-30b-a3b-256k", "qwen3-30b-a3b", "engine",
        _ttft("qwen3-30b-a3b", "262144:8192"),
        "1xH200", "ttft", "its native context: runs, no slower per token than 128K", ("h200",)),
    Row("ttft-v32", "deepseek-v32-bench", "engine",
        _ttft("deepseek-v32-bench", "65536:4096", *BF16),
        "1xH200", "ttft", "64K 5.42 s (session 5); issue 23's target 6.0 s", HEAD),
    Row("ttft-v32-128k", "deepseek-v32-bench", "engine",
        _ttft("deepseek-v32-bench", "131072:8192", *BF16),
        "1xH200", "ttft", "16.35 s (session 5)", ("h200",)),
    Row("ttft-v32-256k", "deepseek-v32-bench", "engine",
        _ttft("deepseek-v32-bench", "262144:8192", *BF16),
        "1xH200", "ttft", "54.63 s (session 5)", ("h200",)),
    Row("ttft-v4-flash", "deepseek-v4-flash", "engine", _ttft("deepseek-v4-flash", LONG, *BF16),
        "1xH200", "ttft", "64K 1.30 s, 128K 2.72 s, 256K 6.11 s (session 6)", HEAD),
    # FP8 weights and FP8 KV against the bf16 rows above
    Row("ttft-v32-fp8", "deepseek-v32-bench", "engine",
        _ttft("deepseek-v32-bench", "65536:4096,131072:8192", *FP8),
        "1xH200", "ttft", "no slower than ttft-v32 (session 6: +2.1 % at 64K)", ("h200",)),
    Row("ttft-v4-flash-fp8", "deepseek-v4-flash", "engine",
        _ttft("deepseek-v4-flash", LONG, *FP8),
        "1xH200", "ttft", "no slower than ttft-v4-flash (session 6: -0.5 to -1.4 %)", ("h200",)),
    Row("ttft-v4-flash-1m-fp8", "deepseek-v4-flash", "engine",
        _ttft("deepseek-v4-flash", "524288:8192,1040384:8192", *FP8),
        "1xH200", "ttft", "512K 14.55 s, 1,040,384 tokens 39.3 s (8a07cde); issue 35: <= 24 s",
        ("h200",)),
    # decode tok/s at 1 / 64 / 512 rows (CUDA graphs, run-ahead)
    Row("decode-llama8b-1", "llama8b", "load", _decode("llama8b", 1, 128),
        "1xH200", "decode", "a step near the weights' read time (16 GB / 4.8 TB/s = 3.3 ms)",
        HEAD),
    Row("decode-llama8b-64", "llama8b", "load", _decode("llama8b", 64, 128),
        "1xH200", "decode", "6,654 tok/s steady state (issue 12)", HEAD),
    Row("decode-llama8b-512", "llama8b", "load", _decode("llama8b", 512, 64),
        "1xH200", "decode", "more tok/s than 64 rows", ("h200",)),
    # DeepSeek decode at 512 rows; with --kv-blocks memory the KV capacity too (bf16 vs FP8)
    Row("decode-v32-512", "deepseek-v32-bench", "load",
        _decode("deepseek-v32-bench", 512, 64, *BF16, "--kv-blocks", "memory"),
        "1xH200", "decode", "16,552 tok/s (session 5)", ("h200",)),
    Row("decode-v32-512-fp8", "deepseek-v32-bench", "load",
        _decode("deepseek-v32-bench", 512, 64, *FP8, "--kv-blocks", "memory"),
        "1xH200", "decode", "12,407 tok/s (session 5); about 2x the bf16 KV tokens", ("h200",)),
    # 128 tokens a request: the lockstep window between the last prefill and the first finish
    # held ~32 steps at 64 and closed to under a step on one H200 run (session 22)
    Row("decode-v4-flash-512", "deepseek-v4-flash", "load",
        _decode("deepseek-v4-flash", 512, 128, "--short-len", "512", *BF16,
                "--kv-blocks", "memory"),
        "1xH200", "decode", "issue 34: >= 12,000 tok/s (11,259 at c11bcb9)", HEAD),
    Row("decode-v4-flash-512-fp8", "deepseek-v4-flash", "load",
        _decode("deepseek-v4-flash", 512, 128, "--short-len", "512", *FP8,
                "--kv-blocks", "memory"),
        "1xH200", "decode", "issue 34: >= 20,000 tok/s; 3.8x bf16's KV tokens", HEAD),
    # the latency a user feels: V4-Flash decode at 1 / 16 / 64 / 256 rows on one engine each
    Row("decode-v4-flash-itl", "deepseek-v4-flash", "load",
        _decode("deepseek-v4-flash", "1,16,64,256", 64, "--short-len", "512", *BF16),
        "1xH200", "decode", "issue 34: a one-row step <= 2.5 ms", ("h200",)),
    Row("decode-v4-flash-itl-fp8", "deepseek-v4-flash", "load",
        _decode("deepseek-v4-flash", "1,16,64,256", 64, "--short-len", "512", *FP8),
        "1xH200", "decode", "issue 34: a one-row step <= 2.0 ms, no slower than bf16", ("h200",)),
    # PP=2 on two H200s: against PP=1 (ttft-llama8b), and the output-channel skip modes
    Row("ttft-llama8b-pp2", "llama8b", "engine",
        ("--model-shape", "llama8b", "--pp", "2", "--linear", "torch",
         "--runs", "131072:8192", "--modes", "auto", "--reps", "3"),
        "2xH200", "ttft", "128K 6.377 s (05f87ab): 1.81x PP=1", ("h200x2",)),
    Row("skip-modes-pp2", "llama8b", "engine",
        ("--model-shape", "llama8b", "--pp", "2", "--linear", "torch,triton-persistent",
         "--runs", "32768:4096", "--reps", "3"),
        "2xH200", "ttft", "auto within 1-3 % of the bound, below off-early (96f2282)",
        ("h200x2",)),
    Row("decode-llama8b-64-pp2", "llama8b", "load",
        ("--pp", "2", "--device", "cuda", "--parts", "decode", "--decode-tokens", "48",
         "--reps", "3", "--decode-modes", "off,auto", "--no-reference"),
        "2xH200", "decode", "1,408 tok/s auto vs 1,327 off (05f87ab)", ("h200x2",)),
    # --tp 2 on the same two H200s: one stage over both GPUs, against PP=2 above
    Row("ttft-llama8b-tp2", "llama8b", "engine",
        ("--model-shape", "llama8b", "--pp", "1", "--tp", "2", "--linear", "torch",
         "--runs", "131072:8192,262144:8192", "--modes", "auto", "--reps", "3"),
        "2xH200", "ttft", "against ttft-llama8b-pp2 (same GPUs): not yet measured",
        ("h200x2",)),
    Row("decode-llama8b-64-tp2", "llama8b", "load",
        ("--pp", "1", "--tp", "2", "--device", "cuda", "--parts", "decode",
         "--decode-tokens", "48", "--reps", "3", "--decode-modes", "auto", "--no-reference"),
        "2xH200", "decode", "against decode-llama8b-64-pp2 (same GPUs): not yet measured",
        ("h200x2",)),
)  # fmt: skip


def select(names: list[str] | None, device: str | None) -> list[Row]:
    """Rows named (a row or a subset name) in manifest order; --device cpu keeps CPU rows,
    cuda the H200 ones. Neither: every row."""
    rows = list(ROWS)
    if names:
        known = {r.name for r in ROWS} | {s for r in ROWS for s in r.subsets}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"no suite row or subset named {unknown}")
        rows = [r for r in rows if r.name in names or set(r.subsets) & set(names)]
    if device:
        rows = [r for r in rows if (r.hardware == "cpu") == (device == "cpu")]
    return rows
