"""One-line errors for Kiln's command-line tools (engine-build and engine-run share this)."""

from __future__ import annotations

import functools
import os
import sys

import typer


def fail(prog: str, message: str) -> None:
    typer.echo(f"{prog}: error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(1)


def one_line_errors(prog: str, errors: tuple[type[BaseException], ...], interrupted: str = "interrupted"):
    """Decorator: `errors` end as one line on stderr and exit 1; KILN_DEBUG=1 shows the traceback."""

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            try:
                return command(*args, **kwargs)
            except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a SIGPIPE'd tool does
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise typer.Exit(141) from None
            except errors as exc:
                if os.environ.get("KILN_DEBUG"):
                    raise
                fail(prog, str(exc))
            except KeyboardInterrupt:
                fail(prog, interrupted)

        return wrapper

    return decorate
