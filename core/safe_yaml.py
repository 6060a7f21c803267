"""YAML for untrusted files: `yaml.SafeLoader` with bounds, so no document exhausts memory or the stack.

- Aliases: the document's size is counted with every alias expanded, on the node graph and before any
  Python object is built (an alias bomb of 9 levels x 9 references is 9^9 nodes but 600 bytes). Over
  `MAX_DOCUMENT_NODES` it is refused; the error names the file, never the expanded value. A recursive
  alias (`&a [*a]`) is refused too.
- Nesting: composing is recursive in PyYAML; a document nested deeper than `MAX_NESTING_DEPTH` is
  refused while composing, before Python's recursion limit is near.
- A key given twice in one mapping is refused (PyYAML keeps the last one silently, so a second
  `engine:` block would drop the first without a word).
- A value Python cannot build (an integer of more than 4300 digits) is an error at its line.
Errors are `ConfigError`s at the given field, with the file, line and column, without the source
line (which may be anything, e.g. a secret).
"""
from __future__ import annotations

from typing import Any

import yaml

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import MAX_CONFIG_FILE_BYTES, MAX_DOCUMENT_NODES, MAX_NESTING_DEPTH, read_text


class SafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with the bounds above (`max_nodes`, `max_depth` per class)."""

    max_nodes = MAX_DOCUMENT_NODES
    max_depth = MAX_NESTING_DEPTH

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.ScalarEvent, yaml.events.AliasEvent):
            # a scalar or an alias opens no level: the depth counts collections, as JSON's nesting_depth does
            # (a 64-deep list holding a scalar is 64 levels, not 65)
            return super().compose_node(parent, index)
        depth = getattr(self, "servetwin_depth", 0)
        if depth >= self.max_depth:
            raise yaml.composer.ComposerError(None, None, f"nested more than {self.max_depth} levels deep",
                                              self.peek_event().start_mark)
        self.servetwin_depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.servetwin_depth = depth

    def compose_document(self) -> Any:
        node = super().compose_document()
        expanded_size(node, self.max_nodes)
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except ValueError as e:  # e.g. int() of 5000 digits: Python's own message, not the value
            text = str(e).split("\n", 1)[0]
            text = "an integer of too many digits" if "digits" in text else text[:120]
            raise yaml.constructor.ConstructorError(None, None, f"cannot build this value ({text})",
                                                    node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: keys after it override the merged ones, as YAML intends
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class reports unhashable keys
            if key in seen:
                shown = repr(key) if len(repr(key)) <= 60 else repr(key)[:57] + "..."
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown} (first given on line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def expanded_size(root: Any, limit: int) -> int:
    """Nodes of the document with every alias expanded, computed on the (shared) node graph without
    expanding it; a `ComposerError` once it passes `limit` or when an alias refers to itself."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            if total > limit:
                raise yaml.composer.ComposerError(None, None, f"the document expands to more than {limit} nodes "
                                                  "(aliases counted once per use)", node.start_mark)
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise yaml.composer.ComposerError(None, None, "an alias refers to its own node", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)]


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _error_text(e: yaml.YAMLError) -> str:
    """The parser's problem and where, without the source snippet PyYAML appends."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or "invalid YAML"
        if mark is not None:
            return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
        return problem
    return str(e).split("\n", 1)[0][:200]


def load_yaml_text(text: str, path: Any, where: str) -> Any:
    """Parse `text` (from `path`, for messages) with `SafeLoader`; a `ConfigError` at `where`."""
    try:
        return yaml.load(text, Loader=SafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(where, f"{path} is not valid YAML: {_error_text(e)}") from None
    except RecursionError:  # a flow collection PyYAML's parser nests on its own (never seen; the safety net)
        raise ConfigError(where, f"{path} is nested too deeply") from None


def load_yaml_file(path: Any, where: str, max_bytes: int = MAX_CONFIG_FILE_BYTES) -> Any:
    """A YAML file, size-checked and decoded (`core.limits.read_text`), then `load_yaml_text`."""
    return load_yaml_text(read_text(path, where, max_bytes), path, where)


__all__ = ["SafeLoader", "expanded_size", "load_yaml_text", "load_yaml_file"]
