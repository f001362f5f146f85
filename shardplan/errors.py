"""Shardplan's own errors and the exit codes the CLI maps them to.

`EXIT_CODES` below is the one list of exit codes: `shardplan --help` and the README print it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3
EXIT_VERIFY_MISMATCH = 4
EXIT_VERIFY_FAILED = 5

# code -> meaning; `shardplan --help` prints exactly this list.
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "ok (estimate: the plan fits; recommend/capacity: one was found)",
    EXIT_INTERNAL: "internal error (a bug; SHARDPLAN_DEBUG=1 shows the traceback)",
    EXIT_BAD_INPUT: "bad input: an option, a file that cannot be read or parsed, an unknown key or name, "
                    "an impossible field or layout",
    EXIT_DOES_NOT_FIT: "the plan does not fit (the result is still printed); recommend, capacity, replan: nothing fits; "
                       "replan: slices only lost ranks held and no checkpoint to read them from, or no rollout "
                       "order keeps --min-capacity",
    EXIT_VERIFY_MISMATCH: "verify: a measurement or the numerics disagree with the prediction beyond tolerance; "
                          "watch: a shard's memory or KV cache is outside the band of the plan's prediction",
    EXIT_VERIFY_FAILED: "verify: the run did not complete (a rank ran out of memory, raised, was killed, or hung "
                        "past --timeout); watch: an endpoint cannot be read (refused, timed out, an HTTP error, "
                        "or not a metrics page)",
}


class ShardplanError(Exception):
    """An expected failure with a one-line message for the user.

    `source` names the file (or the command-line option) the problem is in, `field` the
    dotted field path inside it, `hint` the fix. `exit_code` is what the CLI returns.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.source = source
        self.field = field
        self.hint = hint

    def one_line(self) -> str:
        parts = []
        if self.source:
            parts.append(f"{self.source}:")
        if self.field:
            parts.append(f"field '{self.field}':")
        parts.append(self.message.rstrip("."))
        line = " ".join(parts)
        if self.hint:
            line += f" (fix: {self.hint.rstrip('.')})"
        return " ".join(line.split())


class InputFileError(ShardplanError):
    """A file could not be read, parsed or validated."""


class UnknownNameError(ShardplanError):
    """A bundled model or hardware name that does not exist."""


class UnsupportedModelError(ShardplanError):
    """A Hugging Face config whose architecture shardplan cannot translate."""


class LayoutError(ShardplanError):
    """A parallel layout that cannot exist for this model and GPU count."""


class CannotVerify(ShardplanError):
    """A plan `verify` cannot run here: a feature it does not run yet, or a machine that cannot
    host it (too many ranks, NCCL without GPUs). Raised before anything starts."""


class VerifyMismatch(ShardplanError):
    """A measured component or the numerics disagree with the prediction beyond tolerance."""

    exit_code = EXIT_VERIFY_MISMATCH


class VerifyRunFailed(ShardplanError):
    """The distributed run did not complete: a rank raised, was killed, or hung."""

    exit_code = EXIT_VERIFY_FAILED
