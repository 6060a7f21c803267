"""vLLM engine arguments servetwin does not implement yet: refused as "not supported yet" (naming them),
never as an unknown key with a wrong "did you mean"; docs/unsupported.md lists the same table."""
import pathlib
import re

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import NOT_SUPPORTED_YET, EngineArgs

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "unsupported.md"


@pytest.mark.parametrize("key", ["enable_lora", "cpu_offload_gb"])
def test_an_unsupported_vllm_argument_says_not_supported_yet(key):
    with pytest.raises(ConfigError) as info:
        EngineArgs.from_kwargs(model="tiny-llama", backend="fake", **{key: 2})
    assert info.value.path == key and "not supported yet" in str(info.value) and "did you mean" not in str(info.value)


def test_an_unknown_argument_still_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'max_num_seqs'"):
        EngineArgs.from_kwargs(model="tiny-llama", backend="fake", max_num_seq=2)


def test_the_docs_list_exactly_the_table():
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", DOCS.read_text(), flags=re.M)
    assert dict(rows) == NOT_SUPPORTED_YET
