"""Run a module with some ops' "auto" backend pinned, for same-commit A/B benches:
python with_kernels.py rope_tail=torch -m app.bench.deepseek_breakdown --cases ..."""

import runpy
import sys

from stages.kernels import registry

args = sys.argv[1:]
while args and "=" in args[0]:
    op, backend = args.pop(0).split("=")
    registry.PRIORITY[op] = (backend,)
if args[:1] != ["-m"] or len(args) < 2:
    sys.exit("usage: with_kernels.py op=backend ... -m module [args]")
sys.argv = [args[1], *args[2:]]
runpy.run_module(args[1], run_name="__main__", alter_sys=True)
