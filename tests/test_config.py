"""Configuration is validated at the edge with messages that name the field and the value."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, EngineConfig, context_length_error, resolve_max_model_len


@pytest.mark.parametrize("field,value,message", [
    ("block_size", 12, "block_size = 12 is not allowed: allowed 8, 16, 32, 64 or 128"),
    ("max_num_seqs", 0, "max_num_seqs = 0 is out of range: allowed 1 to 1024"),
    ("kv_cache_dtype", "int3", "kv_cache_dtype = 'int3' is not allowed: allowed 'auto', "),
    ("kv_cache_dtype", "int8", "kv_cache_dtype = 'int8' is not supported by any backend here"),
    ("num_kv_blocks", 1, r"num_kv_blocks = 1 is out of range: allowed 2 or more \(or null\)"),
    ("max_num_batched_tokens", 8, r"max_num_batched_tokens = 8 is out of range: allowed block_size \(16\) or more"),
])
def test_bad_values_are_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{field: value}).validate()


@pytest.mark.parametrize("field,value", [("block_size", 12), ("max_num_seqs", 2000), ("quantization", "fp8"),
                                         ("gpu_memory_utilization", 1.5), ("max_model_len", 1)])
def test_a_flag_and_an_upload_are_refused_in_the_same_words(field, value):
    """One check per engine field: the flag's message is the upload's without its prefix."""
    from shared.control.deploy_config import FrameworkConfig

    with pytest.raises(ConfigError) as flag:
        EngineConfig(**{field: value}).validate()
    with pytest.raises(ConfigError) as upload:
        FrameworkConfig(**{field: value}).validate("cpu")
    assert str(upload.value) == "framework_config." + str(flag.value)


def test_max_model_len_never_exceeds_the_model():
    assert resolve_max_model_len(None, 8192) == 8192
    assert resolve_max_model_len(2048, 8192) == 2048
    with pytest.raises(ConfigError, match="max_model_len 9000 exceeds the model's context length 8192"):
        resolve_max_model_len(9000, 8192)


def test_context_length_message_names_both_numbers():
    assert context_length_error(100, 90, 10) is None
    message = context_length_error(100, 90, 11)
    assert "maximum context length is 100 tokens" in message and "101 tokens (90 in the prompt, 11 in" in message


def test_launcher_refuses_a_flag_no_service_reads(capsys):
    from switchyard.service_flags import check_service_args

    check_service_args(["--max-num-seqs", "8", "--threads", "1", "--no-enable-prefix-caching"])
    with pytest.raises(SystemExit):
        check_service_args(["--max-num-seq", "8"])
    assert "unrecognized arguments: --max-num-seq 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a value the engine refuses: said before any service starts
        check_service_args(["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'])
    assert "method 'medusa' is not built here yet" in capsys.readouterr().err


def test_openai_config_is_validated_by_field():
    from services.api.openai.defaults import load_openai_config

    config = load_openai_config(
        '{"enabled": true, "completion_config": {"temperature": 0.3, "max_tokens": 200},'
        ' "chat_completion_config": {"max_tokens": 50, "chat_template": "{{ messages }}"}}')
    assert config.completion == {"temperature": 0.3, "max_tokens": 200} and config.chat == {"max_tokens": 50}
    assert config.chat_template == "{{ messages }}" and config.enabled
    assert not load_openai_config('{"enabled": false}').enabled
    with pytest.raises(ConfigError, match="enabled must be true or false"):
        load_openai_config('{"enabled": "yes"}')
    with pytest.raises(ConfigError, match=r"completion_config has keys that are not request fields: \['temprature'\]"):
        load_openai_config('{"completion_config": {"temprature": 0.3}}')
    with pytest.raises(ConfigError, match="chat_completion_config.temperature: Input should be less than or equal"):
        load_openai_config('{"chat_completion_config": {"temperature": 9}}')
    with pytest.raises(ConfigError, match="unknown keys"):
        load_openai_config('{"completions": {}}')


def test_api_keys_compare_every_key():
    from services.api.guards import is_valid_key

    keys = ("alpha", "beta")
    assert is_valid_key("Bearer beta", keys) and is_valid_key("Bearer alpha", keys)
    assert not is_valid_key("Bearer gamma", keys) and not is_valid_key("beta", keys) and not is_valid_key(None, keys)


def test_worker_refuses_a_kv_pool_smaller_than_one_full_context():
    import torch

    from services.worker.backends.kv_pool import KVSpec
    from services.worker.model_config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    kv = KVSpec.of(cfg, block_size=16, dtype=torch.float32)
    kv.check_capacity(num_blocks=128, max_model_len=2048)
    with pytest.raises(ConfigError, match="holds 2032 tokens .* fewer than max_model_len 2048: give it at least"):
        kv.check_capacity(num_blocks=127, max_model_len=2048)
    # the budget pays for the null block too: 129 blocks' bytes give 128 the scheduler can hand out
    assert kv.num_blocks_for_budget(129 * kv.bytes_per_block) == 128


@pytest.mark.parametrize("value,expected", [("1", True), ("TRUE", True), ("yes", True), ("on", True), ("0", False),
                                            ("false", False), ("No", False), ("off", False), ("", None)])
def test_a_boolean_flags_variable_reads_the_words_users_write(monkeypatch, value, expected):
    """One parser for every boolean SY_* variable (SY_COMPILE, SY_DETERMINISTIC, ...); unset or empty: the flag's default."""
    import argparse

    from shared.config import add_worker_args

    monkeypatch.setenv("SY_COMPILE", value)
    monkeypatch.setenv("SY_DETERMINISTIC", value)
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    args = parser.parse_args([])
    assert args.compile is expected and args.deterministic is (False if expected is None else expected)


def test_a_boolean_flags_variable_that_is_no_boolean_is_refused_by_name(monkeypatch):
    import argparse

    from shared.config import ConfigError, add_worker_args

    monkeypatch.setenv("SY_DETERMINISTIC", "Maybe")
    with pytest.raises(ConfigError, match="SY_DETERMINISTIC='Maybe'"):
        add_worker_args(argparse.ArgumentParser())


@pytest.mark.parametrize(("value", "ok"), [("0", True), ("19", True), ("25", False), ("-1", False)])
def test_the_background_compiles_niceness_is_a_niceness(monkeypatch, default_model_path, value, ok):
    """--compile-nice (SY_COMPILE_NICE): 0 to 19, the default 19 (tests/test_defaults_stack.py runs 0)."""
    import sys

    from services.worker.__main__ import parse_args
    from services.worker.settings import resolve

    monkeypatch.setattr(sys, "argv", ["worker", "--model-path", default_model_path, "--compile-nice", value])
    if ok:
        assert resolve(parse_args()).compile_nice == int(value)
    else:
        with pytest.raises(ConfigError, match=f"--compile-nice = {value} is out of range: allowed 0 to 19"):
            resolve(parse_args())
    monkeypatch.setattr(sys, "argv", ["worker", "--model-path", default_model_path])
    monkeypatch.setenv("SY_COMPILE_NICE", "7")
    assert resolve(parse_args()).compile_nice == 7


@pytest.mark.parametrize("value,message", [
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "'NixlConnector' is vLLM's and not built here"),
    ('{"kv_role": "kv_both", "kv_ip": "10.0.0.1", "kv_port": 14579}', "kv_ip, kv_port configure a network transport"),
    ('{"kv_role": "prefill"}', "kv_role 'prefill' is not one of"),
    ('{"kv_rolle": "kv_producer"}', "keys taken here: kv_connector, kv_role"),
    ("[1]", "must be a JSON object"),
])
def test_kv_transfer_config_takes_vllms_keys_and_refuses_what_is_not_built(value, message):
    from shared.kv_transfer import parse_kv_transfer_config

    with pytest.raises(ConfigError, match=message):
        parse_kv_transfer_config(value)


def test_kv_transfer_config_needs_the_host_tier_and_the_launcher_says_so(capsys):
    from shared.kv_transfer import parse_kv_transfer_config
    from switchyard.launcher import main

    config = parse_kv_transfer_config('{"kv_role": "kv_consumer"}')
    assert (config.kv_connector, config.kv_role) == ("SharedMemoryConnector", "kv_consumer")
    with pytest.raises(ConfigError, match="give it --kv-offloading-size"):
        EngineConfig(kv_transfer_config=config).validate()
    EngineConfig(kv_transfer_config=config, kv_offloading_size=1.0).validate()
    with pytest.raises(ConfigError, match="kv_offloading_size = -1 is out of range"):
        EngineConfig(kv_offloading_size=-1).validate()
    for argv, said in ((["--prefill-workers", "1"], "go together"),
                       (["--prefill-workers", "1", "--decode-workers", "2"], "give it --kv-offloading-size")):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err
