"""gateway.config: every shipped config loads; bad ones fail with the field path and the bad value."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig, load_config, parse_config
from gateway.errors import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIGS_DIR.glob("*.yaml")) + sorted(CONFIGS_DIR.glob("*.yml"))


def make_config_data() -> dict[str, Any]:
    """A small valid config: one slice, a generate model and an embed model."""
    return {
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": 1}],
        "models": [
            {
                "name": "gen",
                "source": "/models/gen",
                "task": "generate",
                "max_model_len": 96,
                "buckets": [
                    {"max_input_tokens": 32, "batcher": {"kind": "continuous", "max_num_batched_tokens": 64}, "slice": "cpu0"},
                    {"max_input_tokens": 96, "batcher": {"kind": "continuous", "max_num_batched_tokens": 128}, "slice": "cpu0"},
                ],
            },
            {
                "name": "emb",
                "source": "/models/emb",
                "task": "embed",
                "max_model_len": 16,
                "buckets": [
                    {"max_input_tokens": 16, "batcher": {"kind": "dynamic", "max_batch_size": 8}, "slice": "cpu0"},
                ],
            },
        ],
    }


def config_error(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    return str(info.value)


def write_config(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_there_are_config_files() -> None:
    assert CONFIG_FILES, f"no configs in {CONFIGS_DIR}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, GatewayConfig)
    slice_names = {s.name for s in config.slices}
    for model in config.models:
        assert all(b.slice in slice_names for b in model.buckets)


def test_the_small_config_is_valid_and_fills_defaults(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, make_config_data()))
    gen, emb = config.models
    assert [b.bucket_name for b in gen.buckets] == ["le32", "le96"]
    assert gen.dtype == "float32"
    assert gen.buckets[0].batcher.kind == "continuous"
    assert emb.buckets[0].batcher.max_queue_delay_ms == 5.0  # type: ignore[union-attr]


def test_config_is_frozen() -> None:
    config = parse_config(make_config_data())
    with pytest.raises(Exception):
        config.slices[0].num_threads = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("edit", "path", "value"),
    [
        (lambda d: d["models"][1]["buckets"][0]["batcher"].update(max_batch_size=0),
         "models.1.buckets.0.batcher.max_batch_size", "0"),
        (lambda d: d["models"][1]["buckets"][0]["batcher"].update(max_queue_delay_ms=-1),
         "models.1.buckets.0.batcher.max_queue_delay_ms", "-1"),
        (lambda d: d["models"][0]["buckets"][0]["batcher"].update(max_num_seqs=0),
         "models.0.buckets.0.batcher.max_num_seqs", "0"),
        (lambda d: d["slices"][0].update(device="tpu:0"), "slices.0.device", "'tpu:0'"),
        (lambda d: d["slices"][0].update(device="cuda"), "slices.0.device", "'cuda'"),
        (lambda d: d["slices"][0].update(num_threads=0), "slices.0.num_threads", "0"),
        (lambda d: d["models"][0].update(task="translate"), "models.0.task", "'translate'"),
        (lambda d: d["models"][0].update(dtype="int4"), "models.0.dtype", "'int4'"),
        (lambda d: d["models"][0].update(max_model_len="long"), "models.0.max_model_len", "'long'"),
        (lambda d: d["models"][0].update(name="has space"), "models.0.name", "'has space'"),
        (lambda d: d["models"][0]["buckets"][0].update(max_input_tokens=0),
         "models.0.buckets.0.max_input_tokens", "0"),
        (lambda d: d["models"][0]["buckets"][0]["batcher"].update(kind="static"),
         "models.0.buckets.0.batcher", "static"),
    ],
    ids=[
        "max_batch_size_0", "negative_delay", "max_num_seqs_0", "bad_device", "cuda_without_index",
        "num_threads_0", "unknown_task", "unknown_dtype", "max_model_len_type", "model_name_pattern",
        "max_input_tokens_0", "unknown_batcher_kind",
    ],
)
def test_bad_field_names_its_path_and_value(edit: Any, path: str, value: str) -> None:
    data = make_config_data()
    edit(data)
    message = config_error(data)
    assert message.startswith("test.yaml: invalid config")
    line = next((l for l in message.splitlines() if l.strip().startswith(path)), None)
    assert line is not None, message
    assert value in line, message


def test_unknown_field_is_rejected_by_name() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][0]["batcher"]["max_batch_sise"] = 4
    data["slices"][0]["gpu_memory"] = "8GiB"
    message = config_error(data)
    assert "models.0.buckets.0.batcher.max_batch_sise" in message
    assert "slices.0.gpu_memory" in message
    assert "'8GiB'" in message


def test_unknown_top_level_field_is_rejected() -> None:
    data = make_config_data()
    data["modles"] = []
    assert "modles" in config_error(data)


def test_missing_required_field_is_named() -> None:
    data = make_config_data()
    del data["models"][0]["source"]
    message = config_error(data)
    assert "models.0.source" in message and "required" in message.lower()


def test_unknown_slice_is_named_with_its_path() -> None:
    data = make_config_data()
    data["models"][1]["buckets"][0]["slice"] = "gpu9"
    message = config_error(data)
    assert "models.1.buckets.0.slice" in message
    assert "'gpu9'" in message


@pytest.mark.parametrize("limits", [[64, 32], [32, 32]])
def test_bucket_limits_must_strictly_increase(limits: list[int]) -> None:
    data = make_config_data()
    for bucket, limit in zip(data["models"][0]["buckets"], limits):
        bucket["max_input_tokens"] = limit
    message = config_error(data)
    assert "models.0" in message and "strictly increasing" in message
    assert str(limits) in message


def test_bucket_limit_above_max_model_len_is_rejected() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][1]["max_input_tokens"] = 200
    message = config_error(data)
    assert "models.0" in message and "200" in message and "max_model_len" in message


def test_a_largest_bucket_short_of_max_model_len_is_rejected_naming_it() -> None:
    data = make_config_data()
    data["models"][0]["max_model_len"] = 2048  # buckets stop at 96: prompts of 97 to 2048 tokens would have none
    message = config_error(data)
    assert "models.0.buckets.1.max_input_tokens" in message and "2048" in message and "96" in message


def test_matryoshka_dimensions_are_for_embedding_models() -> None:
    data = make_config_data()
    data["models"][1]["matryoshka_dimensions"] = [8, 16]
    assert parse_config(data).models[1].matryoshka_dimensions == [8, 16]
    data["models"][0]["matryoshka_dimensions"] = [8]
    assert "models.0.matryoshka_dimensions" in config_error(data)
    data["models"][0].pop("matryoshka_dimensions")
    data["models"][1]["matryoshka_dimensions"] = [0]
    assert "models.1.matryoshka_dimensions.0" in config_error(data)


def test_the_default_config_reaches_max_model_len() -> None:
    config = load_config(CONFIGS_DIR / "default.yaml")
    for model in config.models:
        assert model.buckets[-1].max_input_tokens == model.max_model_len, model.name


@pytest.mark.parametrize(("model_index", "wrong_kind"), [(0, "dynamic"), (1, "continuous")])
def test_batcher_kind_must_match_the_task(model_index: int, wrong_kind: str) -> None:
    data = make_config_data()
    data["models"][model_index]["buckets"][0]["batcher"] = {"kind": wrong_kind}
    message = config_error(data)
    assert f"models.{model_index}" in message
    assert "buckets.0.batcher.kind" in message
    assert f"'{wrong_kind}'" in message


def test_step_budget_must_cover_one_decode_per_running_sequence() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][1]["batcher"].update(max_num_batched_tokens=50, max_num_seqs=64)
    message = config_error(data)
    assert "buckets.1.batcher.max_num_batched_tokens" in message and "50" in message and "max_num_seqs 64" in message


def test_a_step_budget_below_the_prompt_limit_is_fine_prompts_are_chunked() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][1]["batcher"].update(max_num_batched_tokens=16, max_num_seqs=8)
    assert parse_config(data).models[0].buckets[1].batcher.max_num_batched_tokens == 16  # type: ignore[union-attr]


def test_chunked_prefill_is_stall_free_by_default_and_reaches_the_batcher_settings() -> None:
    from gateway.build import batcher_settings

    data = make_config_data()
    data["models"][0]["buckets"][1]["batcher"].update(tpot_target_ms=40, chunked_prefill="fixed")
    config = parse_config(data)
    first, second = (batcher_settings(b) for b in config.models[0].buckets)
    assert (first.chunked_prefill, first.tpot_target_ms) == ("stall_free", None)  # type: ignore[union-attr]
    assert (second.chunked_prefill, second.tpot_target_s) == ("fixed", 0.04)  # type: ignore[union-attr]


@pytest.mark.parametrize(("field", "value"), [("tpot_target_ms", 0), ("chunked_prefill", "sometimes")])
def test_bad_chunked_prefill_settings_name_the_field(field: str, value: object) -> None:
    data = make_config_data()
    data["models"][0]["buckets"][0]["batcher"][field] = value
    assert f"models.0.buckets.0.batcher.{field}" in config_error(data)


def test_kv_memory_sizes_take_units_and_split_over_the_slice() -> None:
    from gateway.memory import split_kv_memory

    data = make_config_data()
    data["slices"][0]["kv_cache_memory_bytes"] = "1GiB"
    data["models"][0]["buckets"][0]["batcher"]["kv_cache_memory_fraction"] = 0.25
    config = parse_config(data)
    assert config.slices[0].kv_cache_memory_bytes == 1024**3
    shares = split_kv_memory(config, {"cpu0": 1024**3})
    assert shares == {("gen", "le32"): 1024**3 // 4, ("gen", "le96"): 3 * 1024**3 // 4}
    data["models"][0]["buckets"][1]["batcher"]["kv_cache_memory_bytes"] = "100MiB"
    shares = split_kv_memory(parse_config(data), {"cpu0": 1024**3})
    assert shares[("gen", "le96")] == 100 * 1024**2


def test_kv_memory_bytes_and_fraction_are_exclusive() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][0]["batcher"].update(kv_cache_memory_bytes="1GiB", kv_cache_memory_fraction=0.5)
    assert "buckets.0.batcher.kv_cache_memory_fraction" in config_error(data)


def test_kv_memory_fractions_over_one_are_rejected() -> None:
    data = make_config_data()
    for bucket in data["models"][0]["buckets"]:
        bucket["batcher"]["kv_cache_memory_fraction"] = 0.6
    message = config_error(data)
    assert "slices.0.kv_cache_memory_bytes" in message and "1.2" in message


def test_kv_memory_over_the_slice_budget_is_a_config_error() -> None:
    from gateway.memory import split_kv_memory

    data = make_config_data()
    data["models"][0]["buckets"][0]["batcher"]["kv_cache_memory_bytes"] = "2GiB"
    with pytest.raises(ConfigError, match="slice 'cpu0'"):
        split_kv_memory(parse_config(data), {"cpu0": 1024**3})


def test_a_bad_memory_size_names_the_field() -> None:
    data = make_config_data()
    data["slices"][0]["kv_cache_memory_bytes"] = "lots"
    assert "slices.0.kv_cache_memory_bytes" in config_error(data)


def test_duplicate_slice_and_model_names_are_rejected() -> None:
    data = make_config_data()
    data["slices"].append(copy.deepcopy(data["slices"][0]))
    assert "slices" in config_error(data) and "unique" in config_error(data)
    data = make_config_data()
    data["models"][1]["name"] = "gen"
    assert "models" in config_error(data) and "'gen'" in config_error(data)


def test_duplicate_bucket_names_are_rejected() -> None:
    data = make_config_data()
    for bucket in data["models"][0]["buckets"]:
        bucket["name"] = "same"
    assert "names must be unique" in config_error(data)


@pytest.mark.parametrize("data", [None, [], "slices"], ids=["empty", "list", "string"])
def test_a_document_that_is_not_a_mapping_is_rejected(data: object) -> None:
    assert "<root>" in config_error(data)


def test_malformed_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("slices: [\n  - name: cpu0\n models: {")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_load_config_names_the_file_and_field(tmp_path: Path) -> None:
    data = make_config_data()
    data["models"][1]["buckets"][0]["batcher"]["max_batch_size"] = 0
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "models.1.buckets.0.batcher.max_batch_size" in str(info.value)
    assert "(got 0)" in str(info.value)


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d["models"][1]["buckets"][0].update(batcher={"kind": "continuous"}), "models.1.buckets.0.batcher.kind"),
        (lambda d: d["models"][1]["buckets"][0].update(slice="gpu9"), "models.1.buckets.0.slice"),
    ],
    ids=["wrong_kind", "unknown_slice"],
)
def test_validator_errors_start_with_the_full_field_path(edit: Any, path: str) -> None:
    data = make_config_data()
    edit(data)
    lines = config_error(data).splitlines()[1:]
    assert any(line.strip().startswith(f"{path}: ") for line in lines), lines
    assert not any("Value error" in line for line in lines), lines


def test_request_limits_have_defaults() -> None:
    config = parse_config(make_config_data())
    assert config.max_request_body_bytes == 2 * 1024 * 1024
    assert all(m.max_tokens_cap is None and m.max_embedding_inputs == 2048 for m in config.models)


def test_request_limits_take_values_and_units() -> None:
    data = make_config_data()
    data["max_request_body_bytes"] = "64KiB"
    data["models"][0]["max_tokens_cap"] = 128
    data["models"][1]["max_embedding_inputs"] = 10
    config = parse_config(data)
    assert config.max_request_body_bytes == 64 * 1024
    assert (config.models[0].max_tokens_cap, config.models[1].max_embedding_inputs) == (128, 10)


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d["models"][0].update(max_tokens_cap=0), "models.0.max_tokens_cap"),
        (lambda d: d["models"][1].update(max_embedding_inputs=0), "models.1.max_embedding_inputs"),
        (lambda d: d.update(max_request_body_bytes=0), "max_request_body_bytes"),
    ],
)
def test_request_limits_must_be_positive(edit: Any, path: str) -> None:
    data = make_config_data()
    edit(data)
    assert f"{path}: " in config_error(data)


def test_queue_limits_have_defaults_and_are_validated() -> None:
    config = parse_config(make_config_data())
    bucket = config.models[0].buckets[0]
    assert (bucket.max_queue_len, bucket.max_queued_tokens) == (1024, None)
    data = make_config_data()
    data["models"][1]["buckets"][0].update(max_queue_len=2, max_queued_tokens=500)
    bucket = parse_config(data).models[1].buckets[0]
    assert (bucket.max_queue_len, bucket.max_queued_tokens) == (2, 500)
    data["models"][1]["buckets"][0]["max_queue_len"] = 0
    assert "models.1.buckets.0.max_queue_len" in config_error(data)


def test_a_bucket_gates_its_own_candidates_and_the_command_line_wins() -> None:
    from gateway import gate
    from gateway.gate_command import _with_overrides

    config = load_config(CONFIGS_DIR / "default.yaml")
    smollm2 = next(m for m in config.models if m.task == "generate")
    for bucket in smollm2.buckets:
        assert bucket.backend == "auto"
        assert gate.bucket_gate_config(config.gate, bucket).candidates == ["lean", "lean-int8", "lean-int4"]
    minilm = next(m for m in config.models if m.task == "embed")
    assert gate.bucket_gate_config(config.gate, minilm.buckets[0]).candidates == config.gate.candidates

    class Args:
        repeats = None
        candidates = "lean-int4"

    overridden = _with_overrides(config, Args())  # type: ignore[arg-type]
    for model in overridden.models:
        for bucket in model.buckets:
            assert gate.bucket_gate_config(overridden.gate, bucket).candidates == ["lean-int4"]


def test_gate_candidates_are_checked() -> None:
    data = make_config_data()
    data["models"][0]["buckets"][0]["gate_candidates"] = ["lean", "fast"]
    assert "models.0.buckets.0.gate_candidates.1" in config_error(data)
    data["models"][0]["buckets"][0]["gate_candidates"] = []
    assert "models.0.buckets.0.gate_candidates" in config_error(data)


def _with_lora(lora: dict[str, Any], model: int = 0) -> dict[str, Any]:
    data = make_config_data()
    data["models"][model]["lora"] = lora
    return data


def test_a_lora_block_fills_its_defaults() -> None:
    config = parse_config(_with_lora({"adapters": [{"name": "gen-sql", "path": "/adapters/sql"}]}))
    lora = config.models[0].lora
    assert lora is not None and (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.adapters_dir) == (8, 16, 32, None)
    assert lora.adapters[0].name == "gen-sql"


@pytest.mark.parametrize("lora, model, message", [
    ({}, 1, "models.1.lora: only a generation model serves LoRA adapters; emb embeds"),
    ({"max_loras": 0}, 0, "models.0.lora.max_loras: Input should be greater than or equal to 1"),
    ({"max_loras": 8, "max_cpu_loras": 4}, 0, "models.0.lora.max_cpu_loras: 4 is below max_loras 8"),
    ({"max_lora_rank": 0}, 0, "models.0.lora.max_lora_rank"),
    ({"adapters": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}, 0, "models.0.lora.adapters: names must be unique"),
    ({"adapters": [{"name": "emb", "path": "/x"}]}, 0, "models.0.lora.adapters.0.name: 'emb' is already a model's name"),
    ({"adapters": [{"name": "gen", "path": "/x"}]}, 0, "an adapter is named like its base model 'gen'"),
    ({"adapters": [{"name": "a"}]}, 0, "models.0.lora.adapters.0.path: Field required"),
    ({"max_lora": 8}, 0, "models.0.lora.max_lora: Extra inputs are not permitted"),
])
def test_a_bad_lora_block_names_its_field(lora: dict[str, Any], model: int, message: str) -> None:
    assert message in config_error(_with_lora(lora, model))


def test_adapter_names_are_unique_across_base_models() -> None:
    data = _with_lora({"adapters": [{"name": "a", "path": "/x"}]})
    data["models"].append({**copy.deepcopy(data["models"][0]), "name": "gen2"})
    assert "models.2.lora.adapters.0.name: 'a' is already an adapter of 'gen'" in config_error(data)


@pytest.mark.parametrize("backend", ["compiled", "onnx"])
def test_lora_refuses_backends_that_cannot_run_adapters(backend: str) -> None:
    data = _with_lora({})
    data["models"][0]["buckets"][1]["backend"] = backend
    message = config_error(data)
    assert "models.0.buckets.1.backend" in message and (backend == "onnx" or "cannot run LoRA adapters" in message)


def test_lora_takes_auto_and_lean_backends() -> None:
    data = _with_lora({})
    data["models"][0]["buckets"][0]["backend"] = "auto"
    data["models"][0]["buckets"][1]["backend"] = "lean"
    assert parse_config(data).models[0].lora is not None


def test_lora_on_a_process_slice_is_not_supported_yet() -> None:
    data = _with_lora({})
    data["slices"].append({"name": "iso", "isolation": "process"})
    data["models"][0]["buckets"][1]["slice"] = "iso"
    assert "models.0.lora: LoRA adapters on a slice with isolation: process are not supported yet" in config_error(data)


def test_a_lora_models_gate_measures_only_kinds_that_run_adapters() -> None:
    from gateway import gate

    data = _with_lora({})
    data["models"][0]["buckets"][0]["backend"] = "auto"
    data["models"][0]["buckets"][1].update(backend="auto", gate_candidates=["compiled", "lean-int8"])
    config = parse_config(data)
    model = config.models[0]
    assert gate.bucket_gate_config(config.gate, model.buckets[0], model).candidates == ["lean", "lean-int8", "lean-int4"]
    assert gate.bucket_gate_config(config.gate, model.buckets[1], model).candidates == ["lean-int8"]
    assert gate.bucket_gate_config(config.gate, model.buckets[1]).candidates == ["compiled", "lean-int8"]
