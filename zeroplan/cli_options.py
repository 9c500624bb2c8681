"""Shared typer option blocks and the one-line error handling of every ``zeroplan`` command.

Every bad input ends as one line on stderr and exit code 2 (``OneLineErrors``); nothing is printed to
stdout before the whole answer is ready.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from zeroplan.policy import PrecisionPolicy
from zeroplan.types import error_line

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as click_exceptions


class UserError(Exception):
    """Bad input found by a command; printed as one line, exit code 2."""


class OneLineErrors(TyperGroup):
    """Click group that turns usage errors and bad values into one stderr line and exit code 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        try:
            rv = super().main(args, prog_name or "zeroplan", complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:
            typer.echo(exc.ctx.get_help())
            rv = 0
        except click_exceptions.ClickException as exc:
            typer.echo(f"zeroplan: error: {exc.format_message()}", err=True)
            rv = 2
        except (UserError, ValueError, ValidationError) as exc:
            msg = error_line(exc) if isinstance(exc, ValidationError) else str(exc)
            typer.echo(f"zeroplan: error: {msg}", err=True)
            rv = 2
        except typer.Abort:
            typer.echo("zeroplan: aborted", err=True)
            rv = 130
        if not standalone_mode:
            return rv
        sys.exit(rv or 0)


class Unit(str, Enum):
    GB = "GB"
    GiB = "GiB"


# Precision-policy options shared by every command; None means "PrecisionPolicy's default".
ParamDtype = Annotated[
    Optional[str], typer.Option(help="Working parameter dtype: fp16 (the paper's), bf16, fp32, fp8.")
]
GradDtype = Annotated[Optional[str], typer.Option(help="Gradient dtype (default: param dtype).")]
MasterWeights = Annotated[
    Optional[bool],
    typer.Option("--master-weights/--no-master-weights", help="fp32 master copy (default: on unless fp32)."),
]
OptimizerName = Annotated[
    Optional[str],
    typer.Option(help="adam (default), adamw, sgd, sgd-momentum, lamb, lion, adafactor, adam8bit."),
]
OptimizerDtype = Annotated[Optional[str], typer.Option(help="dtype of Adam m/v and momentum (default fp32).")]


def given(**options: object) -> dict:
    """The options the user gave, without the ones left at None (so the config's defaults apply)."""
    return {k: v for k, v in options.items() if v is not None}


def policy_from(param_dtype, grad_dtype, master_weights, optimizer, optimizer_dtype) -> PrecisionPolicy:
    """A PrecisionPolicy from the shared options; those left at None take the policy's defaults."""
    return PrecisionPolicy(
        **given(
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            master_weights=master_weights,
            optimizer=optimizer,
            optimizer_dtype=optimizer_dtype,
        )
    )
