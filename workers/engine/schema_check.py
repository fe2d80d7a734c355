"""Can a JSON schema ever be finished? A small satisfiability check, run before compiling.

A constrained sample can only end once its document is complete. A schema with no finite
instance never lets it: `{"type": "object", "properties": {"n": {"$ref": "#"}},
"required": ["n"]}` asks for `{"n": {"n": {"n": ...` forever, and other schemas rule out
every value (`enum: []`, `minItems` above `maxItems`, `allOf` of a string and an integer).
Such a request is refused with a 400 before anything is generated (`unsatisfiable`).

The check is a least fixpoint over the schema's `$ref` targets (a grammar's "productive
nonterminals"): a target is satisfiable once some finite instance of it is known to exist,
given the targets already found satisfiable. Locally each keyword is judged generously:
anything it cannot decide cheaply (patterns, formats, `not`, `if`/`then`/`else`,
`multipleOf`, `uniqueItems`, enum values against the other keywords, remote `$ref`s) counts
as satisfiable. So a refusal is always right (no finite instance exists), while a schema it
lets through may still be one the grammar cannot finish: the engine then ends the sample
with `length` at `max_tokens`, or, where llguidance breaks on it, fails it (`error`, a 500
`grammar_error`), never with `stop` (see `StopChecker.advance_grammar`).

Pure Python, no torch: `workers.runner.structured_backend` calls it on a cache miss.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from typing import Any
from urllib.parse import unquote

__all__ = ["unsatisfiable"]

# Kinds of JSON values. "number" stands for the non-integral numbers here: a schema's
# `"type": "number"` allows {"integer", "number"}.
_ALL = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
_TYPE_KINDS = {"null": {"null"}, "boolean": {"boolean"}, "integer": {"integer"},
               "number": {"integer", "number"}, "string": {"string"}, "array": {"array"},
               "object": {"object"}}
MAX_VISITS = 100_000  # schema nodes looked at, all iterations together; past it: no verdict
MAX_DEPTH = 150  # nesting followed; deeper schemas get no verdict


class _GiveUp(Exception):
    pass


class _Cycle(Exception):
    def __init__(self, chain: list[str]) -> None:
        super().__init__(" -> ".join(chain))
        self.chain = chain


def unsatisfiable(schema: Any) -> str | None:
    """Why no finite JSON value satisfies `schema` (a sentence naming where), or None when
    one may (or the schema is too big or odd to judge here: the grammar compiler decides)."""
    if schema is True or not isinstance(schema, dict | bool):
        return None
    if schema is False:
        return "'#' is `false`: no value satisfies it"
    try:
        return _Check(schema).run()
    except (_GiveUp, RecursionError):
        return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _declared(node: Any) -> frozenset[str]:
    """The kinds a schema admits going by its own `type`, `const` and `enum` only."""
    if node is False:
        return frozenset()
    if not isinstance(node, dict):
        return _ALL
    kinds = set(_ALL)
    declared = node.get("type")
    names = [declared] if isinstance(declared, str) else declared
    if isinstance(names, list) and all(isinstance(n, str) and n in _TYPE_KINDS for n in names):
        kinds = set().union(*(_TYPE_KINDS[n] for n in names)) if names else set()
    if "const" in node:
        kinds &= {_kind(node["const"])}
    if isinstance(node.get("enum"), list):
        kinds &= {_kind(v) for v in node["enum"]}
    return frozenset(kinds)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _count(value: Any, default: float) -> float:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else default


class _Check:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.visits = 0
        self.targets: dict[int, tuple[Any, str]] = {id(root): (root, "#")}
        self.productive: set[int] = set()
        self.users: defaultdict[int, set[int]] = defaultdict(set)  # target -> who consulted it
        self.worklist: deque[int] = deque()
        self.queued: set[int] = set()
        self.current = id(root)
        self.explaining = False
        self.stack: dict[int, int] = {}  # while explaining: targets being expanded -> their
        # place on the chain
        self.chain: list[str] = []  # while explaining: pointers from the root to here

    def run(self) -> str | None:
        # Every `$ref` target up front, the last found first and the root last: definitions
        # are mostly settled before what uses them, so few targets are judged twice.
        for key in reversed([*self._scan(), id(self.root)]):
            self._enqueue(key)
        while self.worklist:
            target = self.worklist.popleft()
            self.queued.discard(target)
            if target in self.productive:
                continue
            self.current = target
            node, pointer = self.targets[target]
            if self._why(node, pointer, 0) is None:
                self.productive.add(target)
                for user in self.users.pop(target, ()):
                    self._enqueue(user)
        if id(self.root) in self.productive:
            return None
        self.explaining, self.visits = True, 0
        self.stack, self.chain = {id(self.root): 0}, ["#"]
        try:
            why = self._why(self.root, "#", 0)
        except _Cycle as cycle:
            return (f"it recurses without end: '{cycle.chain[0]}' requires itself at every "
                    f"level ({' -> '.join(cycle.chain)}), so every instance would be infinite; "
                    "make the recursion optional (leave it out of `required`, allow 0 items, "
                    "or add an `anyOf` branch that ends it)")
        except (_GiveUp, RecursionError):
            why = None
        return why or "a part it requires can never be completed (too deep to show where)"

    def _enqueue(self, key: int) -> None:
        if key not in self.queued and key not in self.productive:
            self.queued.add(key)
            self.worklist.append(key)

    def _scan(self) -> list[int]:
        """The `$ref` targets anywhere in the document, in the order first met."""
        found: list[int] = []
        stack: list[Any] = [self.root]
        while stack:
            self.visits += 1
            if self.visits > MAX_VISITS:
                raise _GiveUp
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                target = self._resolve(ref) if isinstance(ref, str) else None
                if target is not None and id(target[0]) not in self.targets:
                    self.targets[id(target[0])] = target
                    found.append(id(target[0]))
                stack.extend(reversed(node.values()))
            elif isinstance(node, list):
                stack.extend(reversed(node))
        return [key for key in found if key != id(self.root)]

    # ---- one schema node ----------------------------------------------------------------

    def _sub(self, node: Any, pointer: str, depth: int,
             within: frozenset[str] = _ALL) -> str | None:
        """`_why` of a part an instance must contain (kept on the chain while explaining)."""
        if not self.explaining:
            return self._why(node, pointer, depth + 1, within)
        self.chain.append(pointer)
        try:
            return self._why(node, pointer, depth + 1, within)
        finally:
            self.chain.pop()

    def _why(self, node: Any, pointer: str, depth: int,
             within: frozenset[str] = _ALL) -> str | None:
        """None when `node` may have a finite instance of a kind in `within` (given what is
        known so far), else why not."""
        self.visits += 1
        if self.visits > MAX_VISITS or depth > MAX_DEPTH:
            raise _GiveUp
        if node is False:
            return f"'{pointer}' is `false`: no value satisfies it"
        if not isinstance(node, dict) or not node:
            return None  # `true`, `{}`, or not a schema (the compiler judges that)
        kinds = set(_declared(node))
        if isinstance(node.get("enum"), list) and not node["enum"]:
            return f"'{pointer}' has an empty `enum`"
        if not kinds:
            return f"'{pointer}': its `type`, `const` and `enum` admit no value together"
        kinds &= within
        if not kinds:
            return f"'{pointer}' admits no value of the types the schema around it allows"
        # applicators, whatever the value's kind
        ref = node.get("$ref")
        if isinstance(ref, str):
            why = self._ref(ref, pointer, depth)
            if why is not None:
                return why
            target = self._resolve(ref)
            if target is not None:
                kinds &= _declared(target[0])
        for key in ("allOf", "anyOf", "oneOf"):
            branches = node.get(key)
            if not isinstance(branches, list):
                continue
            where = f"{pointer}/{key}"
            if key == "allOf":
                for i, branch in enumerate(branches):
                    why = self._sub(branch, f"{where}/{i}", depth, frozenset(kinds))
                    if why is not None:
                        return why
                    kinds &= _declared(branch)
            else:
                reasons, open_kinds, context = [], set(), frozenset(kinds)
                for i, branch in enumerate(branches):
                    why = self._sub(branch, f"{where}/{i}", depth, context)
                    if why is None:
                        open_kinds |= _declared(branch)
                    else:
                        reasons.append(why)
                if not branches:
                    return f"'{where}' is empty: no value satisfies it"
                if len(reasons) == len(branches):
                    return f"no branch of '{where}' can be satisfied ({reasons[0]})"
                kinds &= open_kinds
            if not kinds:
                return f"'{where}' admits no value of the kinds the rest of '{pointer}' allows"
        if node.get("not") is True or node.get("not") == {}:
            return f"'{pointer}/not' rules out every value"
        if not kinds:
            return f"'{pointer}': its `$ref` and its own `type` admit no value together"
        if "const" in node or "enum" in node:
            return None  # a listed value (not checked against the other keywords)
        reasons = []
        for kind in sorted(kinds, key=_ORDER.index):
            why = self._kind_why(kind, node, pointer, depth)
            if why is None:
                return None
            reasons.append(why)
        return reasons[-1]  # the widest kind's (a number's rather than an integer's)

    def _kind_why(self, kind: str, node: dict[str, Any], pointer: str, depth: int) -> str | None:
        if kind in ("integer", "number"):
            return _range_why(kind, node, pointer)
        if kind == "string":
            lo, hi = _count(node.get("minLength"), 0), _count(node.get("maxLength"), math.inf)
            if lo > hi:
                return f"'{pointer}' has minLength {lo} > maxLength {hi}"
            return None
        if kind == "array":
            return self._array_why(node, pointer, depth)
        if kind == "object":
            return self._object_why(node, pointer, depth)
        return None  # null, boolean

    def _array_why(self, node: dict[str, Any], pointer: str, depth: int) -> str | None:
        lo, hi = _count(node.get("minItems"), 0), _count(node.get("maxItems"), math.inf)
        if lo > hi:
            return f"'{pointer}' has minItems {lo} > maxItems {hi}"
        if "contains" in node:
            least = _count(node.get("minContains"), 1)
            most = _count(node.get("maxContains"), math.inf)
            if least > most:
                return f"'{pointer}' has minContains {least} > maxContains {most}"
            if least > hi:
                return f"'{pointer}' has minContains {least} > maxItems {hi}"
            if least:
                why = self._sub(node["contains"], f"{pointer}/contains", depth)
                if why is not None:
                    return why
        items = node.get("items")
        if isinstance(items, list):  # draft 4-7 tuples
            prefix, rest, prefix_key, rest_key = items, node.get("additionalItems", True), \
                "items", "additionalItems"
        else:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            rest, prefix_key, rest_key = (True if items is None else items), "prefixItems", "items"
        for i in range(min(int(lo), len(prefix))):
            why = self._sub(prefix[i], f"{pointer}/{prefix_key}/{i}", depth)
            if why is not None:
                return f"'{pointer}' needs at least {lo} items: {why}"
        if lo > len(prefix):
            why = self._sub(rest, f"{pointer}/{rest_key}", depth)
            if why is not None:
                return f"'{pointer}' needs at least {lo} items: {why}"
        return None

    def _object_why(self, node: dict[str, Any], pointer: str, depth: int) -> str | None:
        lo = _count(node.get("minProperties"), 0)
        hi = _count(node.get("maxProperties"), math.inf)
        raw = node.get("required")
        required = list(dict.fromkeys(r for r in raw if isinstance(r, str))) \
            if isinstance(raw, list) else []
        if lo > hi:
            return f"'{pointer}' has minProperties {lo} > maxProperties {hi}"
        if len(required) > hi:
            return f"'{pointer}' requires {len(required)} properties but has maxProperties {hi}"
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        patterns = node.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        extra = node.get("additionalProperties", True)
        if extra is False and not patterns and len(properties) < lo:
            return (f"'{pointer}' has minProperties {lo} but allows only "
                    f"{len(properties)} properties")
        for name in required:
            if name in properties:
                sub, where = properties[name], f"{pointer}/properties/{_escape(name)}"
            else:
                # Python's regexes are not ECMA's: where a pattern could apply but Python
                # says no (or cannot read it), the property gets the benefit of the doubt
                sub, where = (extra if not patterns else True), f"{pointer}/additionalProperties"
                for pattern, schema in patterns.items():
                    try:
                        matched = re.search(pattern, name) is not None
                    except (re.error, TypeError):
                        sub = True
                        break
                    if matched:
                        sub, where = schema, f"{pointer}/patternProperties/{_escape(pattern)}"
                        break
                if sub is False and not patterns:
                    return (f"'{pointer}' requires property '{name}' but does not allow it "
                            "(it is not among its properties)")
            why = self._sub(sub, where, depth)
            if why is not None:
                return f"required property '{name}': {why}"
        return None

    # ---- $ref -------------------------------------------------------------------------------

    def _ref(self, ref: str, pointer: str, depth: int) -> str | None:
        target = self._resolve(ref)
        if target is None:
            return None  # remote, an anchor, or missing: the compiler's business
        node, target_pointer = target
        key = id(node)
        if key in self.productive:
            return None
        if not self.explaining:
            if key not in self.targets:  # the scan met every target; kept for safety
                self.targets[key] = target
                self._enqueue(key)
            self.users[key].add(self.current)
            return f"'{pointer}' refers to '{target_pointer}', which has no finite instance"
        if key in self.stack:  # back to a target being expanded: the cycle is the chain since
            start = self.stack[key]
            raise _Cycle([*self.chain[start:], self.chain[start]])
        self.stack[key] = len(self.chain)  # where its pointer goes on the chain
        try:
            return self._sub(node, target_pointer, depth)
        finally:
            del self.stack[key]

    def _resolve(self, ref: str) -> tuple[Any, str] | None:
        if ref in ("#", ""):
            return self.root, "#"
        if not ref.startswith("#/"):
            return None
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        if not isinstance(node, dict | bool):
            return None
        return node, ref


_ORDER = ("null", "boolean", "integer", "number", "string", "array", "object")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _range_why(kind: str, node: dict[str, Any], pointer: str) -> str | None:
    """Is there a number (an integer, for kind "integer") within the schema's bounds?"""
    lo, lo_open = _number(node.get("minimum")), False
    hi, hi_open = _number(node.get("maximum")), False
    exclusive_lo, exclusive_hi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if exclusive_lo is True:  # draft 4: a flag on minimum
        lo_open = lo is not None
    elif _number(exclusive_lo) is not None and (lo is None or _number(exclusive_lo) >= lo):
        lo, lo_open = _number(exclusive_lo), True
    if exclusive_hi is True:
        hi_open = hi is not None
    elif _number(exclusive_hi) is not None and (hi is None or _number(exclusive_hi) <= hi):
        hi, hi_open = _number(exclusive_hi), True
    if lo is None or hi is None:
        return None
    if kind == "integer":
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None
        first = math.floor(lo) + 1 if lo_open else math.ceil(lo)
        last = math.ceil(hi) - 1 if hi_open else math.floor(hi)
        if first > last:
            return f"'{pointer}' has no integer between its bounds ({_bounds(node)})"
        return None
    if lo > hi or (lo == hi and (lo_open or hi_open)):
        return f"'{pointer}' has no number between its bounds ({_bounds(node)})"
    return None


def _bounds(node: dict[str, Any]) -> str:
    keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
    return ", ".join(f"{k} {node[k]}" for k in keys if k in node)
