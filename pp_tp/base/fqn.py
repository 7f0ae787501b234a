"""Module-name patterns, as torch's `parallelize_module` matches them: one home for every reader of a plan's rules
(tensor parallel, experts, checkpoints)."""

from __future__ import annotations

from fnmatch import fnmatch


def matches_rule(rule: str, fqn: str) -> bool:
    """`parallelize_module`'s matching: same number of components, fnmatch on each."""
    parts, names = rule.split("."), fqn.split(".")
    return len(parts) == len(names) and all(fnmatch(n, p) for n, p in zip(names, parts))
