"""Building and running what a config describes: slices, loaded models, bucket tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog

from buckets.bucket import Bucket, BucketTable
from buckets.continuous import ContinuousBatcher
from buckets.device_slice import DeviceSlice
from buckets.dynamic import DynamicBatcher
from buckets.settings import ContinuousBatcherSettings, DynamicBatcherSettings
from gateway.config import BucketConfig, ContinuousBatcherConfig, GatewayConfig, ModelConfig
from models.loader import LoadedModel, load_model
from models.source import default_cache_dir

log = structlog.get_logger(__name__)


@dataclass
class ServedModel:
    """A loaded model and the bucket table requests are routed through."""

    config: ModelConfig
    loaded: LoadedModel
    table: BucketTable


class Engine:
    """Owns the device slices and served models of one gateway process.

    :meth:`start` loads every model (slow: seconds) and starts the slice workers; call it off the
    event loop. :meth:`stop` stops the workers and fails whatever is still queued.
    """

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
        self.slices = {s.name: DeviceSlice(s.name, s.device, s.num_threads) for s in config.slices}
        self.models: dict[str, ServedModel] = {}

    def start(self) -> None:
        for model_config in self.config.models:
            self.models[model_config.name] = self._load(model_config)
        for device_slice in self.slices.values():
            device_slice.start()

    def stop(self) -> None:
        for device_slice in self.slices.values():
            device_slice.stop()

    def _load(self, config: ModelConfig) -> ServedModel:
        device = self.slices[config.buckets[0].slice].device
        loaded = load_model(config.name, config.source, config.task, config.dtype, device, self.cache_dir)
        log.info("model_loaded", model=config.name, folder=str(loaded.folder), load_s=round(loaded.load_s, 3))
        buckets = [self._bucket(config, loaded, b) for b in config.buckets]
        for bucket in buckets:
            bucket.device_slice.attach(bucket.batcher)
        return ServedModel(config=config, loaded=loaded, table=BucketTable(buckets))

    def _bucket(self, model: ModelConfig, loaded: LoadedModel, config: BucketConfig) -> Bucket:
        device_slice = self.slices[config.slice]
        batcher: ContinuousBatcher | DynamicBatcher
        if isinstance(config.batcher, ContinuousBatcherConfig):
            from models.causal_lm import CausalLMRunner

            settings = ContinuousBatcherSettings(config.batcher.max_num_seqs, config.batcher.max_num_batched_tokens)
            batcher = ContinuousBatcher(CausalLMRunner(loaded.model), settings, loaded.tokenizer, loaded.eos_token_ids)
        else:
            from models.encoder import EmbeddingRunner

            pad_id = loaded.tokenizer.pad_token_id or 0
            runner = EmbeddingRunner(loaded.model, pad_id, loaded.folder)
            batcher = DynamicBatcher(runner, DynamicBatcherSettings(config.batcher.max_batch_size, config.batcher.max_queue_delay_ms))
        return Bucket(config.bucket_name, model.name, config.max_input_tokens, batcher, device_slice)
