"""vLLM's `kv_transfer_config` as users give it (LLM kwargs, EngineArgs, --kv-transfer-config JSON):
parsed once into a `KVTransferConfig`, errors naming `kv_transfer_config.<field>`, and handed through
EngineCore to the scheduler's connector."""
from __future__ import annotations

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.nixl import NixlConnector
from servetwin.core.kv_connector.offloading import OffloadingConnector

OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24}}


def test_vllms_keys_parse_from_a_mapping_and_json():
    c = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                    "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": {"kv_lease_duration": 5}})
    assert (c.kv_role, c.kv_load_failure_policy, c.get_from_extra_config("kv_lease_duration", 0)) == \
        ("kv_producer", "recompute", 5)
    assert KVTransferConfig.from_dict(c.to_dict()) == c
    assert KVTransferConfig.from_dict('{"kv_connector": "NixlConnector"}').kv_role == "kv_both"


@pytest.mark.parametrize("raw, path", [
    ({"kv_role": "kv_both"}, "kv_transfer_config.kv_connector"),
    ({"kv_connector": ""}, "kv_transfer_config.kv_connector"),
    ({"kv_connector": "NoSuchConnector"}, "kv_transfer_config.kv_connector"),
    ({"kv_connector": "NixlConnector", "kv_role": "reader"}, "kv_transfer_config.kv_role"),
    ({"kv_connector": "NixlConnector", "kv_load_failure_policy": "retry"}, "kv_transfer_config.kv_load_failure_policy"),
    ({"kv_connector": "NixlConnector", "kv_connector_extra_config": [1]}, "kv_transfer_config.kv_connector_extra_config"),
    ({"kv_connector": "X", "kv_connector_module_path": "servetwin.no_such_module"},
     "kv_transfer_config.kv_connector_module_path"),
    ({"kv_connector": "X", "kv_connector_module_path": 3}, "kv_transfer_config.kv_connector_module_path"),
    ({"kv_connector": "NixlConnector", "role": "kv_both"}, "kv_transfer_config.role"),
    ({"kv_connector": "OffloadingConnector"}, "kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "mru"}},
     "kv_transfer_config.kv_connector_extra_config.eviction_policy"),
    ("{not json", "kv_transfer_config"),
    ([1], "kv_transfer_config"),
])
def test_bad_kv_transfer_config_names_the_field(raw, path):
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(backend="fake", kv_transfer_config=raw)
    assert e.value.path == path


@pytest.mark.parametrize("raw, cls", [({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}, NixlConnector),
                                      (OFFLOAD, OffloadingConnector)])
def test_engine_core_hands_the_config_to_the_scheduler(raw, cls):
    for backend in ("fake", "sim"):
        args = EngineArgs.from_kwargs(backend=backend, model="tiny-llama" if backend == "fake" else "qwen3-8b",
                                      kv_transfer_config=raw, num_gpu_blocks=64, max_model_len=512)
        core, _ = create_engine_core(args)
        assert isinstance(core.scheduler.connector, cls), backend
        given = KVTransferConfig.from_dict(raw)
        assert (core.scheduler.kv_transfer_config.kv_connector, core.scheduler.kv_transfer_config.kv_role) == \
            (given.kv_connector, given.kv_role)


def test_without_kv_transfer_config_there_is_no_connector():
    core, _ = create_engine_core(EngineArgs.from_kwargs(backend="fake", num_gpu_blocks=64, max_model_len=512))
    assert core.scheduler.connector is None
