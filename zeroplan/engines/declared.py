"""What an engine declares beside its functions (``base.Engine``): its planner options, its validator run's options
and its launcher, each a record of data the commands read by name, never by the engine's name."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class EngineOption:
    """An option an engine declares beyond the shared fields of ``PlannerOptions``: its keyword
    (the Python API's; ``PlannerOptions.own[name]``), its check (value -> value, ValueError in one line),
    its default and what it means."""

    name: str
    check: Callable[[object], object]
    default: object = None
    help: str = ""


@dataclass(frozen=True)
class Launcher:
    """What ``plan`` prints for the recommendation of an engine's own search (``Candidate.launcher``, and
    ``Candidate.build`` where set): the key it has in ``plan --json``'s recommendation (``{key}_build`` for the
    build) and the titles the text puts above each."""

    key: str
    title: str
    build_title: Optional[str] = None

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        """(key, title) of the configuration, then of the build where the engine has one."""
        build = () if self.build_title is None else ((f"{self.key}_build", self.build_title),)
        return ((self.key, self.title), *build)


@dataclass(frozen=True)
class RunOption:
    """An option of the engine's validator run (``zeroplan validate --engine NAME``) beyond ``ValidateConfig``'s
    shared fields: its keyword (``ValidateConfig``'s; the runner reads ``config.<name>``), its type (a pydantic
    annotation, checked by ``validate.config``), its default (a value other than it is "given", and refused for
    any other engine), what it means, how a refusal names it (``shown``, ``{value}`` filled in; default: the
    name with dashes) and the planner's own option (``EngineOption``) it is, if any."""

    name: str
    annotation: Any
    default: object = None
    help: str = ""
    shown: str = ""
    planner: Optional[str] = None

    def show(self, value: object) -> str:
        return (self.shown or self.name.replace("_", "-")).format(value=value)
