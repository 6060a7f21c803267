"""`core.limits` and `core.safe_yaml` (issue 27): bounded nesting, alias expansion, sizes and encodings for
every untrusted document, each violation a `ConfigError` naming the field, never another exception."""
from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import (check_file_size, load_json_file, load_json_text, nesting_depth, read_text)
from servetwin.core.safe_yaml import SafeLoader, expanded_size, load_yaml_text

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                           max_leaves=20)


def recursive_depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(recursive_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(recursive_depth, v), default=0)
    return 0


@given(json_values)
def test_nesting_depth_matches_the_recursive_definition(v):
    assert nesting_depth(v) == recursive_depth(v)
    assert nesting_depth(v, limit=1) == min(recursive_depth(v), 2)  # stops as soon as it passes the limit


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(0, 5000), kind=st.sampled_from(["[", "{"]))
def test_json_nesting_is_an_error_past_the_limit(depth, kind):
    text = ('{"a": ' * depth + "1" + "}" * depth) if kind == "{" else ("[" * depth + "1" + "]" * depth)
    if depth <= 64:
        assert nesting_depth(load_json_text(text, "f.json", "scenario")) == depth
    else:
        with pytest.raises(ConfigError, match=r"^scenario: f\.json is nested more than 64 levels"):
            load_json_text(text, "f.json", "scenario")


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(0, 300), flow=st.booleans())  # 10^5 levels: tests/experiments/test_exp_hostile_files.py
@example(depth=63, flow=False).via("the limit: 64 lists, the innermost holding a scalar")  # (once refused)
@example(depth=64, flow=False).via("one past it")
@example(depth=64, flow=True).via("the limit, flow style")
@example(depth=65, flow=True).via("one past it, flow style")
def test_yaml_nesting_is_an_error_past_the_limit(depth, flow):
    text = ("[" * depth + "]" * depth) if flow else "".join("  " * i + "- \n" for i in range(depth)) + "  " * depth + "- 1\n"
    levels = depth if flow else depth + 1
    if levels <= 64:
        load_yaml_text(text, "c.yaml", "config")
    else:
        with pytest.raises(ConfigError, match=r"^config: c\.yaml is not valid YAML: nested more than 64"):
            load_yaml_text(text, "c.yaml", "config")


def alias_bomb(levels: int, fanout: int) -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nseed: *l{levels - 1}\n"


class SmallLoader(SafeLoader):
    max_nodes = 2000


@settings(max_examples=40, deadline=None)
@given(levels=st.integers(1, 12), fanout=st.integers(1, 9))
def test_alias_expansion_is_counted_before_anything_is_built(levels, fanout):
    """Refused exactly when the document, every alias expanded, has more nodes than the limit; the
    count never expands anything (9 levels x 9 is 10^9 nodes, counted in microseconds)."""
    text = alias_bomb(levels, fanout)
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    per_level = [fanout + 1]  # l0: the sequence and its scalars
    for _ in range(1, levels):
        per_level.append(1 + fanout * per_level[-1])
    # the root mapping, each key scalar, each level's value once more for `seed`
    expected = 1 + sum(1 + n for n in per_level) + 1 + per_level[-1]
    assert expanded_size(node, 10 ** 30) == expected
    if expected > SmallLoader.max_nodes:
        with pytest.raises(yaml.composer.ComposerError, match="expands to more than 2000 nodes"):
            yaml.load(text, Loader=SmallLoader)  # noqa: S506
    else:
        assert yaml.load(text, Loader=SmallLoader)["seed"] is not None  # noqa: S506


def test_the_real_bomb_and_a_self_alias_are_config_errors_without_the_value():
    with pytest.raises(ConfigError) as e:
        load_yaml_text(alias_bomb(9, 9), "c.yaml", "config")
    assert "expands to more than" in str(e.value) and "'x'" not in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(ConfigError, match="refers to its own node"):
        load_yaml_text("a: &a [*a]\n", "c.yaml", "config")


def test_yaml_duplicate_keys_huge_ints_and_errors_without_the_source_line():
    with pytest.raises(ConfigError, match="duplicate key 'engine'"):
        load_yaml_text("engine: {}\nengine: {}\n", "c.yaml", "config")
    with pytest.raises(ConfigError, match="too many digits") as e:
        load_yaml_text("seed: " + "9" * 5000 + "\n", "c.yaml", "config")
    assert "9999" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_yaml_text("secret: hunter2\n  bad: [", "c.yaml", "config")
    assert "hunter2" not in str(e.value) and "line" in str(e.value)


def test_json_duplicate_keys_and_huge_ints():
    with pytest.raises(ConfigError, match="duplicate key 'settings'"):
        load_json_text('{"settings": 1, "settings": 2}', "s.json", "scenario", unique_keys=True)
    assert load_json_text('{"a": 1, "a": 2}', "s.json", "scenario") == {"a": 2}
    with pytest.raises(ConfigError, match=r"^scenario: s\.json is not valid JSON"):
        load_json_text("[" + "9" * 5000 + "]", "s.json", "scenario")


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=64), encoding=st.sampled_from(["raw", "utf-16", "latin-1", "utf-8-sig"]))
def test_any_bytes_are_a_value_or_a_config_error(tmp_path_factory, data, encoding):
    """Every reader, any bytes (binary, other encodings, a BOM): a value or a ConfigError naming the field."""
    if encoding != "raw":
        data = data.decode("latin-1").encode(encoding)
    path = tmp_path_factory.mktemp("bytes") / "f"
    path.write_bytes(data)
    for read in (lambda: load_json_file(path, "scenario"), lambda: read_text(path, "model"),
                 lambda: load_yaml_text(read_text(path, "config"), path, "config")):
        try:
            read()
        except ConfigError as e:
            assert e.path in ("scenario", "model", "config")


def test_files_are_sized_before_they_are_read(tmp_path):
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # sparse: no disk used, no memory if it were read
    with pytest.raises(ConfigError, match=r"is 3221225472 bytes, more than the limit"):
        load_json_file(big, "model")
    for special in ("/proc/self/mem", "/proc/self/environ", "/dev/zero"):
        with pytest.raises(ConfigError, match=r"^model: .* is not a regular file"):
            check_file_size(special, "model", 1 << 20)
    with pytest.raises(ConfigError, match="is a folder"):
        read_text(tmp_path, "model")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"a": 1}).encode())
    assert load_json_file(tmp_path / "bom.json", "scenario") == {"a": 1}


# -- issue 38: the importers' bounded reader, numbers, echoed text -----------------------------------------
def test_read_bytes_inflates_gzip_up_to_its_limit_only(tmp_path):
    import gzip

    from servetwin.core.limits import read_bytes, read_head

    f = tmp_path / "a.gz"
    f.write_bytes(gzip.compress(b"x" * 5000))
    assert read_bytes(f, "w", limit=5000) == b"x" * 5000 and read_head(f, "w", 10) == b"x" * 10
    with pytest.raises(ConfigError, match="inflates to more than the limit of 4999 bytes"):
        read_bytes(f, "w", limit=4999)
    f.write_bytes(gzip.compress(b"x" * 5000)[:20])
    with pytest.raises(ConfigError, match="is not a readable gzip file"):
        read_bytes(f, "w")


@given(st.one_of(st.integers(-10 ** 500, 10 ** 500), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3)))
def test_bounded_number_returns_a_finite_float_in_range_or_names_the_field(v):
    from servetwin.core.limits import bounded_number

    try:
        out = bounded_number(v, "f.x", low=0.0, high=1e6)
    except ConfigError as e:
        assert e.path == "f.x" and len(str(e)) < 200  # a 500-digit value is described, not printed
    else:
        assert not isinstance(v, (bool, str)) and 0.0 <= out <= 1e6 and out == float(v)


def test_printable_escapes_every_control_character():
    from servetwin.core.limits import printable

    assert printable("a\x1b[2Jb\u202e\x07") == "a\\x1b[2Jb\\u202e\\x07"
    assert printable("x" * 300, 10) == "xxxxxxx..." and printable("plain text") == "plain text"
