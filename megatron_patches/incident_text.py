"""The text of one incident record, for a person: a headline, a one-line log form and the
four-line diagnosis. Used during training (the log line and chat alerts in
:mod:`megatron_patches.alerts`) and offline (``megatron-patches report``), so it imports
neither. Every field is read defensively: records from older versions, or damaged ones,
still give text.
"""

from __future__ import annotations

from typing import Any, Optional

from .incidents import IN_MEMORY, first_key


def ranks_of(param: Optional[dict]) -> dict:
    """The ``ranks`` mapping of a parameter finding, or {} when it has none."""
    ranks = (param or {}).get("ranks")
    return ranks if isinstance(ranks, dict) else {}


def _count(value: Any) -> int:
    return len(value) if isinstance(value, (list, dict)) else 0


def text_of(value: Any) -> str:
    """A field as a person reads it: ``-`` for a missing or empty value."""
    return "-" if value is None or value == "" else str(value)


def headline(rec: dict) -> str:
    """One line: step, severity, kind and the message."""
    kinds = rec.get("kinds") if isinstance(rec.get("kinds"), list) else []
    message = rec.get("message") or ", ".join(map(str, kinds)) or "no message"
    return f"step {text_of(rec.get('step'))} {text_of(rec.get('severity'))} {text_of(rec.get('kind'))}: {message}"


def expert_text(expert: Any, ranks: Optional[dict] = None, sliced: bool = False) -> str:
    """``expert G (EP rank E)`` for a finding's ``expert`` field and the ranks holding it, or for
    a forward origin's (one expert or a list, each with its own ``ep``). ``sliced``: the finding
    is one expert-TP rank's slice of the expert's weight (it has a ``full_shape``)."""
    if isinstance(expert, list):
        return ", ".join(expert_text(e) for e in expert if isinstance(e, dict))
    ranks = ranks if ranks is not None else expert
    text = f"expert {text_of(expert.get('global'))}"
    if "ep" in ranks:
        text += f" (EP rank {text_of(ranks.get('ep'))}"
        text += f", expert-DP rank {text_of(ranks.get('edp'))}" if "edp" in ranks else ""
        text += f", expert-TP rank {text_of(ranks.get('etp'))})" if sliced else ")"
    return text


def _where(param: dict) -> str:
    ranks = ranks_of(param)
    layer = param.get("layer")
    labels = (("nan", "NaN"), ("inf", "Inf"), ("overflow", "overflowed"))
    counts = ", ".join(f"{param[k]} {label}" for k, label in labels if param.get(k))
    norm = param.get("norm")
    rank = f"global rank {text_of(ranks.get('global'))}"
    if ranks:
        rank += " (" + ", ".join(f"{k} {text_of(ranks.get(k))}" for k in ("tp", "pp", "dp")) + ")"
    expert = param.get("expert") if isinstance(param.get("expert"), dict) else None
    if expert is not None:  # mixture-of-experts: which expert, and the EP rank holding it
        rank += f", {expert_text(expert, ranks, sliced=bool(param.get('full_shape')))}"
    parts = [
        f"{param.get('name', '?')}" + (f" (layer {layer})" if layer is not None else " (not in a layer)"),
        rank,
        f"host {text_of(param.get('host'))}" + (f" {param['device']}" if param.get("device") else ""),
    ]
    if isinstance(param.get("full_shape"), list):
        parts.append(f"slice {param.get('shape')} of {param['full_shape']}")
    if counts:
        parts.append(counts)
    elif isinstance(norm, (int, float)):
        parts.append(f"grad norm {norm:.4g}")
    return ", ".join(parts)


def _entry(rec: dict) -> Optional[dict]:
    """Where the fault entered: ``first``, unless the origin rank's own finding from before the
    data-parallel reduction is known and ``first`` is elsewhere (records written before the
    origin led)."""
    first = rec.get("first") if isinstance(rec.get("first"), dict) else None
    origins = rec.get("origin_ranks") if isinstance(rec.get("origin_ranks"), list) else []
    before = [p for p in rec.get("pre_reduction") or [] if isinstance(p, dict)
              and ranks_of(p).get("global") in origins] if isinstance(rec.get("pre_reduction"), list) else []
    if before and ranks_of(first).get("global") not in origins:
        return min(before, key=lambda p: first_key(p.get("order") if isinstance(p.get("order"), int) else -1,
                                                   ranks_of(p).get("global", 0),
                                                   p["reasons"] if isinstance(p.get("reasons"), list) else ()))
    return first


def _routing_text(routing: Any) -> str:
    """What a MoE incident's ``moe_routing`` field says that matters: experts that got no tokens
    and routers whose probabilities were non-finite (empty when it says neither)."""
    layers = routing.get("layers") if isinstance(routing, dict) else None
    if not isinstance(layers, dict):
        return ""
    said = []
    for layer, entry in layers.items():
        if not isinstance(entry, dict):
            continue
        if entry.get("router_nonfinite_ranks"):
            said.append(f"{layer}: router probabilities non-finite on rank(s) {entry['router_nonfinite_ranks']}")
        if entry.get("zero_token_experts"):
            said.append(f"{layer}: no tokens for expert(s) {entry['zero_token_experts']}")
    return "; ".join(said) if said else "every expert got tokens, every router finite"


EVERY_GRADIENT_NONFINITE = "every gradient is non-finite"
ALL_NONFINITE_NOTE = (f"; {EVERY_GRADIENT_NONFINITE}: the loss or an activation went non-finite in the forward "
                      "pass, so the output layer named first is not the suspect")
"""What the message adds when every checked gradient was non-finite (``all_gradients_nonfinite``).
Backward spreads a broken forward pass to every gradient; the tensor nearest the output comes
first in backward order, but it is where the fault arrived last."""


def module_text(origin: dict) -> str:
    """``module (layer L), expert G (EP rank E)``: where a forward or backward origin is."""
    layer = origin.get("layer")
    return (text_of(origin.get("module")) + (f" (layer {layer})" if isinstance(layer, int) else "")
            + (f", {expert_text(origin['expert'])}" if origin.get("expert") else ""))


def _not_the_suspect(first: Optional[dict]) -> str:
    return f"; {text_of(first.get('name'))}, named first, is not the suspect" if first else ""


def _fed(rec: dict) -> bool:
    """Whether the record is of token ids outside the vocabulary (``detectors.tokens``): its origin is
    a batch a rank fed, not a gradient or a state."""
    return isinstance(rec.get("vocab"), dict)


def _went_off(rec: dict) -> bool:
    """Whether the record's origin is a module's output gone off its history (``detectors.activations``)."""
    first = rec.get("first") if isinstance(rec.get("first"), dict) else {}
    return any(str(r).startswith("activation:") for r in first.get("reasons") or ())


def _entered(rec: dict) -> str:
    """The diagnosis's second line: where the fault entered."""
    first = _entry(rec)
    found_by = "Megatron's rerun in place" if isinstance(rec.get("megatron_rerun"), dict) else "the replay"
    forward = rec.get("forward_origin") if isinstance(rec.get("forward_origin"), dict) else None
    backward = rec.get("backward_origin") if isinstance(rec.get("backward_origin"), dict) else None
    if _went_off(rec):
        return (f"  entered at: the forward pass, output of {text_of(first.get('name'))} (layer "
                f"{text_of(first.get('layer'))}) on rank(s) {rec.get('origin_ranks')}, far above its history")
    if _fed(rec) and first:
        return (f"  entered at: the batch: token ids outside the vocabulary fed to "
                f"{text_of(first.get('name')).rsplit('.', 1)[0]} "
                f"on rank(s) {rec.get('origin_ranks')}")
    if forward:
        return (f"  entered at: the forward pass, output of {module_text(forward)} on rank(s) {forward.get('ranks')}, "
                f"found by {found_by}; backward carried it to the gradients"
                + (f" (first: {text_of(first.get('name'))})" if first else ""))
    if backward is not None:
        return (f"  entered at: the backward pass, the gradient into {module_text(backward)} on rank(s) "
                f"{backward.get('ranks')} (the forward pass stayed finite), found by {found_by}")
    if rec.get("loss_nonfinite") is True:
        return "  entered at: the forward pass (the loss was non-finite); not located further" + _not_the_suspect(first)
    if rec.get("all_gradients_nonfinite") is True:
        return (f"  entered at: the forward pass ({EVERY_GRADIENT_NONFINITE}, so the loss or an activation "
                "broke first); without a replay not located further" + _not_the_suspect(first))
    if first:
        return f"  entered at: {_where(first)}"
    return "  entered at: not localized to a parameter (a model-wide check tripped)"


def _spread(rec: dict) -> str:
    """The diagnosis's third line: how far the fault spread."""
    world = rec.get("world") if isinstance(rec.get("world"), dict) else {}
    spread = (f"{_count(rec.get('ranks_affected'))} of {text_of(world.get('size'))} ranks, "
              f"{_count(rec.get('params'))} parameter(s)")
    origins = rec.get("origin_ranks") if isinstance(rec.get("origin_ranks"), list) else []
    if origins and _went_off(rec):
        return (f"  spread: from the output of {text_of(rec['first'].get('name'))} on rank(s) {origins} through the "
                f"rest of that forward pass, finite; found after it on {spread}")
    if origins and _fed(rec):
        return (f"  spread: none: the {text_of(rec['vocab'].get('ids_outside'))} id(s) were replaced by 0 before the "
                f"lookup on rank(s) {origins}")
    if origins:
        replicas = (world["dp"] * world.get("cp", 1) if isinstance(world.get("dp"), int)
                    and isinstance(world.get("cp", 1), int) else None)
        reached = rec.get("replicas_reached")
        reached = reached if isinstance(reached, int) else text_of(replicas)  # older records: the reduction reaches all
        spread = (f"from rank(s) {origins} before the data-parallel reduction to {reached} of "
                  f"{text_of(replicas)} data-parallel replica(s); found after it on {spread}")
    return f"  spread: {spread}"


def _recovered(rec: dict) -> list[str]:
    """What the executor did: the replay's verdict, Megatron's rerun, the rollback and restart."""
    done = []
    replay = rec.get("replay") if isinstance(rec.get("replay"), dict) else None
    cause = rec.get("cause") if isinstance(rec.get("cause"), dict) else None
    if replay and replay.get("verdict") and cause is None:  # a record written before `cause` existed
        meaning = {"deterministic": "the same batch reproduced it: suspect data or code",
                   "transient": "the replay was clean: suspect hardware or a race"}.get(str(replay["verdict"]), "")
        done.append(f"replay {replay['verdict']}" + (f" ({meaning})" if meaning else ""))
    elif replay and replay.get("verdict"):
        done.append(f"replay {replay['verdict']}")
    if cause is not None:
        evidence = cause.get("evidence") if isinstance(cause.get("evidence"), list) else []
        done.append(f"cause {text_of(cause.get('class'))} ({text_of(cause.get('confidence'))}: "
                    f"{'; '.join(map(text_of, evidence)) or 'no evidence'})")
    rerun = rec.get("megatron_rerun") if isinstance(rec.get("megatron_rerun"), dict) else None
    if rerun and rerun.get("verdict"):
        done.append(f"Megatron's rerun in place: {rerun['verdict']}")
    if isinstance(rec.get("rolled_back_to"), int):
        target = ("in process to the in-memory snapshot" if rec.get("checkpoint") == IN_MEMORY
                  else "to the healthy checkpoint")
        certified = f" (certified at step {rec['certified_at']})" if isinstance(rec.get("certified_at"), int) else ""
        done.append(f"rolled back {target} of step {rec['rolled_back_to']}{certified}"
                    + (f", learning rate x{rec['lr_scale']:g}" if isinstance(rec.get("lr_scale"), (int, float)) else ""))
    if isinstance(rec.get("disabled_features"), list) and rec["disabled_features"]:
        done.append(f"resumed in safe mode without {', '.join(map(str, rec['disabled_features']))}")
    skipped = rec.get("iterations_skipped")
    if isinstance(skipped, list) and skipped:
        done.append(f"iteration(s) {', '.join(map(str, skipped))} skipped on resuming")
    if isinstance(rec.get("restart"), int):
        done.append(f"restart {rec['restart']} ({text_of(rec.get('restarts_used'))} rollback(s) used in this job)"
                    + ("; requested, no restart has resumed yet" if rec.get("rollback_pending") else ""))
    return done


def _done(rec: dict) -> str:
    """The diagnosis's last line: what was done, and what the record holds beside it."""
    done = [f"action {text_of(rec.get('action'))}", *_recovered(rec)]
    if isinstance(rec.get("blacklisted"), list) and rec["blacklisted"]:
        done.append(f"{len(rec['blacklisted'])} sample(s) blacklisted")
    if isinstance(rec.get("origin_ranks"), list) and rec["origin_ranks"]:
        where = ("fed by" if _fed(rec) else "went off first in the forward pass on" if _went_off(rec)
                 else "entered before the data-parallel reduction on")
        done.append(f"{where} rank(s) {rec['origin_ranks']}")
    if rec.get("reason"):
        done.append(f"graded {text_of(rec.get('severity'))}: {rec['reason']}")
    samples = rec["batch"].get("samples") if isinstance(rec.get("batch"), dict) else None
    if isinstance(samples, list) and samples:
        shown = ", ".join(map(str, samples[:4])) + (", ..." if len(samples) > 4 else "")
        done.append(f"batch of {len(samples)} sample(s) [{shown}]")
    if rec.get("scene"):
        done.append(f"scene {rec['scene']}")
    if rec.get("injected"):
        done.append("injected by a drill: " + _drills(rec["injected"]))
    return "  done: " + "; ".join(done)


def diagnosis(rec: dict) -> list[str]:
    """Four lines: what broke, where it entered (the forward pass's first non-finite
    module when a replay found it), how far it spread, what was done (a routing line between
    the last two for a mixture-of-experts record that says something)."""
    routing = _routing_text(rec.get("moe_routing"))
    return [headline(rec), _entered(rec), _spread(rec), *([f"  routing: {routing}"] if routing else []), _done(rec)]


def _drills(injected: Any) -> str:
    """What fired: ``nan:step=3,... -> decoder.layers.1.mlp.linear_fc1.weight on rank 1``."""
    if not isinstance(injected, list):
        return text_of(injected)
    said = []
    for entry in injected:
        if isinstance(entry, dict):
            drill = str(entry.get("drill"))
            into = ("token ids fed to " if "phase=input" in drill else
                    "gradient into the output of " if "phase=backward" in drill else "output of ")
            target = (f"sample {entry['sample']}" if "sample" in entry else
                      f"{into}{entry['module']}" if "module" in entry else text_of(entry.get("param")))
            text = f"{text_of(entry.get('drill'))} -> {target} on rank {text_of(entry.get('rank'))}"
        else:  # records written before 'injected' said what fired: the spec text
            text = text_of(entry)
        if text not in said:
            said.append(text)
    return "; ".join(said)


def one_line(record: dict) -> str:
    """The headline, where the fault was first seen (unless the message names it already) and
    the action: the log line of an incident."""
    first = record.get("first") if isinstance(record.get("first"), dict) else None
    where = ""
    if first:
        ranks = ranks_of(first)
        if str(first.get("name")) not in str(record.get("message")):
            where = f" (first: {first.get('name')} on rank {ranks.get('global', '?')})"
    return f"{headline(record)}{where}; action {record.get('action')}"


def spike_text(field: dict, led: bool, named: Optional[str]) -> str:
    """An incident's message where the loss spiked (``field``: the record's ``loss_spike``).
    ``led``: the spike is the incident's leading kind; ``named``: what the other signals named
    (the message :func:`~megatron_patches.decide.describe` made of them), None where nothing did."""
    why = field["why"]
    if not led:
        return f"{named}; {why}"
    above = field.get("ranks_above") or []
    ranks = field.get("rank_losses") or {}
    if above:
        where = f"rank(s) {above} alone stood above the other ranks' losses"
    elif len(set(ranks.values())) > 1:
        where = "the ranks' own losses rose together"
    else:
        where = ""
    if named is not None:
        return f"{why}; {named}" + (f"; {where}" if where else "")
    return (f"{why}; nothing else points anywhere: no gradient, held weight or optimizer state was flagged"
            + (f", and {where}" if where else ""))
