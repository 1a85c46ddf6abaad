"""Fault injection for tests and fire drills: ``KIND:key=value,...``.

Kinds: ``nan``, ``inf`` (one element), ``spike`` (multiply the gradient by ``factor``,
default 1e4), ``growth`` (multiply by ``factor**n`` on the n-th step of the spec, default
factor 1.5: an explosion building up), ``bitflip`` (flip one bit of one element: ``bit``,
0-based from the least significant, default the highest exponent bit), ``saturate`` (one
element set to the dtype's largest finite value, as an Ascend part in saturation mode
reports an overflow), ``poison`` (``poison:sample=I``: sample I gives a non-finite loss
every time it is fed; the training loop applies it, see :meth:`Injector.poisoned`), ``kill``
(``kill:step=S,rank=R``: that rank's process dies by SIGKILL when the incident of step S is being
decided, after its check and before the ranks agree: a card or host lost mid-incident; it needs
a fault at step S to act on, e.g. ``nan:step=S``), ``sign`` (flip the sign), ``scale`` (multiply by
``factor``, default 2), ``noise`` (Gaussian, ``factor`` of each value, default 0.01). Keys: ``step``
(required, 1-based optimizer step), ``param`` (fnmatch pattern on the global parameter name;
default: the model's first parameter in forward order), ``rank`` (global rank; default all),
``count`` (consecutive steps, default 1), ``phase`` (``grad``: the gradient the optimizer
sees, default; ``local``: this rank's gradient before the data-parallel reduction, so it
spreads like a faulty card's would; ``forward``: the output of ``module`` in the forward pass,
so the loss and then every gradient go non-finite, see :mod:`megatron_patches.forward_origin`;
``backward``: the gradient flowing into the output of ``module`` in the backward pass, a fault
born in backward that reaches the gradients of everything before that module, and under expert
parallelism the ranks that sent the module its tokens; ``param``: the weight this rank's optimizer
steps, right before the step's update, so that one replica's copy silently differs from the
others' from then on, as a card that corrupts memory would leave it; ``state``: the Adam state of
that weight in the rank's optimizer (its own shard under the distributed optimizer), right before
the update; ``input``: the integer token ids fed to ``module`` (its first argument, e.g.
``embedding.word_embeddings``), as a corrupted batch would bring them, with kinds bitflip (a bit
index or ``bits=N``), sign, scale, spike and noise (results rounded to integers)),
``module`` (phases forward, backward and input only, required: fnmatch pattern on the global dotted
module name, as ``named_modules()`` gives it without wrapper prefixes, e.g. ``decoder.layers.1.mlp``),
``factor`` (spike, growth, scale, noise), ``bit`` (bitflip: an index or ``exponent_high``,
``mantissa_high``, ``mantissa_low``), ``bits`` (bitflip: N bits drawn per element), ``scope``
(``element``, ``row``, ``1pct``, ``10pct``, ``all``), ``seed`` (draws elements, bits and noise),
``slot`` (phase=state: ``exp_avg`` or ``exp_avg_sq``); "one element" above is the default scope, and
:mod:`megatron_patches.faults` says what each kind and scope does to a tensor. A forward drill
models a module whose computation breaks on that step's input: it fires on every forward of its
steps, a replay included, and not when the step is reached again after a rollback.

An injection is an event in time: each (spec, step) fires once, so steps replayed after a
rollback are not injected again. What actually fired (spec, parameter or sample, rank) is kept
per step (:meth:`Injector.fired_at`), so an incident is labelled injected only by drills that
fired at its step, never by a spec whose window merely covers it.

The run's drills are one :class:`Injector` its monitor makes from ``config.inject`` before
anything else (a bad spec stops the start) and holds as ``monitor.state.drills``; the hooks, the seams
and the recovery executors reach it there. Without specs it does nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from . import collectives, faults, naming
from .errors import ConfigError, exit_refused

log = logging.getLogger("megatron_patches")

KINDS = ("nan", "inf", "spike", "bitflip", "saturate", "poison", "growth", "kill") + faults.NEW_KINDS
PHASES = ("grad", "local", "param", "forward", "backward", "state", "input")
MODULE_PHASES = ("forward", "backward", "input")
"""Phases whose drills act on a module (``module=NAME``), not on a parameter's gradient."""
_KEYS = ("step", "param", "rank", "count", "phase", "factor", "sample", "bit", "module") + faults.KEYS
_FORWARD_KINDS = ("nan", "inf", "spike") + faults.NEW_KINDS + ("bitflip",)
_INPUT_KINDS = ("spike", "bitflip") + faults.NEW_KINDS
"""Kinds that change integer token ids (no NaN or Inf exists in them)."""


@dataclass(frozen=True)
class InjectionSpec:
    kind: str
    step: int
    param: Optional[str] = None
    rank: Optional[int] = None
    count: int = 1
    phase: str = "grad"
    factor: float = 1.0e4
    sample: Optional[int] = None
    bit: "Optional[int | str]" = None
    module: Optional[str] = None
    text: str = ""
    scope: Optional[str] = None
    seed: int = 0
    bits: Optional[int] = None
    slot: str = "exp_avg"

    def covers(self, step: int) -> bool:
        """Whether this gradient drill is due at ``step`` (poison and kill act elsewhere)."""
        return self.kind not in ("poison", "kill") and self.step <= step < self.step + self.count


def _int(key: str, value: str, text: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"injection {text!r}: {key} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"injection {text!r}: {key} must be >= {minimum}, got {number}")
    return number


def parse_spec(text: str) -> InjectionSpec:
    """Parse one spec, e.g. ``nan:step=5,param=*linear_fc1.weight,rank=1``."""
    kind, sep, rest = text.strip().partition(":")
    if kind not in KINDS:
        raise ConfigError(f"injection {text!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    values: dict = {}
    for item in filter(None, rest.split(",")) if sep else ():
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise ConfigError(f"injection {text!r}: expected key=value with key in {', '.join(_KEYS)}, got {item!r}")
        values[key] = value.strip()
    if kind == "poison":
        if set(values) != {"sample"}:
            raise ConfigError(f"injection {text!r}: poison takes exactly sample=I (a dataset index)")
        return InjectionSpec(kind=kind, step=0, sample=_int("sample", values["sample"], text, 0), text=text.strip())
    if "sample" in values:
        raise ConfigError(f"injection {text!r}: sample applies to poison only")
    if kind == "kill" and not {"step", "rank"} <= set(values) <= {"step", "rank"}:
        raise ConfigError(f"injection {text!r}: kill takes exactly step=S and rank=R")
    if "step" not in values:
        raise ConfigError(f"injection {text!r}: step=N is required")
    spec = dict(kind=kind, text=text.strip(), step=_int("step", values["step"], text, 1))
    if "rank" in values:
        spec["rank"] = _int("rank", values["rank"], text, 0)
    if "count" in values:
        spec["count"] = _int("count", values["count"], text, 1)
    if "param" in values:
        spec["param"] = values["param"]
    if "phase" in values:
        if values["phase"] not in PHASES:
            raise ConfigError(f"injection {text!r}: phase must be one of {', '.join(PHASES)}, got {values['phase']!r}")
        spec["phase"] = values["phase"]
    if spec.get("phase") in MODULE_PHASES:
        kinds = _INPUT_KINDS if spec["phase"] == "input" else _FORWARD_KINDS
        if kind not in kinds or "module" not in values or "param" in values:
            raise ConfigError(f"injection {text!r}: phase={spec['phase']} takes module=NAME (a module's dotted "
                              f"name) and no param, with kind {', '.join(kinds)}")
        if spec["phase"] == "input" and values.get("bit") in faults.BIT_NAMES:
            raise ConfigError(f"injection {text!r}: phase=input changes integer token ids, which have no exponent "
                              f"or mantissa: give bit as an index (0 = the lowest) or bits=N")
        spec["module"] = values["module"]
    elif "module" in values:
        raise ConfigError(f"injection {text!r}: module applies to phases {', '.join(MODULE_PHASES)} only")
    return InjectionSpec(**spec, **faults.read_keys(kind, values, text, spec.get("phase", "grad")))


class Injector:
    """Applies the specs that are due; remembers what fired so nothing fires twice."""

    def __init__(self, specs: Iterable[InjectionSpec], clock: Optional[Callable[[], tuple[int, int]]] = None):
        """``clock``: returns (step being made, global rank) when a poison drill is fed (the
        training loop asks :meth:`poisoned` without saying which step it is on)."""
        self.specs = tuple(specs)
        self._fired: set[tuple[int, int]] = set()
        self._started: set[int] = set()  # forward drills that fired (they may fire again in a replay)
        self._clock = clock
        self._log: dict[int, list[dict]] = {}  # step -> what fired at it on this rank
        self.hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        """Modules given their forward/backward drill hooks (:func:`megatron_patches.forward_origin.attach_drills`)."""
        self.poison_asked = False
        """Whether the training loop asked :meth:`poisoned` (one that never does feeds no poison)."""

    def _note(self, step: int, entry: dict) -> None:
        entries = self._log.setdefault(step, [])
        if entry not in entries:  # a replayed step feeds a poisoned sample again: one entry
            entries.append(entry)

    def fired_at(self, step: int) -> list[dict]:
        """What fired at ``step`` on this rank: ``{"drill", "rank", "param"}`` for gradient drills,
        ``{"drill", "rank", "sample"}`` for poison drills (the sample was fed)."""
        return [dict(e) for e in self._log.get(step, [])]

    def forget_before(self, step: int) -> None:
        """Drop what fired before ``step`` (checked already): the log stays small."""
        for old in [s for s in self._log if s < step]:
            del self._log[old]

    def __bool__(self) -> bool:
        """Whether any gradient drill is configured (the hooks then hand gradients over)."""
        return any(s.kind not in ("poison", "kill") and s.phase not in MODULE_PHASES for s in self.specs)

    def forward_specs(self) -> list[tuple[int, InjectionSpec]]:
        """The drills acting on a module (phases forward, backward and input), with their indices."""
        return [(i, s) for i, s in enumerate(self.specs) if s.phase in MODULE_PHASES]

    def forward_due(self, index: int, step: int, rank: int, module: str) -> bool:
        """Whether module drill ``index`` corrupts ``module``'s output (forward) or the gradient
        flowing into it (backward) now; notes it if so. Not marked spent: the replay of the step
        breaks the same way (see spend_started)."""
        spec = self.specs[index]
        if not (spec.covers(step) and (index, step) not in self._fired and spec.rank in (None, rank)):
            return False
        if index not in self._started and spec.phase != "input":  # an input drill says what it changed itself
            where = "the output" if spec.phase == "forward" else "the gradient of the output"
            log.warning("step %d: drill %r fired into %s of %s on rank %d", step, spec.text, where, module, rank)
        self._started.add(index)
        self._note(step, {"drill": spec.text, "rank": rank, "module": module})
        return True

    def kills(self, step: int, rank: int) -> bool:
        """Whether a ``kill`` drill ends this rank in the incident of ``step`` (once)."""
        for index, spec in enumerate(self.specs):
            if spec.kind == "kill" and spec.step == step and spec.rank == rank and (index, step) not in self._fired:
                self._fired.add((index, step))
                return True
        return False

    def poisoned(self, samples: Iterable[int]) -> set[int]:
        """The sample indices among ``samples`` that a ``poison`` spec marks."""
        self.poison_asked, samples = True, set(samples)
        hit = {s.sample for s in self.specs if s.kind == "poison"} & samples
        if hit and self._clock is not None:
            step, rank = self._clock()
            for spec in self.specs:
                if spec.kind == "poison" and spec.sample in hit:
                    self._note(step, {"drill": spec.text, "rank": rank, "sample": spec.sample})
        return hit

    def fired_specs(self) -> list[str]:
        """Texts of the specs that have fired at least once."""
        return sorted({self.specs[i].text for i, _ in self._fired} | {self.specs[i].text for i in self._started})

    def spend(self, texts: Iterable[str]) -> None:
        """Mark these specs as fully fired (read from the ledger after a restart)."""
        texts = set(texts)
        for index, spec in enumerate(self.specs):
            if spec.text in texts:
                self._fired.update((index, s) for s in range(spec.step, spec.step + spec.count))

    def spend_started(self) -> None:
        """After a rollback: a fault that has begun is over (an event in time), so steps
        replayed or reached again do not fire it."""
        for index, spec in enumerate(self.specs):
            if index in self._started or any(i == index for i, _ in self._fired):
                self._fired.update((index, s) for s in range(spec.step, spec.step + spec.count))

    def holds(self, params: Iterable[tuple[str, int]], stepped: Iterable[tuple[str, int]],
              modules: Iterable[str]) -> list[float]:
        """Per spec, 1.0 when this rank holds what it acts on, whichever rank the spec names:
        phase ``grad``, a gradient among ``stepped`` (what this rank's optimizer steps: under the
        distributed optimizer, its shard only); phase ``local``, a parameter among ``params``;
        module phases, a module among ``modules``. ``params`` and ``stepped`` are (global name,
        forward order); without ``param`` a spec targets forward order 0. Poison and kill act on
        any rank. Gathered over the job, :func:`unmatched` names the ranks that hold each target."""
        stepped = list(stepped)
        targets = {"grad": stepped, "param": stepped, "state": stepped, "local": list(params)}
        modules = list(modules)
        hits = []
        for spec in self.specs:
            if spec.kind in ("poison", "kill"):
                hits.append(1.0)
            elif spec.phase in MODULE_PHASES:
                hits.append(float(any(fnmatch.fnmatchcase(name, spec.module) for name in modules)))
            else:
                hits.append(float(any(order == 0 if spec.param is None else fnmatch.fnmatchcase(name, spec.param)
                                      for name, order in targets[spec.phase])))
        return hits

    def due(self, step: int, phase: str, rank: int) -> list[tuple[int, InjectionSpec]]:
        return [
            (i, s)
            for i, s in enumerate(self.specs)
            if s.phase == phase and s.covers(step) and (i, step) not in self._fired
            and (s.rank is None or s.rank == rank)
        ]

    def fire_on_optimizer(self, optimizer: Any, entries: list, stepped: Iterable[tuple[Any, Any]], step: int,
                          rank: int) -> int:
        """The phase=grad, phase=param and phase=state drills of ``step`` on this rank: on the gradients
        the optimizer steps (``stepped``: (entry, gradient or None)), on its weights (``.data``: no
        autograd record of the change) and on their Adam state. Returns how many fired."""
        grads = [(e.info.name, e.info.order, g) for e, g in stepped if g is not None]
        weights = [(e.info.name, e.info.order, e.main.data) for e in entries]
        fired = self.apply(step, "grad", rank, grads) + self.apply(step, "param", rank, weights)
        if self.due(step, "state", rank):  # the state is looked up only for a drill due now
            fired += self.apply(step, "state", rank, faults.optimizer_state(optimizer, entries))
        return len(fired)

    def apply(self, step: int, phase: str, rank: int,
              named_grads: list[tuple[str, int, torch.Tensor]], part: bool = False) -> list[str]:
        """Corrupt the due gradients on this rank. ``named_grads``: (global name, forward order, grad).
        ``part``: they are only some of this rank's gradients (one bucket): a spec whose target is
        not among them stays due."""
        done = []
        for index, spec in self.due(step, phase, rank):
            if spec.param is None:
                # Forward order 0 is the model's first parameter; only ranks holding it match.
                targets = [t for t in named_grads if t[1] == 0]
            else:
                targets = [t for t in named_grads if fnmatch.fnmatchcase(t[0], spec.param)]
            if part and not targets:
                continue
            self._fired.add((index, step))
            factor = spec.factor ** (step - spec.step + 1) if spec.kind == "growth" else spec.factor
            for name, _, grad in targets:
                faults.corrupt(spec, grad, factor)
                self._note(step, {"drill": spec.text, "rank": rank, "param": name})
                done.append(f"{spec.text} -> {name} on rank {rank}")
            if targets:  # a rehearsal says so where it acts (a warning: every rank's log shows it)
                log.warning("step %d: drill %r fired into %s on rank %d", step, spec.text,
                            targets[0][0] if len(targets) == 1 else f"{len(targets)} gradients", rank)
        return done


def _rank_list(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``: one short line however many ranks hold a target."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _missed(spec: InjectionSpec, holders: list[int], params: list[str], modules: list[str]) -> str:
    """Why ``spec`` would do nothing: the ranks that hold its target when it is bound to another,
    else the nearest names (from this rank's ``params`` or ``modules``)."""
    on = "" if spec.rank is None else f" on rank {spec.rank}"
    among = {"grad": f" among the gradients the optimizer steps{on}",
             "param": f" among the weights the optimizer steps{on}",
             "state": f" among the weights whose state the optimizer holds{on}"}.get(spec.phase, on)
    if spec.phase in MODULE_PHASES:
        pattern, names, why = spec.module, modules, f"no module matches {spec.module!r}{on}"
    elif spec.param is None:
        pattern, names, why = None, params, f"the model's first parameter is not{among or ' held'}"
    else:
        pattern, names, why = spec.param, params, f"no parameter matches {spec.param!r}{among}"
    if holders:
        return f"{spec.text!r} ({why}; held on rank(s) {_rank_list(holders)}: bind it to one of them or drop rank)"
    nearest = difflib.get_close_matches(pattern, names, n=2, cutoff=0.0) if pattern is not None else []
    return f"{spec.text!r} ({why}{'; nearest: ' + ', '.join(nearest) if nearest else ''})"


def unmatched(injector: Injector, holds_by_rank: list[list[float]], param_names: Iterable[str],
              module_names: Iterable[str]) -> Optional[str]:
    """One line naming the drills that would do nothing (``holds_by_rank``: every rank's
    :meth:`Injector.holds`), or None when every drill has a target: a target no rank holds, a
    ``rank`` the job does not have, or a ``rank`` that does not hold it (the line names those that
    do). ``param_names`` and ``module_names``: this rank's, from which the nearest are suggested."""
    world = len(holds_by_rank)
    params, modules = sorted(param_names), sorted(module_names)
    missed = []
    for index, spec in enumerate(injector.specs):
        holders = [rank for rank, holds in enumerate(holds_by_rank) if holds[index]]
        if spec.rank is not None and spec.rank >= world:
            missed.append(f"{spec.text!r} (rank {spec.rank} is outside the job's {world} rank(s))")
        elif not holders or (spec.rank is not None and spec.rank not in holders):
            missed.append(_missed(spec, holders, params, modules))
    if not missed:
        return None
    return (f"drill(s) that would do nothing: {'; '.join(missed)}; patterns are fnmatch on global names "
            "without wrapper prefixes")


def refuse_unmatched(injector: Injector, chunks: list, rank: int, stepped: Iterable[tuple[Any, Any]], ps: Any) -> None:
    """At the first step, on every rank: a drill that would do nothing (:func:`unmatched`) stops
    every rank with exit code 2 and one line from rank 0, rather than rehearse nothing and look
    like a miss. ``stepped``: (entry, gradient or None) of what this rank's optimizer steps, as
    ``Seams.current_grads`` yields them (``ps``: as ``Seams.parallel_state`` does); a phase=grad drill
    acts there only (under the distributed optimizer, on the ranks whose shard holds the parameter).
    Drills with no registered model (``chunks`` None: the optimizer was built by a function the guard
    never wrapped, as when megatron's optimizer is imported before the opt-in line) are refused too."""
    if not injector.specs:
        return
    blind = [] if chunks else [spec.text for spec in injector.specs if spec.kind not in ("poison", "kill")]
    if blind:  # poison and kill need no model
        if rank == 0:
            log.error("drills %s cannot act: the guard does not know this optimizer's model (it was built by a "
                      "get_megatron_optimizer imported before megatron_patches.apply, or by a custom loop): put "
                      "'import megatron_patches.apply' first, or call megatron_patches.seams.wrappers.register_model("
                      "optimizer, model_chunks)", ", ".join(map(repr, blind)))
        exit_refused(rank)
    if not chunks:
        return
    params = [(info.name, info.order) for info in naming.name_parameters(chunks, ps).values()]
    grads = [(entry.info.name, entry.info.order) for entry, grad in stepped if grad is not None and grad.numel()]
    modules = [name for name, _, _ in naming.name_modules(chunks, ps)]
    every_rank = collectives.all_gather_floats(injector.holds(params, grads, modules))
    line = unmatched(injector, every_rank, [name for name, _ in params], modules)
    if line is not None:
        if rank == 0:
            log.error("%s", line)
        exit_refused(rank)


def build(texts: Iterable[str], clock: Optional[Callable[[], tuple[int, int]]] = None) -> Injector:
    """The drills ``texts`` (``config.inject``) describe; ``clock`` is as for :class:`Injector`.
    A bad spec raises :class:`ConfigError`. The run's monitor holds the result (``monitor.state.drills``)."""
    return Injector([parse_spec(text) for text in texts], clock=clock)
