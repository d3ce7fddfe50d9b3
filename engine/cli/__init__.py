"""The `kdtree` command line: `validate` (the main job), `diverge` and `demo`.

    kdtree validate [--fixtures DIR|FILE] [--device cpu|cuda[:N]] [--dtype float32|bfloat16] [--json PATH|-]
                    [--junit-xml PATH|-] [--html PATH|-] [--impl module:factory] [--require CAPS]
                    [--timeout SECONDS] [--invariant] [--tp N] [--page-size N]
    kdtree validate --server URL --fixtures EXPORT [--api openai|sglang] [--concurrency N]
                    [--temperature T --samples N --seed S] [--logprobs K] [--timeout S]
                    [--require-speculation]   (docs/serving.md)
    kdtree diverge (--fixture PATH | --config NAME) [--way chunk|tree|batch] [--dtype bfloat16] [--json PATH]
    kdtree demo [--preset tiny | --fixture PATH] [--prompt 1,2,3] [--budget 32] [--block-size 8] [--plot PATH]
                [--invariant] [--tp N] [--page-size N]

Exit status: 0 passed, 1 a check failed (validate), the two ways differ (diverge) or
DDTree differed from AR (demo), 2 bad input, 3 internal error, 130 interrupted (kdtr_format/clikit.py). Every bad
argument is refused before any work, in one line on stderr; --json, --junit-xml, --html
and --plot are written all or nothing, with the user's umask. A validate report named `-`
goes to stdout (one of them at most), and the terminal report to stderr.

validate runs its checking, the adapter's code included, in a child process
(engine/validate/door/supervise.py): an adapter that exits, dies or outlives --timeout in one call FAILs
the row in flight, the report is still written, and the exit status is 1. With --tp the
built-in engine's ranks run unwatched, as below.

Help, --version and refused arguments answer without importing torch (seconds):
each command imports the engine when it runs.

--tp N shards the built-in engine over N ranks (docs/tensor-parallel.md). Under torchrun
(`torchrun --nproc-per-node N -m engine validate --tp N`) this process is one of the N ranks
and N must be torchrun's world size; otherwise the command spawns the N ranks as local
processes itself (gloo on the CPU, NCCL with rank r on cuda:r). Every rank runs the command;
rank 0 prints and writes the files; the exit status is the same on every rank.
"""

from .common import cli, main
from . import demo_cmd, diverge_cmd, validate_cmd  # noqa: F401  (each adds its command to cli)

__all__ = ["cli", "main"]
