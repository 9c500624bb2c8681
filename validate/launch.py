"""torchrun (``torch.distributed.run``) as the launcher of a real run, plus a file naming the failed rank.

    python -m validate.launch FAILURES.json -- TORCHRUN_ARGS... -m validate.worker WORKER_ARGS...

Runs ``torch.distributed.run.run`` in this process (this process is torchrun's agent). When a rank
fails, torchrun stops the others and raises ``ChildFailedError``; its first failure (global rank, exit
code, local rank) is written to FAILURES.json for ``validate.harness`` to report, and the exit code is 1.
"""

from __future__ import annotations

import json
import sys

from validate.lifeline import die_with_parent


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    failures_path, rest = argv[0], argv[1:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(rest))
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        failures = {
            "rank": rank,
            "local_rank": first.local_rank,
            "exitcode": first.exitcode,
            "others": {str(r): f.exitcode for r, f in exc.failures.items() if r != rank},
        }
        with open(failures_path, "w") as f:
            json.dump(failures, f)
        sys.exit(1)


if __name__ == "__main__":
    main()
