"""MutatingAdmissionPolicy and ValidatingAdmissionPolicy, applied on create and update as kube-apiserver 1.37
applies them (MutatingAdmissionPolicy GA since 1.36): mutations first, then schema validation, then validations.

What is modelled: a policy applies through each of its bindings; matchConstraints and a binding's matchResources
(resourceRules, excludeResourceRules, namespaceSelector, objectSelector); matchConditions; variables; CEL
with `object`, `oldObject`, `request`, `variables`, `namespaceObject` (params are not supported: a policy with
paramKind is skipped); mutations by ApplyConfiguration (merged, lists with a merge key merged by it) and by
JSONPatch; validations with message/messageExpression/reason and the binding's validationActions (Deny, Warn,
Audit); failurePolicy for expressions that fail. CEL's typed object literals (`Object.spec{...}`,
`JSONPatch{...}`) become plain maps before evaluation: the `cel` package builds no messages.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable
from typing import Any

import cel
from cel import stdlib

from agent.allocation.cel import FUNCTIONS as selector_functions
from agent.jsontypes import Json

from .errors import ApiError
from .patch import json_patch
from .resources import MERGE_KEYS, ResourceType
from .selectors import selector_matcher

MAP = ("admissionregistration.k8s.io", "v1", "mutatingadmissionpolicies")
MAP_BINDING = ("admissionregistration.k8s.io", "v1", "mutatingadmissionpolicybindings")
VAP = ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies")
VAP_BINDING = ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings")
# The fake authenticates nobody: every request is the cluster admin's.
USER = {"username": "system:admin", "uid": "", "groups": ["system:masters", "system:authenticated"], "extra": {}}

_TYPED_LITERAL = re.compile(r"(JSONPatch|Object(?:\.[A-Za-z_]\w*)*)\s*\{")
_FIELD_NAME = re.compile(r"(\s*)([A-Za-z_]\w*)\s*:")


class PolicyError(Exception):
    """An expression that does not compile, fails, or gives the wrong type."""


def untyped(expression: str) -> str:
    """`Object.spec{name: "x"}` and `JSONPatch{op: "add"}` as map literals `{"name": "x"}`, outside strings."""
    out: list[str] = []
    stack: list[bool] = []  # one per open brace: whether it opened a typed literal
    i, n = 0, len(expression)
    expect_field = False
    while i < n:
        ch = expression[i]
        if ch in "'\"":
            end = i + 1
            while end < n and expression[end] != ch:
                end += 2 if expression[end] == "\\" else 1
            out.append(expression[i : end + 1])
            i = end + 1
            continue
        if expect_field:
            expect_field = False
            field = _FIELD_NAME.match(expression, i)
            if field:
                out.append(f'{field.group(1)}"{field.group(2)}":')
                i = field.end()
                continue
        typed = _TYPED_LITERAL.match(expression, i)
        if typed and (i == 0 or not (expression[i - 1].isalnum() or expression[i - 1] in "_.")):
            out.append("{")
            stack.append(True)
            expect_field = True
            i = typed.end()
            continue
        if ch == "{":
            stack.append(False)
        elif ch == "}" and stack:
            stack.pop()
        elif ch == "," and stack and stack[-1]:
            expect_field = True
        out.append(ch)
        i += 1
    return "".join(out)


# Kubernetes' CEL libraries the shipped policies use, where the `cel` package lacks them: strings' join and
# substring, and the quantity library as the agent's selectors have it (agent.allocation.cel), but for
# isQuantity, which takes no surrounding blanks, as kube-apiserver's parser does.
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **selector_functions,
    "join": stdlib.join,
    "substring": stdlib.substring,
    "isQuantity": lambda text: (
        isinstance(text, str) and text == text.strip() and selector_functions["isQuantity"](text)
    ),
}


def _evaluate(expression: str, context: Json) -> Any:
    ctx = cel.Context(functions=_FUNCTIONS)
    for name, value in context.items():
        ctx.add_variable(name, value)
    try:
        return cel.evaluate(untyped(expression), ctx)
    except Exception as exc:  # the cel package raises plain RuntimeError/ValueError for every failure
        raise PolicyError(f"expression {expression.strip()!r} failed: {exc}") from None


def _matches_rule(rule: Json, rt: ResourceType, operation: str, subresource: str) -> bool:
    def has(key: str, value: str) -> bool:
        allowed = rule.get(key) or []
        return "*" in allowed or value in allowed

    names = rule.get("resources") or []
    if subresource:  # "*/*" every subresource, "pods/*" every one of pods, "*/status" status of every type
        named = any(n in names for n in ("*/*", f"{rt.plural}/{subresource}", f"{rt.plural}/*", f"*/{subresource}"))
    else:
        named = "*" in names or "*/*" in names or rt.plural in names
    return has("apiGroups", rt.group) and has("apiVersions", rt.version) and has("operations", operation) and named


def _matches(
    constraints: Json | None,
    rt: ResourceType,
    operation: str,
    subresource: str,
    obj: Json,
    namespace_labels: dict[str, str] | None,
) -> bool:
    if constraints is None:
        return True
    rules = constraints.get("resourceRules")
    if rules is not None and not any(_matches_rule(r, rt, operation, subresource) for r in rules):
        return False
    if any(_matches_rule(r, rt, operation, subresource) for r in constraints.get("excludeResourceRules") or []):
        return False
    selector = constraints.get("objectSelector")
    if selector and not selector_matcher(selector)(obj):
        return False
    selector = constraints.get("namespaceSelector")
    namespace_object = {"metadata": {"labels": namespace_labels}}
    return not (
        selector and rt.namespaced and namespace_labels is not None and not selector_matcher(selector)(namespace_object)
    )


class Admission:
    """The policies in the store, applied to one write. `read` lists stored objects of a type key."""

    def __init__(
        self,
        read: Callable[[tuple[str, str, str]], list[Json]],
        namespace_labels: Callable[[str], dict[str, str] | None],
    ) -> None:
        self._read = read
        self._namespace_labels = namespace_labels

    def _bound(self, policies: tuple[str, str, str], bindings: tuple[str, str, str]) -> list[tuple[Json, Json]]:
        by_name = {p["metadata"]["name"]: p for p in self._read(policies)}
        pairs = [
            (by_name[b["spec"]["policyName"]], b)
            for b in self._read(bindings)
            if (b.get("spec") or {}).get("policyName") in by_name
        ]
        return sorted(pairs, key=lambda pair: (pair[0]["metadata"]["name"], pair[1]["metadata"]["name"]))

    def _context(
        self, rt: ResourceType, operation: str, subresource: str, obj: Json, old: Json | None, namespace: str
    ) -> tuple[Json, dict[str, str] | None]:
        labels = self._namespace_labels(namespace) if rt.namespaced and namespace else None
        request = {
            "operation": operation,
            "userInfo": USER,
            "namespace": namespace,
            "name": obj["metadata"].get("name", ""),
            "subResource": subresource,
            "dryRun": False,
            "kind": {"group": rt.group, "version": rt.version, "kind": rt.kind},
            "resource": {"group": rt.group, "version": rt.version, "resource": rt.plural},
        }
        namespace_object = {"metadata": {"name": namespace, "labels": labels or {}}} if labels is not None else None
        return {
            "object": obj,
            "oldObject": old,
            "request": request,
            "params": None,
            "namespaceObject": namespace_object,
        }, labels

    def _applies(
        self,
        policy: Json,
        binding: Json,
        rt: ResourceType,
        operation: str,
        subresource: str,
        context: Json,
        labels: dict[str, str] | None,
    ) -> bool:
        spec = policy.get("spec") or {}
        if spec.get("paramKind"):
            return False  # params are not modelled
        obj = context["object"]
        if not _matches(spec.get("matchConstraints"), rt, operation, subresource, obj, labels):
            return False
        if not _matches((binding.get("spec") or {}).get("matchResources"), rt, operation, subresource, obj, labels):
            return False
        for condition in spec.get("matchConditions") or []:
            if _evaluate(condition["expression"], context) is not True:
                return False
        return True

    def _variables(self, spec: Json, context: Json) -> None:
        values: Json = {}
        context["variables"] = values
        for variable in spec.get("variables") or []:
            values[variable["name"]] = _evaluate(variable["expression"], context)

    def mutate(
        self, rt: ResourceType, operation: str, subresource: str, obj: Json, old: Json | None, namespace: str
    ) -> Json:
        """The object after every bound MutatingAdmissionPolicy that matches (reinvoked once when another
        changed it, as reinvocationPolicy IfNeeded asks)."""
        pairs = self._bound(MAP, MAP_BINDING)
        if not pairs:
            return obj
        for _ in range(2):
            before = copy.deepcopy(obj)
            for policy, binding in pairs:
                obj = self._mutate_one(policy, binding, rt, operation, subresource, obj, old, namespace)
            if obj == before:
                break
        return obj

    def _mutate_one(
        self,
        policy: Json,
        binding: Json,
        rt: ResourceType,
        operation: str,
        subresource: str,
        obj: Json,
        old: Json | None,
        namespace: str,
    ) -> Json:
        spec = policy.get("spec") or {}
        name = policy["metadata"]["name"]
        try:
            context, labels = self._context(rt, operation, subresource, obj, old, namespace)
            if not self._applies(policy, binding, rt, operation, subresource, context, labels):
                return obj
            self._variables(spec, context)
            for mutation in spec.get("mutations") or []:
                if mutation.get("patchType") == "JSONPatch":
                    patches = _typed(_evaluate(mutation["jsonPatch"]["expression"], context), list, "JSONPatch")
                    obj = json_patch(obj, [{k: v for k, v in p.items() if v is not None} for p in patches])
                else:
                    applied = _typed(
                        _evaluate(mutation["applyConfiguration"]["expression"], context), dict, "ApplyConfiguration"
                    )
                    obj = _merge(obj, applied)
                context["object"] = obj
        except PolicyError as exc:
            if spec.get("failurePolicy", "Fail") == "Fail":
                raise ApiError(400, f'policy "{name}" failed: {exc}', reason="BadRequest") from None
        except ApiError as exc:
            if spec.get("failurePolicy", "Fail") == "Fail":
                raise ApiError(400, f'policy "{name}" failed to apply its patch: {exc.message}') from None
        return obj

    def validate(
        self,
        rt: ResourceType,
        operation: str,
        subresource: str,
        obj: Json,
        old: Json | None,
        namespace: str,
        warnings: list[str],
    ) -> None:
        """Raise 422 Invalid (or the validation's reason) for the first Deny binding a validation fails."""
        for policy, binding in self._bound(VAP, VAP_BINDING):
            spec = policy.get("spec") or {}
            name = policy["metadata"]["name"]
            actions = (binding.get("spec") or {}).get("validationActions") or []
            try:
                context, labels = self._context(rt, operation, subresource, obj, old, namespace)
                if not self._applies(policy, binding, rt, operation, subresource, context, labels):
                    continue
                self._variables(spec, context)
                failed = [v for v in spec.get("validations") or [] if _evaluate(v["expression"], context) is not True]
            except PolicyError as exc:
                if spec.get("failurePolicy", "Fail") == "Fail" and "Deny" in actions:
                    raise ApiError(400, f'policy "{name}" failed: {exc}') from None
                continue
            for validation in failed:
                message = validation.get("message") or f"failed expression: {validation['expression'].strip()}"
                if validation.get("messageExpression"):
                    with contextlib.suppress(PolicyError):
                        message = str(_evaluate(validation["messageExpression"], context))
                text = (
                    f'{rt.plural}{"." + rt.group if rt.group else ""} "{obj["metadata"].get("name", "")}" '
                    f"is forbidden: ValidatingAdmissionPolicy '{name}' with binding "
                    f"'{binding['metadata']['name']}' denied request: {message}"
                )
                if "Warn" in actions:
                    warnings.append(
                        f"Validation failed for ValidatingAdmissionPolicy '{name}' with binding "
                        f"'{binding['metadata']['name']}': {message}"
                    )
                if "Deny" in actions:
                    reason = validation.get("reason") or "Invalid"
                    code = {"Forbidden": 403, "Unauthorized": 401, "RequestEntityTooLarge": 413}.get(reason, 422)
                    raise ApiError(code, text, reason=reason)


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise PolicyError(f"a {what} expression must give {'a list of JSONPatch' if kind is list else 'an Object'}")
    return value


def _merge(base: Any, applied: Any, field: str = "") -> Any:
    """An ApplyConfiguration onto the object: maps merge, lists with a merge key merge by it, others replace."""
    if isinstance(base, dict) and isinstance(applied, dict):
        out = dict(base)
        for key, value in applied.items():
            out[key] = _merge(base.get(key), value, key) if key in base else copy.deepcopy(value)
        return out
    key = MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(applied, list):
        out_list = [copy.deepcopy(item) for item in base]
        for item in applied:
            at = next(
                (
                    i
                    for i, old in enumerate(out_list)
                    if isinstance(old, dict) and isinstance(item, dict) and old.get(key) == item.get(key)
                ),
                None,
            )
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = _merge(out_list[at], item)
        return out_list
    return copy.deepcopy(applied)
