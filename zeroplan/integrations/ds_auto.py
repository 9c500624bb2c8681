"""Filling ``"auto"`` in a ds_config the way Hugging Face fills it: the node lookup and the fill rule.

``"auto"`` is not DeepSpeed's: the HF Trainer (transformers ``integrations/deepspeed.py``) and accelerate
(``utils/deepspeed.py``, ``utils/dataclasses.py`` ``DeepSpeedPlugin``, ``accelerator.py``
``_prepare_deepspeed``) replace it before DeepSpeed reads the dict. Both use the same two rules, restated
here once so the Trainer's steps (``hf_trainer.py``) and accelerate's (``accelerate_config.py``) share them:

- ``find_config_node``: a dotted key ``a.b.c`` names key ``c`` of the object at ``a.b``; a missing
  section means "nothing to fill" (``HfDeepSpeedConfig.find_config_node``);
- ``fill_match``: a value ``"auto"`` becomes the given value; any other value present is checked against
  it when ``must_match`` (the Trainer collects every mismatch and refuses them together in
  ``trainer_config_finalize``; here the first is refused, one line, naming both sides).

Pure: dicts in, dicts and records out; the caller's dict is never modified.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

AUTO = "auto"


@dataclass(frozen=True)
class Filled:
    """One ``"auto"`` replaced: the dotted key, the value it became and who decided it (file and function)."""

    key: str
    value: object
    source: str


@dataclass(frozen=True)
class AutoResolution:
    """A ds_config as DeepSpeed receives it: ``config`` (a new dict), ``filled`` (each key that was ``"auto"`` or
    was added, what it became and which step decided it), ``unresolved`` (keys left ``"auto"`` and why)."""

    config: dict
    filled: tuple[Filled, ...]
    unresolved: tuple[tuple[str, str], ...]


SCHEDULER_STEPS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
STEPS_WHY = "set from the number of training steps when training starts; no memory or traffic effect"


@dataclass
class AutoFill:
    """A private copy of a ds_config being filled, with the record of every key filled so far."""

    config: dict
    filled: list[Filled] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, config: dict) -> AutoFill:
        if not isinstance(config, dict):
            raise ValueError("deepspeed config: expected a JSON object")
        return cls(copy.deepcopy(config))

    def node(self, key: str) -> tuple[dict | None, str]:
        """``find_config_node``: the object holding the last part of ``key``, or None if a section is missing
        (or is not an object: DeepSpeed refuses that later, by name)."""
        *path, last = key.split(".")
        node: object = self.config
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, last
        return (node if isinstance(node, dict) else None), last

    def get(self, key: str, default: object = None) -> object:
        node, last = self.node(key)
        return default if node is None else node.get(last, default)

    def is_auto(self, key: str) -> bool:
        return self.get(key) == AUTO

    def fill(self, key: str, value: object, source: str, must_match: bool = False, given: str = "") -> None:
        """``fill_match``: ``"auto"`` at ``key`` becomes ``value``; a present non-auto value is compared with
        ``value`` when ``must_match`` (``given`` names the setting it came from, as the Trainer's message)."""
        node, last = self.node(key)
        if node is None:
            return
        if node.get(last) == AUTO:
            node[last] = value
            self.filled.append(Filled(key, value, source))
            return
        current = node.get(last)
        if must_match and current is not None and current != value:
            self.mismatches.append(f"{key}={current!r} vs {given or key}={value!r}")

    def refuse_mismatches(self) -> None:
        """The Trainer's ``trainer_config_finalize`` refusal, as one line (the first mismatch and how many)."""
        if self.mismatches:
            more = f" (and {len(self.mismatches) - 1} more)" if len(self.mismatches) > 1 else ""
            raise ValueError(f"deepspeed config: {self.mismatches[0]}{more}: the HF Trainer refuses a ds_config value "
                             "that contradicts its arguments; set it to \"auto\" or drop one of them")  # fmt: skip


def finish(fill: AutoFill, who: str) -> AutoResolution:
    """The resolution: the scheduler's step counts may stay ``"auto"`` (said in ``unresolved``); any other
    ``"auto"`` left is refused in one line naming ``who`` would have refused it."""
    left = auto_keys(fill.config)
    refused = [k for k in left if k not in SCHEDULER_STEPS]
    if refused:
        raise ValueError(f"deepspeed config: {refused[0]}='auto': {who}; give a value")
    return AutoResolution(fill.config, tuple(fill.filled), tuple((k, STEPS_WHY) for k in left))


def auto_keys(config: object, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key whose value is ``"auto"``, in file order."""
    if not isinstance(config, dict):
        return ()
    keys: list[str] = []
    for k, v in config.items():
        if v == AUTO:
            keys.append(prefix + str(k))
        elif isinstance(v, dict):
            keys.extend(auto_keys(v, f"{prefix}{k}."))
    return tuple(keys)
