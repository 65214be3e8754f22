"""Model type placement constraints: which instance labels a model type requires or prefers.

Owns parsing upstream's `MM_TYPE_CONSTRAINTS` (or the file named by
`MM_TYPE_CONSTRAINTS_PATH`) and answering, per model type, the required and preferred
labels that `rank.LoadRequest` carries. Instances advertise labels from `MM_LABELS`.

Format (upstream's TypeConstraintManager, `config/examples/type-constraints-example`)::

    {"<model type>": {"required": ["label", ...], "preferred": ["label", ...]},
     "_default": {"required": [...], "preferred": [...]}}

A type's own entry replaces `_default` (they are not merged; an entry with no labels
makes its type unconstrained); a type with neither has no constraints. An instance
qualifies when it carries *all* required labels; it is preferred when it carries *any*
preferred label. As upstream normalises them, labels are
deduplicated and a label both required and preferred counts only as required. Keys other
than "required" and "preferred" inside an entry are ignored (upstream's parser ignores
unknown properties, so configs written for it keep working); `null` counts as no labels.
Upstream also *infers* preferences for unconstrained types (prefer instances other types
may not use); meshd does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TYPE = "_default"  # upstream TypeConstraintManager.DEFAULT_TYPE_MAPPING

Labels = frozenset[str]
NO_LABELS: Labels = frozenset()


@dataclass(frozen=True, slots=True)
class TypeConstraint:
    required: Labels = NO_LABELS
    preferred: Labels = NO_LABELS


def _labels(raw: Any, where: str) -> Labels:
    if raw is None:
        return NO_LABELS
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be a list of label strings, got {type(raw).__name__}")
    for i, label in enumerate(raw):
        if not isinstance(label, str):
            raise ValueError(f"{where}[{i}] must be a string, got {type(label).__name__}")
        if not label.strip():
            raise ValueError(f"{where}[{i}] is an empty label")
    return frozenset(label.strip() for label in raw)


@dataclass(frozen=True, slots=True)
class TypeConstraints:
    """Parsed constraints by model type (an empty mapping means no constraints at all)."""

    by_type: Mapping[str, TypeConstraint] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> TypeConstraints:
        """Parse the JSON text; ValueError saying what is wrong and where."""
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"type constraints are not valid JSON: {str(e)[:200]}") from None
        if not isinstance(obj, dict):
            raise ValueError(
                f"type constraints must be a JSON object of model type -> constraints, got {type(obj).__name__}"
            )
        by_type: dict[str, TypeConstraint] = {}
        for model_type, entry in obj.items():
            where = f"type constraints for {model_type!r}"
            if not isinstance(entry, dict):
                raise ValueError(
                    f'{where} must be an object like {{"required": [...], "preferred": [...]}}, '
                    f"got {type(entry).__name__}"
                )
            required = _labels(entry.get("required"), f"{where}: 'required'")
            preferred = _labels(entry.get("preferred"), f"{where}: 'preferred'") - required
            by_type[model_type] = TypeConstraint(required, preferred)
        return cls(by_type)

    def for_type(self, model_type: str) -> tuple[Labels, Labels]:
        """(required, preferred) labels for `model_type`: its entry, else `_default`, else none."""
        entry = self.by_type.get(model_type)
        if entry is None:
            entry = self.by_type.get(DEFAULT_TYPE)
        if entry is None:
            return NO_LABELS, NO_LABELS
        return entry.required, entry.preferred


NO_CONSTRAINTS = TypeConstraints()

# Upstream's message when no running instance carries a type's required labels (ModelMesh.java);
# modelmesh-serving's controller matches this prefix, and the suffix "[_no_runtime]" and a
# type starting "rt:" to tell NoSupportingRuntime and RuntimeNotRecognized from a runtime
# that is only not up yet (RuntimeUnhealthy).
NO_HOME_PREFIX = "There are no running instances that meet the label requirements of type "


def no_home_message(model_type: str, required: Labels, instance_labels: Iterable[Labels]) -> str | None:
    """The no-home message when no instance in `instance_labels` (the running ones) has all of
    `required`; None when one has, or nothing is required."""
    if not required:
        return None
    if any(required <= labels for labels in instance_labels):
        return None
    return f"{NO_HOME_PREFIX}{model_type}: [{', '.join(sorted(required))}]"


def parse_labels(text: str) -> Labels:
    """Instance labels from `MM_LABELS` (comma-separated, whitespace trimmed, empties dropped)."""
    return frozenset(part.strip() for part in text.split(",") if part.strip())
